"""``rlens capacity``: what a load needs (:mod:`rlens.capacity`), the deployment's settings read from the
configuration in effect."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.table import Table

from rlens.cli.common import CONFIG, console, fail, use_config


def _bytes(n: float) -> str:
    """``n`` bytes in B, KB, MB, GB, TB or PB (powers of 1,000)."""
    if n < 1000:
        return f"{n:,.0f} B"
    for unit in ("KB", "MB", "GB", "TB"):
        n /= 1000
        if n < 1000:
            return f"{n:,.1f} {unit}"
    return f"{n / 1000:,.1f} PB"


def capacity(
    queries_per_s: float = typer.Option(..., "--qps", help="queries a second at peak"),
    streams: int = typer.Option(..., help="stream keys active within the window TTL"),
    models: int = typer.Option(5, help="M: the pool's models"),
    called: float = typer.Option(2.5, help="K: models called per query on average (2-2.5 of 5 at the defaults)"),
    latency_s: float = typer.Option(0.3, "--latency-s", help="L: a model call's latency at your model servers"),
    feedback: float = typer.Option(1.0, help="F: the share of queries that get feedback"),
    choices: int = typer.Option(4, help="C: choices per question"),
    feedback_days: float = typer.Option(7.0, help="how long feedback has flowed (each stream's joint rows grow)"),
    retention_days: float = typer.Option(7.0, help="Kafka's retention"),
    replication: int | None = typer.Option(None, help="the topics' replication factor (default: the configuration's)"),
    config: Path | None = CONFIG,
    as_json: bool = typer.Option(False, "--json", help="JSON instead of a table"),
) -> None:
    """What a load needs: workers, partitions, learner shards, gateways, Redis memory and operations, Kafka bytes,
    from unit costs measured on one machine (docs/capacity.md). The window, calibration and joint rows, model
    concurrency, marker TTL and replication are the configuration's (file, RLENS_* variables, defaults)."""
    from rlens.capacity import Load, plan
    from rlens.settings import Settings

    use_config(config)
    s = Settings()
    try:
        load = Load(
            queries_per_s=queries_per_s,
            streams=streams,
            models=models,
            called=called,
            latency_s=latency_s,
            feedback=feedback,
            choices=choices,
            feedback_days=feedback_days,
            retention_days=retention_days,
            window=s.focal.window,
            calibration_rows=s.focal.calibration_rows,
            joint_rows=s.focal.joint_rows,
            model_concurrency=s.worker.model_concurrency,
            dedup_ttl_s=s.redis.dedup_ttl_s,
            replication=s.kafka.replication if replication is None else replication,
        )
    except ValidationError as exc:
        fail("; ".join(f"{'.'.join(map(str, e['loc'])) or 'the load'}: {e['msg']}" for e in exc.errors()))
    need = plan(load)
    if as_json:
        print(json.dumps({"load": load.model_dump(), "needs": need.model_dump()}, indent=1))
        return
    per = need.redis_per_stream
    table = Table(title=f"{queries_per_s:,.0f} queries/s, {streams:,} streams, {called:g} of {models} models called")
    table.add_column("part")
    table.add_column("needs")
    table.add_row(
        "workers", f"{need.workers} (one to lose counted; {load.model_concurrency} calls in flight per model)"
    )
    table.add_row("partitions", f"{need.partitions} (the peak worker count with room; at least the learner shards)")
    table.add_row(
        "learner",
        f"{need.learner_shards} shard(s), each on a core of its own, and one trainer"
        + ("" if need.trainer_keeps_up else " (past one trainer's rate: split the traffic into deployments)"),
    )
    table.add_row("gateways", f"{need.gateways} (one to lose counted)")
    table.add_row(
        "Kafka",
        f"{_bytes(need.kafka_produced_bytes_per_s)}/s produced, {_bytes(need.kafka_written_bytes_per_s)}/s written "
        f"with replication {load.replication}; {_bytes(need.kafka_retained_bytes)} over {retention_days:g} days",
    )
    table.add_row(
        "Redis",
        f"{_bytes(per.total)} a stream (window {_bytes(per.window)}, calibration rows {_bytes(per.calibration_rows)}, "
        f"fits {_bytes(per.fits)}, joint rows {_bytes(per.joint_rows)}): {_bytes(need.redis_streams_bytes)}; markers "
        f"{_bytes(need.redis_markers_bytes)}; {need.redis_operations_per_s:,.0f} operations/s",
    )
    console.print(table)
    console.print("A model from one machine's unit costs (docs/capacity.md), not a measured deployment.")
