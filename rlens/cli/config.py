"""``rlens config``: check a configuration file, and show the configuration in effect (secrets redacted)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rlens.cli.common import CONFIG, console, fail, use_config

app = typer.Typer(help="The configuration file (rlens.toml): check one, show what is in effect.", no_args_is_help=True)


@app.command("check")
def config_check(path: Path = typer.Argument(..., help="the configuration file")) -> None:
    """Validate a configuration file: every group and key known, every value valid, the pool's models well formed."""
    from rlens.models.pool import PoolConfigError
    from rlens.service.run import pool_of
    from rlens.settings import Settings

    use_config(path)  # unknown keys and invalid values: one line each, exit 2
    s = Settings()
    pool = ""
    if s.pool.models is not None or s.pool.file is not None:
        try:
            models = pool_of(s).models
        except (PoolConfigError, ValueError) as exc:
            fail(str(exc))
        pool = f"; a pool of {len(models)} models ({', '.join(m.name for m in models)})"
    console.print(f"{path}: valid{pool}", highlight=False)


@app.command("show")
def config_show(
    config: Path | None = CONFIG,
    as_json: bool = typer.Option(False, "--json", help="JSON instead of TOML-like groups"),
) -> None:
    """The configuration in effect (file, then RLENS_* variables over it, then defaults), secrets redacted."""
    from rlens.service.common.security import redact_secrets
    from rlens.settings import Settings

    s = Settings()
    groups = redact_secrets(
        {group: {key: getattr(model, key) for key in type(model).model_fields} for group, model in s}
    )
    plain = json.loads(json.dumps(groups, default=str))
    if as_json:
        print(json.dumps(plain, indent=1))
        return
    for group, keys in plain.items():
        print(f"[{group}]")
        for key, value in keys.items():
            if key != "models":
                print(f"# {key}: not set" if value is None else f"{key} = {toml_value(value)}")
        for model in keys.get("models") or []:
            print(f"[[{group}.models]]")
            for k, v in model.items():
                print(f"{k} = {toml_value(v)}")
        print()


def toml_value(value) -> str:
    """A JSON-like value as TOML (strings, numbers, booleans, arrays, inline tables)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items() if v is not None) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)
