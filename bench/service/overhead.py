"""Decision overhead per query: diversity metrics + Decider + critic + Fusion forward, on one CPU core.

    python -m bench.service.overhead [--data DIR] [--queries N]

Windows are filled with the warm-start split first (full windows, as in operation). Times ``decide`` and
``fuse`` for each test question of the paper protocol and prints median / p90 / p99 in milliseconds, and the median
in units of one small NumPy operation timed in the same run (``small_op_us``), which moves less between machines.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from bench.common.machine import machine_facts, small_op_us
from bench.common.args import arguments
from rlens.records.dataset import load_dataset
from rlens.settings import settings
from rlens.focal.engine import FocalEngine
from rlens.focal.schedule import questions
from rlens.evaluation.protocols import Protocol, split


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--data", default=str(settings().service.shared_data / "bbh_dev"))
    parser.add_argument("--repeats", type=int, default=3, help="passes over the test questions")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    torch.set_num_threads(1)
    data = load_dataset(args.data)
    warm_index, test_index = split(data, Protocol.paper)
    engine = FocalEngine(data.n_models, data.model_costs, seed=0)
    for q in questions(data.subset(warm_index)):
        engine.observe(q.key, q.predictions, q.label, 1.0)
    test = questions(data.subset(test_index))
    timings = []
    for _ in range(args.repeats):
        for q in test:
            start = time.perf_counter()
            (decision,) = engine.decide(q.key, q.probs.shape[1], greedy=True)
            engine.fuse(decision, q.probs)
            timings.append(time.perf_counter() - start)
    ms = 1000 * np.array(timings)
    result = {
        "queries": len(ms),
        "median_ms": round(float(np.median(ms)), 4),
        "p90_ms": round(float(np.percentile(ms, 90)), 4),
        "p99_ms": round(float(np.percentile(ms, 99)), 4),
        "torch_threads": torch.get_num_threads(),
        # the yardstick of this run (bench/common/machine.py): the median decision in small NumPy operations
        "small_op_us": round(small_op_us(), 3),
    }
    result["median_in_small_ops"] = round(1000 * result["median_ms"] / result["small_op_us"], 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
