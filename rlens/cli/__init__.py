"""The ``rlens`` command line (typer + rich): one module per command group, each command parsing its options and
calling the package code that does the work."""

from __future__ import annotations

import typer

from rlens.cli import config, importers, keys, local, models, ope, policy, replay, rlae, service, zoo

app = typer.Typer(help="rlens: LLM ensembles that learn from feedback.", no_args_is_help=True, add_completion=False)
app.command()(replay.replay)
app.command()(replay.demo)
app.command()(ope.ope)
app.command()(local.up)
app.command()(local.load)
app.command()(service.worker)
app.command()(service.learner)
app.command()(service.gateway)
app.command()(service.secrets)
app.command("serve-model")(models.serve_model)
app.add_typer(models.pool_app, name="pool")
app.add_typer(keys.app, name="keys")
app.add_typer(policy.app, name="policy")
app.add_typer(config.app, name="config")
app.add_typer(zoo.app, name="zoo")
app.add_typer(rlae.app, name="rlae")
app.add_typer(importers.app, name="import")
