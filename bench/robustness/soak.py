"""Memory under a flood of stream keys: the stack (1 learner, 1 worker, replay backends) for ``--minutes`` under
traffic whose every query has its own stream key, cycling through ``--streams`` keys, with immediate feedback.

    python -m bench.robustness.soak [--minutes 10] [--streams 100000] [--rate 200] [--out bench/out/soak.json]

The resident memory (RSS, from /proc) of the worker and the learner is sampled every 10 s. Reported: RSS after the
first minute (warm) and at the end, their ratio, the peak, and what the service did (answered, joined, updates).
Target: flat within ±10 % from the first minute to the end.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from bench.common.machine import rss_mb, machine_facts
from bench.common.stacks import replay_stack
from bench.common.args import add_out, arguments, write_json
from rlens.records.dataset import load_dataset
from rlens.local.load import play, queries_of
from rlens.settings import settings


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=200.0)
    add_out(parser, "bench/out/soak.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    zoo = load_dataset(settings().service.demo_data)
    base = queries_of(zoo, None, "soak")
    n = int(args.minutes * 60 * args.rate)
    traffic = [
        (
            base[i % len(base)][0].model_copy(update={"query_id": f"soak-{i}", "stream": f"stream-{i % args.streams}"}),
            base[i % len(base)][1],
        )
        for i in range(n)
    ]
    stack = replay_stack(args.out.parent / "soak-stack")
    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        start = time.monotonic()
        while not stop.wait(10.0):
            samples.append(
                {
                    "t": round(time.monotonic() - start),
                    "worker_mb": rss_mb(stack.workers[0].pid),
                    "learner_mb": rss_mb(stack.learner.pid),
                }
            )
            print(samples[-1], flush=True)

    try:
        stack.start_learner()
        stack.start_worker()
        stack.wait_ready(120)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        report = asyncio.run(play(stack.settings, traffic, rate=args.rate, idle_timeout_s=120))
        stop.set()
        sampler.join()
        time.sleep(2.0)
    finally:
        stop.set()
        stack.stop()
    state = json.loads(
        (
            stack.settings.learner.checkpoint_dir
            / (stack.settings.learner.checkpoint_dir / "LATEST").read_text()
            / "state.json"
        ).read_text()
    )
    warm = next((s for s in samples if s["t"] >= 60), samples[0])  # a run shorter than a minute: its first sample
    result = {
        "minutes": args.minutes,
        "streams": args.streams,
        "rate": args.rate,
        "sent": report.sent,
        "answered": report.answered,
        "elapsed_s": round(report.elapsed_s, 1),
        "p50_ms": round(report.latency_percentile(50)),
        "p99_ms": round(report.latency_percentile(99)),
        "joined": state["stats"]["joined"],
        "updates": state["stats"]["updates"],
        **{
            f"{role}_mb": {
                "warm": round(warm[f"{role}_mb"]),
                "end": round(samples[-1][f"{role}_mb"]),
                "peak": round(max(s[f"{role}_mb"] for s in samples)),
                "end_over_warm": round(samples[-1][f"{role}_mb"] / warm[f"{role}_mb"], 3),
            }
            for role in ("worker", "learner")
        },
        "samples": samples,
    }
    write_json(args.out, result, show={k: v for k, v in result.items() if k != "samples"})


if __name__ == "__main__":
    main()
