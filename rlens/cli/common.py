"""What every command shares: the consoles, one-line errors and interruptions, common options."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from rlens.settings import settings

PIPED_WIDTH = 160  # rich's 80 columns for a pipe or a log file cut the wider tables' headers (rlens load's 9 columns)
console = Console(soft_wrap=True, width=None if os.isatty(1) else PIPED_WIDTH)
errors = Console(stderr=True, soft_wrap=True)


DEFAULT_WORKDIR = Path("out/up")  # `rlens up`'s work folder, where `rlens load` looks for the stack by default


def fail(message: str) -> NoReturn:
    errors.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(2)


def interrupted(what: str) -> NoReturn:
    """Ctrl-C: one line and the shell's exit code for SIGINT (130), no traceback."""
    errors.print(f"interrupted: {escape(what)}", highlight=False)
    raise typer.Exit(130)


def needs_extra(extra: str, *modules: str) -> None:
    """One line naming the extra to install when a command's optional dependency is missing."""
    import importlib

    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        fail(f"this needs the `{extra}` extra ({', '.join(missing)} missing): pip install 'rlens[{extra}]'")


def service_settings(pool: Path | None):
    """The settings, with ``--pool`` (if given) as the pool file."""
    return settings().updated({"pool_file": pool}) if pool else settings()


POOL = typer.Option(None, "--pool", help="pool file (default: $RLENS_POOL_FILE)")


def use_config(path: Path | None) -> Path | None:
    """``--config FILE``: the configuration file every setting is read from (``RLENS_CONFIG``, inherited by the
    processes a command starts), checked first (a wrong key is one line naming the valid ones)."""
    if path is None:
        return None
    from pydantic import ValidationError

    from rlens.config_file import CONFIG_ENV, ConfigError, located
    from rlens.settings import Settings

    os.environ[CONFIG_ENV] = str(path.resolve())
    try:
        Settings()
    except ConfigError as exc:
        fail(str(exc))
    except ValidationError as exc:
        problems = [f"{located(e['loc'])}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()]
        fail(f"{path} (or an RLENS_* variable over it): " + "; ".join(problems))
    return path


CONFIG = typer.Option(
    None,
    "--config",
    help="configuration file (rlens.toml: every setting in groups, and the pool; RLENS_* variables override it)",
    callback=use_config,
)
