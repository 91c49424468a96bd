"""The ``rlens`` command line (typer + rich): one module per command group, each command parsing its options and
calling the package code that does the work."""

from __future__ import annotations

import signal
import threading

# Ctrl-C while the command line loads: a quiet exit (130), as Ctrl-C in a command gets. A KeyboardInterrupt raised in
# the middle of an import can land in one of importlib's callbacks, which Python reports as "Exception ignored" with
# a traceback and goes on; so while the modules load and typer's commands are built (to the end of this module), a
# SIGINT is only noted (where this thread may set handlers and SIGINT is not ignored), and acted on after.
_interrupts: list[int] = []
_noting = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) not in (
    signal.SIG_IGN,
    None,
)
_previous = signal.signal(signal.SIGINT, lambda signum, frame: _interrupts.append(signum)) if _noting else None
try:
    import typer

    from rlens.cli import capacity, config, importers, keys, local, models, ope, policy, replay, rlae, service, zoo
except BaseException as exc:  # an import failed: SIGINT's handler back before the error goes up
    if _noting:
        signal.signal(signal.SIGINT, _previous)
    if isinstance(exc, KeyboardInterrupt):
        raise SystemExit(130) from None
    raise

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


def main() -> None:
    """The ``rlens`` command: :data:`app`, and a Ctrl-C that no command handles (while typer builds the command
    tree, say) a quiet exit 130 too."""
    try:
        app()
    except KeyboardInterrupt:
        raise SystemExit(130) from None


# loaded and built: Ctrl-C acts again, and one noted meanwhile exits now
if _noting:
    signal.signal(signal.SIGINT, _previous)
if _interrupts:
    raise SystemExit(130)
