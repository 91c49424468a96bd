"""Does the learner keep up with a worker at its maximum rate? The stack (1 learner, 1 worker, replay backends, the
bundled stream's tasks as stream keys) for ``--minutes`` with the worker saturated and every answer's feedback sent
at once.

    python -m bench.service.learner_lag [--minutes 5] [--in-flight 2000] [--out bench/out/learner_lag.json]

The load generator keeps ``--in-flight`` queries sent but not yet answered, so the worker always has a backlog and
answers at its maximum rate on this machine (with the learner, the broker and the load generator beside it). Every
10 s the bench reads the worker's and the learner's ``/metrics``:

* experience lag: answers the worker published (one experience record each) minus experience records the learner read;
* feedback lag: feedback records sent minus feedback records the learner read;
* the learner's unmatched halves held (``rlens_learner_pending``), joins and updates;
* each process's share of a core over the last 10 s (worker, learner, broker, Redis, the load generator).

Reported, over the samples after the first minute: the worker's rate, the learner's join rate, each lag's median,
maximum and least-squares slope (records/s; a learner that falls behind shows a positive slope of about the rate
it misses), and ``keeps_up`` when the slope of the total lag is under 1 % of the worker's rate.
"""

from __future__ import annotations

import asyncio

import numpy as np

from bench.common.machine import machine_facts
from bench.common.sampling import StackSampler
from bench.common.stacks import cycled, replay_stack
from bench.common.args import add_out, arguments, write_json
from rlens.records.dataset import load_dataset
from rlens.local.load import LoadReport, play, queries_of
from rlens.settings import settings


def slope(times: list[float], values: list[float]) -> float:
    """Least-squares slope of values over times (per second); 0 with fewer than two points."""
    return float(np.polyfit(times, values, 1)[0]) if len(times) >= 2 else 0.0


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--in-flight", type=int, default=2000, help="queries sent but not yet answered")
    parser.add_argument("--max-rate", type=float, default=4000.0, help="queries prepared per second of the run")
    add_out(parser, "bench/out/learner_lag.json")
    args = parser.parse_args()
    machine = machine_facts()
    print(f"machine: {machine}", flush=True)
    traffic = cycled(
        queries_of(load_dataset(settings().service.demo_data), None, "lag"),
        "lag",
        int(args.minutes * 60 * args.max_rate),
    )
    stack = replay_stack(args.out.parent / "learner-lag-stack")
    seen = LoadReport()

    def on_answer(report: LoadReport) -> None:
        nonlocal seen
        seen = report

    try:
        stack.start_learner()
        stack.start_worker()
        stack.wait_ready(120)
        with StackSampler(stack, lambda: seen.feedback_sent) as sampler:
            asyncio.run(
                play(
                    stack.settings,
                    traffic,
                    rate=1e9,
                    idle_timeout_s=60,
                    on_answer=on_answer,
                    max_in_flight=args.in_flight,
                    duration_s=60 * args.minutes,
                )
            )
    finally:
        stack.stop()
    samples = sampler.rows
    steady = [s for s in samples if s["t"] >= 60]
    steady = steady if len(steady) >= 2 else samples  # a run too short for two samples after its first minute
    times = [s["t"] for s in steady]
    span = steady[-1]["t"] - steady[0]["t"]
    worker_rate = (steady[-1]["answers"] - steady[0]["answers"]) / span
    lags = {
        kind: {
            "median": float(np.median([s[kind] for s in steady])),
            "max": max(s[kind] for s in steady),
            "slope_per_s": round(slope(times, [s[kind] for s in steady]), 2),
        }
        for kind in ("experience_lag", "feedback_lag", "pending")
    }
    total_slope = slope(times, [s["experience_lag"] + s["feedback_lag"] for s in steady])
    result = {
        "machine": machine,
        "minutes": args.minutes,
        "in_flight": args.in_flight,
        "worker_queries_per_s": round(worker_rate, 1),
        "learner_joins_per_s": round((steady[-1]["joined"] - steady[0]["joined"]) / span, 1),
        "updates": steady[-1]["updates"],
        "lags": lags,
        "total_lag_slope_per_s": round(total_slope, 2),
        "keeps_up": total_slope < 0.01 * worker_rate,
        "samples": samples,
    }
    write_json(args.out, result, show={k: v for k, v in result.items() if k != "samples"})


if __name__ == "__main__":
    main()
