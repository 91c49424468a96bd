"""Does the live service learn as well as the offline loop? The local stack against `rlens replay --protocol stream`.

    python -m bench.accuracy.live_accuracy [--data DIR] [--seeds 0 1 2] [--workers 1] [--rate 50]

For each seed: the local stack (tansu, redis-server, learner, W workers) serves the dataset's models as `replay`
backends with engines seeded S; the dataset is played as traffic at R queries/s, each feedback sent as soon as
its answer arrives. The offline figure is the replay harness's RL-Focal under the stream protocol, seed S.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from bench.common.machine import machine_facts
from bench.common.args import add_out, add_seeds, arguments, write_json
from rlens.evaluation.dataset import load_dataset
from rlens.evaluation.recorded import shared_data_dir
from rlens.focal.config import FocalConfig
from rlens.evaluation.protocols import Protocol
from rlens.evaluation.replay import replay
from rlens.local.load import play, queries_of
from rlens.local.stack import LocalStack, write_replay_pool
from rlens.settings import settings


def live_run(data: Path, seed: int, workers: int, rate: float, workdir: Path) -> dict:
    pool = write_replay_pool(data, workdir / "pool.json")
    config = settings().model_copy(
        update={"pool_file": pool.resolve(), "seed": seed, "kafka_session_timeout_ms": 2000, "kafka_heartbeat_ms": 500}
    )
    stack = LocalStack(config, workdir)
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
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--data", type=Path, default=shared_data_dir() / "bbh_dev")
    add_seeds(parser)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rate", type=float, default=50.0)
    add_out(parser, "bench/out/live_accuracy.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    dataset = load_dataset(args.data)
    rows = []
    for seed in args.seeds:
        offline = (
            replay(dataset, Protocol.stream, seed, FocalConfig(), ["rl_focal"], workers=1)
            .results.methods["rl_focal"]
            .accuracy
        )
        live = live_run(args.data, seed, args.workers, args.rate, Path(f"bench/out/live-stack-{seed}"))
        rows.append({"seed": seed, "workers": args.workers, "offline": offline, **live})
        print(
            f"seed {seed}: live {100 * live['accuracy']:.1f} % vs offline {100 * offline:.1f} % ({100 * (live['accuracy'] - offline):+.1f}); "
            f"{live['answered']} answered, {live['duplicates']} duplicates, p50 {live['p50_ms']:.0f} ms, p99 {live['p99_ms']:.0f} ms, policy v{live['policy_version']}",
            flush=True,
        )
    write_json(
        args.out,
        rows,
    )


if __name__ == "__main__":
    main()
