"""Does the live service learn as well as the offline loop? The local stack against `rlens replay --protocol stream`.

    python -m bench.accuracy.live_accuracy [--data DIR] [--seeds 0 1 2] [--workers 1] [--rate 50]
                                           [--promotions direct gated holdback] [--kafka BOOTSTRAP]

For each seed: the local stack (tansu, or the Apache Kafka broker ``--kafka`` names; redis-server, learner, W
workers) serves the dataset's models as `replay` backends with engines seeded S; the dataset is played as traffic at
R queries/s, each feedback sent as soon as its answer arrives. The offline figure is the replay harness's RL-Focal
under the stream protocol, seed S. ``--promotions direct gated`` plays each seed once per promotion mode (gated and
holdback: the gate at 200 / 600 events, scaled to a 3,000-query stream as in ``bench.robustness.gate``), which is the gate
measured through the whole service; ``--explore-rate``, ``--probe-rate``, ``--first-probes``, ``--update-period``
and ``--calibration-rows`` set the learning of both the live and the offline run.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from bench.common.machine import machine_facts
from bench.common.args import add_out, add_seeds, arguments, write_json
from rlens.records.dataset import load_dataset
from rlens.focal.config import FocalConfig
from rlens.evaluation.protocols import Protocol
from rlens.evaluation.replay import replay
from rlens.local.load import play, queries_of
from rlens.local.stack import LocalStack, write_replay_pool
from rlens.settings import settings


GATE = {"gate_min_events": 200, "gate_max_events": 600}  # scaled to a 3,000-query stream (bench.robustness.gate)


def live_run(
    data: Path,
    seed: int,
    workers: int,
    rate: float,
    workdir: Path,
    promotion: str = "direct",
    kafka: str | None = None,
    learning: dict | None = None,
) -> dict:
    pool = write_replay_pool(data, workdir / "pool.json")
    config = settings().updated(
        {
            "pool_file": pool.resolve(),
            "seed": seed,
            "kafka_session_timeout_ms": 2000,
            "kafka_heartbeat_ms": 500,
            "promotion": promotion,
            **(GATE if promotion != "direct" else {}),
            # topics and groups of its own: a broker named by --kafka outlives each run
            "topic_prefix": f"live-{seed}-{promotion}-{time.time_ns()}.",
            **(learning or {}),
        }
    )
    stack = LocalStack(config, workdir, kafka_bootstrap=kafka)
    try:
        stack.start_learner()
        for _ in range(workers):
            stack.start_worker()
        stack.wait_ready(120)
        report = asyncio.run(
            play(stack.settings, queries_of(load_dataset(data), None, f"live-{seed}"), rate=rate, idle_timeout_s=60)
        )
        time.sleep(2.0)
    finally:
        stack.stop()
    return {
        "accuracy": report.accuracy,
        "answered": report.answered,
        "duplicates": report.duplicates,
        "p50_ms": report.latency_percentile(50),
        "p99_ms": report.latency_percentile(99),
        "policy_version": max(report.policy_versions),
        "policy_versions_served": len(report.policy_versions),
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--data", type=Path, default=settings().service.shared_data / "bbh_dev")
    add_seeds(parser)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--promotions", nargs="+", choices=["direct", "gated", "holdback"], default=["direct"])
    parser.add_argument("--kafka", default=None, help="bootstrap of an Apache Kafka broker to run on (default: tansu)")
    parser.add_argument("--explore-rate", type=float, default=None, help="RLENS_FOCAL_EXPLORE_RATE (default: its own)")
    parser.add_argument("--probe-rate", type=float, default=None, help="RLENS_FOCAL_PROBE_RATE (default: its own)")
    parser.add_argument("--update-period", type=int, default=None, help="RLENS_FOCAL_UPDATE_PERIOD (default: its own)")
    parser.add_argument("--first-probes", type=int, default=None, help="RLENS_FOCAL_FIRST_PROBES (default: its own)")
    parser.add_argument(
        "--calibration-rows", type=int, default=None, help="RLENS_FOCAL_CALIBRATION_ROWS (default: its own)"
    )
    add_out(parser, "bench/out/live_accuracy.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    dataset = load_dataset(args.data)
    learning = {
        name: value
        for name, value in (
            ("focal_explore_rate", args.explore_rate),
            ("focal_probe_rate", args.probe_rate),
            ("focal_update_period", args.update_period),
            ("focal_first_probes", args.first_probes),
            ("focal_calibration_rows", args.calibration_rows),
        )
        if value is not None
    }
    offline_config = FocalConfig(**{name.removeprefix("focal_"): value for name, value in learning.items()})
    rows = []
    for seed in args.seeds:
        offline = (
            replay(dataset, Protocol.stream, seed, offline_config, ["rl_focal"], workers=1)
            .results.methods["rl_focal"]
            .accuracy
        )
        for promotion in args.promotions:
            with tempfile.TemporaryDirectory() as workdir:  # no checkpoint of an earlier run to resume from
                live = live_run(
                    args.data, seed, args.workers, args.rate, Path(workdir), promotion, args.kafka, learning
                )
            rows.append({"seed": seed, "workers": args.workers, "promotion": promotion, "offline": offline, **live})
            print(
                f"seed {seed} {promotion}: live {100 * live['accuracy']:.1f} % vs offline {100 * offline:.1f} % "
                f"({100 * (live['accuracy'] - offline):+.1f}); {live['answered']} answered, {live['duplicates']} "
                f"duplicates, p50 {live['p50_ms']:.0f} ms, p99 {live['p99_ms']:.0f} ms, policy v{live['policy_version']} "
                f"({live['policy_versions_served']} versions served)",
                flush=True,
            )
    write_json(
        args.out,
        rows,
    )


if __name__ == "__main__":
    main()
