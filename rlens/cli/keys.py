"""``rlens keys``: the gateway's API keys (add, list, revoke)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from rlens.cli.common import console, errors, fail
from rlens.settings import settings

app = typer.Typer(
    help="The gateway's API keys (stored hashed; each bound to a tenant, its streams and a rate).", no_args_is_help=True
)

KEYS_FILE = typer.Option(None, "--file", help="keys file (default: $RLENS_GATEWAY_KEYS_FILE, rlens-keys.json)")


def keys_file(path: Path | None) -> Path:
    path = path or settings().gateway.keys_file
    if path is None:
        fail("no keys file: pass --file or set RLENS_GATEWAY_KEYS_FILE")
    return path


@app.command("add")
def keys_add(
    tenant: str = typer.Option(..., help="who owns the key's queries (no other tenant can read or rate them)"),
    streams: str = typer.Option(
        "*", help="stream keys the key may use, comma-separated fnmatch patterns (support-*,billing)"
    ),
    rate: float = typer.Option(20.0, min=0.001, help="sustained requests per second"),
    burst: int = typer.Option(40, min=1, help="requests at once above the sustained rate"),
    budget: float | None = typer.Option(
        None,
        min=0.000001,
        help="cost units the key may spend in all (each answer: the pool costs of the models it called); "
        "past it, 429 (default: no limit)",
    ),
    budget_period: str = typer.Option(
        "total", help="when the budget starts again: total (never), daily or monthly (UTC)"
    ),
    file: Path | None = KEYS_FILE,
) -> None:
    """Make an API key: prints it once (only its hash is stored)."""
    from rlens.service.gateway.api_keys import KeysError, add_key

    path = keys_file(file)
    try:
        patterns = [p.strip() for p in streams.split(",") if p.strip()]
        key, record = add_key(path, tenant, patterns, rate, burst, budget, budget_period)
    except (KeysError, ValueError) as exc:
        fail(str(exc))
    errors.print(
        f"key {record.id} for tenant {tenant!r} (streams {', '.join(record.streams)}; {rate:g}/s, bursts of {burst}"
        f"{f'; a budget of {budget:g} cost units' if budget else ''}"
        f"{f' {budget_period}' if budget and budget_period != 'total' else ''}) added to {path}; it is shown once:"
    )
    print(key)


@app.command("list")
def keys_list(file: Path | None = KEYS_FILE) -> None:
    """The keys in the file (ids, tenants, streams, rates; never the keys)."""
    import datetime

    from rlens.service.gateway.api_keys import KeysError, read_records

    path = keys_file(file)
    try:
        records = read_records(path)
    except KeysError as exc:
        fail(str(exc))
    table = Table(title=str(path))
    for column in ("id", "tenant", "streams", "rate/s", "burst", "budget", "created", "state"):
        table.add_column(column)
    for r in records:
        created = datetime.datetime.fromtimestamp(r.created_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
        table.add_row(
            r.id,
            r.tenant,
            ",".join(r.streams),
            f"{r.rate_per_s:g}",
            str(r.burst),
            "" if r.budget is None else f"{r.budget:g}" + ("" if r.budget_period == "total" else f" {r.budget_period}"),
            created,
            "revoked" if r.revoked else "active",
        )
    console.print(table)


@app.command("revoke")
def keys_revoke(
    key_id: str = typer.Argument(..., help="the key's id (`rlens keys list`)"), file: Path | None = KEYS_FILE
) -> None:
    """Revoke a key: running gateways refuse it within a second (they re-read the file when it changes)."""
    from rlens.service.gateway.api_keys import KeysError, revoke_key

    path = keys_file(file)
    try:
        record = revoke_key(path, key_id)
    except KeysError as exc:
        fail(str(exc))
    console.print(f"revoked key {record.id} of tenant {record.tenant!r} in {path}")
