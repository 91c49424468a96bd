"""The ``rlens`` command line (typer + rich): one module per command group, each command parsing its options and
calling the package code that does the work."""

from __future__ import annotations

try:
    import typer

    from rlens.cli import capacity, config, importers, keys, local, models, ope, policy, replay, rlae, service, zoo
except KeyboardInterrupt:  # Ctrl-C while the command line loads: a quiet exit, as Ctrl-C in a command gets
    raise SystemExit(130) from None

app = typer.Typer(help="rlens: LLM ensembles that learn from feedback.", no_args_is_help=True, add_completion=False)
LOGGING_COMMANDS = ("worker", "learner", "gateway")  # their processes log the same warnings as records


@app.callback()
def check_variables(ctx: typer.Context) -> None:
    """rlens: LLM ensembles that learn from feedback."""
    from rlens.cli.common import errors
    from rlens.service.common.logs import warn_unknown_variables

    if ctx.invoked_subcommand not in LOGGING_COMMANDS:
        warn_unknown_variables(lambda line: errors.print(f"warning: {line}", highlight=False))


app.command()(replay.replay)
app.command()(replay.demo)
app.command()(ope.ope)
app.command()(local.up)
app.command()(local.load)
app.command()(service.worker)
app.command()(service.learner)
app.command()(service.gateway)
app.command()(service.secrets)
app.command()(capacity.capacity)
app.command("serve-model")(models.serve_model)
app.add_typer(models.pool_app, name="pool")
app.add_typer(keys.app, name="keys")
app.add_typer(policy.app, name="policy")
app.add_typer(config.app, name="config")
app.add_typer(zoo.app, name="zoo")
app.add_typer(rlae.app, name="rlae")
app.add_typer(importers.app, name="import")
