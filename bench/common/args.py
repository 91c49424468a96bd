"""Every benchmark's command line and output: a parser whose help is the script's docstring (its usage line first),
the options most share, and the JSON file of results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def arguments(doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_seeds(p: argparse.ArgumentParser, default: list[int] | None = None) -> None:
    p.add_argument("--seeds", type=int, nargs="+", default=default or [0, 1, 2], help="one run per seed")


def add_out(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--out", type=Path, default=Path(default), help=f"where the results go (default {default})")


def write_json(path: Path, payload, indent: int | None = 1, show=None) -> Path:
    """Write ``payload`` as JSON to ``path`` (its folder made if missing), print ``show`` (True: the payload) as
    JSON, and say where it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent))
    if show is not None:
        print(json.dumps(payload if show is True else show, indent=1))
    print(f"wrote {path}")
    return path
