"""Replay runtime against dataset size: seconds for the paper protocol on seeded synthetic datasets.

    python -m bench.accuracy.replay_scale [--questions 1000 3000 10000] [--models 5 11 20] [--variants all|rl_focal] [--workers 2]

Each cell is one ``rlens.evaluation.replay.replay`` call (portable numerics, seed 0) on ``rlens.evaluation.synthetic.synthetic_dataset``
(one task, 4 choices); the machine (CPU, cores, load) is printed first. Writes bench/out/replay_scale.json.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time

from bench.common.machine import machine_facts
from bench.common.args import add_out, arguments
from rlens.evaluation.protocols import Protocol
from rlens.evaluation.replay import DEFAULT_VARIANTS, replay
from rlens.evaluation.synthetic import synthetic_dataset


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--questions", type=int, nargs="+", default=[1000, 3000, 10000])
    parser.add_argument("--models", type=int, nargs="+", default=[5, 11, 20])
    parser.add_argument(
        "--variants", default="all", help="all (the replay's default variants), or one RL-Focal variant"
    )
    parser.add_argument("--workers", type=int, default=2)
    add_out(parser, "bench/out/replay_scale.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    variants = list(DEFAULT_VARIANTS) if args.variants == "all" else [args.variants]
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; variants {variants}",
        flush=True,
    )
    rows = []
    for n in args.questions:
        for m in args.models:
            data = synthetic_dataset(n, m, seed=0)
            started = time.perf_counter()
            run = replay(data, Protocol.paper, seed=0, variants=variants, workers=args.workers)
            seconds = time.perf_counter() - started
            rows.append(
                {
                    "questions": n,
                    "models": m,
                    "seconds": round(seconds, 1),
                    "rl_focal_accuracy": round(run.results.methods[variants[0]].accuracy, 4),
                }
            )
            print(f"{n:>6} questions x {m:>2} models: {seconds:6.1f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "variants": variants,
                "workers": args.workers,
                "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
