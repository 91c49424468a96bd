"""The capacity model (issue 58, item 4): docs/capacity.md's worked example computed by hand, and `rlens capacity`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlens.capacity import Load, UnitCosts, plan

EXAMPLE = dict(  # docs/capacity.md: 1,000 queries/s, a million streams
    queries_per_s=1000,
    streams=1_000_000,
    models=5,
    called=2.5,
    latency_s=0.3,
    feedback=1.0,
    choices=4,
    feedback_days=7,
    retention_days=7,
    window=128,
    calibration_rows=200,
    joint_rows=4000,
    model_concurrency=8,
    dedup_ttl_s=86_400,
    replication=3,
)


def test_the_worked_example_by_hand():
    need = plan(Load(**EXAMPLE))
    assert need.workers == 38 + 1  # ceil(1,000 * 0.3 / 8) and one to lose
    assert need.partitions == 48  # 1.2 * 39 = 46.8, up to a multiple of 8
    assert need.learner_shards == 4  # ceil(1,000 / 330)
    assert need.trainer_keeps_up  # 1,000 <= 1,160
    assert need.gateways == 2 + 1  # ceil(1,000 / 600) and one to lose
    assert need.kafka_produced_bytes_per_s == 1000 * (212 + 2 * 986 + 2566 + 181)  # 4.93 MB/s
    assert need.kafka_written_bytes_per_s == 3 * 4_931_000
    assert need.kafka_retained_bytes == pytest.approx(3 * 4_931_000 * 7 * 86_400)  # 8.9 TB
    per = need.redis_per_stream
    assert (per.window, per.calibration_rows, per.fits) == (128 * 27, 5 * 200 * 48, 12 * 5 * 4 * 5)
    assert per.joint_rows == pytest.approx(604.8 * (20 + 2.5 * 46))  # 86.4 labelled a day for 7 days
    assert need.redis_streams_bytes == pytest.approx(1e6 * (3456 + 48_000 + 1200 + 81_648))
    assert need.redis_markers_bytes == 1000 * 86_400 * 160
    assert need.redis_operations_per_s == 4 * 1000 + 1000


def test_what_bounds_each_part_changes_with_the_load():
    slow = plan(Load(**{**EXAMPLE, "queries_per_s": 20_000, "latency_s": 0.0, "feedback": 0.0}))
    assert slow.workers == 5 + 1  # models that answer at once: the worker's CPU bounds it (20,000 / 4,600)
    assert slow.learner_shards == 1 and slow.trainer_keeps_up  # no feedback, nothing to join
    assert plan(Load(**{**EXAMPLE, "queries_per_s": 10_000})).learner_shards == 31
    assert not plan(Load(**{**EXAMPLE, "queries_per_s": 2000})).trainer_keeps_up
    shards_bound = plan(Load(**EXAMPLE), UnitCosts(shard_joins_per_s=10))
    assert shards_bound.partitions == shards_bound.learner_shards == 100  # shards need partitions too
    long_ago = plan(Load(**{**EXAMPLE, "feedback_days": 365}))
    assert long_ago.redis_per_stream.joint_rows == 4000 * (20 + 2.5 * 46)  # held to J
    for bad in ({"feedback": 1.5}, {"called": 6}):
        with pytest.raises(ValueError):
            Load(**{**EXAMPLE, **bad})


def rlens(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RLENS_")}
    return subprocess.run(
        [sys.executable, "-m", "rlens.cli", *args], capture_output=True, text=True, env={**clean, **env}, timeout=120
    )


def test_the_command_reads_the_configuration_and_refuses_bad_input():
    done = rlens("capacity", "--qps", "1000", "--streams", "1000000", "--replication", "3", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["needs"] == plan(Load(**EXAMPLE)).model_dump()
    smaller = rlens("capacity", "--qps", "1000", "--streams", "1000000", "--json", RLENS_FOCAL_WINDOW="64")
    assert json.loads(smaller.stdout)["needs"]["redis_per_stream"]["window"] == 64 * 27
    table = rlens("capacity", "--qps", "1000", "--streams", "1000000")
    assert table.returncode == 0 and "48 (the peak worker count" in table.stdout
    for bad, said in ((["--qps", "0"], "queries_per_s"), (["--qps", "10", "--called", "6"], "more than the pool")):
        refused = rlens("capacity", "--streams", "10", *bad)
        assert refused.returncode == 2 and said in refused.stderr and "Traceback" not in refused.stderr
