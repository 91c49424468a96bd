"""Drift detection and reaction on streams with real task switches, one stream key for the whole stream (the task
is not known to the service: that key is what drifts).

    python -m bench.accuracy.drift [--seeds 0 1 2] [--out bench/out/drift.json]

RL-Focal runs online (Algorithm 2, cold start, feedback at once) over the bundled zoo_mc stream (10 blocks of 120;
the validation stream, on which the reaction was chosen) and bbh_dev in task order (12 blocks of 250; held out),
with the learner's detector (ADWIN on the outcome) and each reaction:

- ``none``: detections are only reported;
- ``trim``: on a detection the stream's window keeps only its last ``--keep`` outcomes (the old task's rows go);
- ``reset``: on a detection the stream's window is emptied.

Reported per dataset and reaction, over the seeds: whole-stream accuracy; per switch the detection delay (queries
from the switch to the first detection inside the block's first half; missed otherwise) and the same for the label-free signal (the
Fusion agent's confidence in each answer, before any feedback); false alarms (detections outside those first
halves) per 1,000 queries; and the recovery time per block: queries from the switch until the
rolling accuracy over the last 20 answers of the block is within 2 points of the accuracy of the block's second half.
``recovered_before_detection`` counts the switches whose recovery was over before their first detection (or that
none followed): a reaction to that detection comes too late for them.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import numpy as np

from bench.common.machine import machine_facts
from bench.common.args import add_out, add_seeds, arguments, write_json
from rlens.records.dataset import load_dataset
from rlens.drift import DriftConfig, DriftMonitor, drift_figures, recovery_time, task_blocks
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.focal.schedule import run_online
from rlens.settings import settings


def recovered_before_detection(correct: np.ndarray, detections: list[int], task: np.ndarray) -> int:
    """Switches whose recovery was over before their first detection in the block's first half, or that no detection
    followed: a reaction to the switch's own detection comes too late for those."""
    late = 0
    for start, end in task_blocks(task)[1:]:
        early = [d - start for d in detections if start <= d < (start + end) // 2]
        late += not early or early[0] >= recovery_time(correct, start, end)
    return late


def judge(correct: np.ndarray, detections: list[int], label_free: list[int], task: np.ndarray) -> dict:
    figures, early = drift_figures(correct, detections, task), drift_figures(correct, label_free, task)
    return {
        "accuracy": float(correct.mean()),
        "detections": len(detections),
        "delays": figures.delays,
        "missed_switches": figures.missed_switches,
        "false_alarms_per_1000": figures.false_alarms_per_1000,
        "recovery": figures.recovery,
        "recovered_before_detection": recovered_before_detection(correct, detections, task),
        "recovered_before_label_free_detection": recovered_before_detection(correct, label_free, task),
        "label_free_delays": early.delays,
        "label_free_missed": early.missed_switches,
        "label_free_false_alarms_per_1000": early.false_alarms_per_1000,
    }


def main() -> None:
    parser = arguments(__doc__)
    add_seeds(parser)
    parser.add_argument("--keep", type=int, default=10, help="trim: outcomes the window keeps after a detection")
    parser.add_argument("--reactions", nargs="+", default=["none", "trim", "reset"])
    parser.add_argument("--delta", type=float, default=0.002, help="ADWIN's delta")
    parser.add_argument("--min-gap", type=int, default=50)
    parser.add_argument(
        "--signals",
        choices=["outcome", "all"],
        default="all",
        help="which detections count as a detection (the reaction follows all)",
    )
    parser.add_argument("--datasets", nargs="+", default=["zoo_mc", "bbh_dev"])
    add_out(parser, "bench/out/drift.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    datasets = {
        "zoo_mc (validation)": settings().service.demo_data,
        "bbh_dev (held out)": settings().service.shared_data / "bbh_dev",
    }
    datasets = {name: path for name, path in datasets.items() if name.split()[0] in args.datasets}
    result: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "seeds": args.seeds,
        "keep": args.keep,
        "delta": args.delta,
        "min_gap": args.min_gap,
        "signals": args.signals,
        "runs": {},
    }
    for name, path in datasets.items():
        data = load_dataset(path)
        spans = task_blocks(data.task)
        for reaction in args.reactions:
            runs = []
            for seed in args.seeds:
                started = time.perf_counter()
                engine = FocalEngine(data.n_models, data.model_costs, FocalConfig(), seed=seed)
                monitor = DriftMonitor(DriftConfig(delta=args.delta, min_gap=args.min_gap))
                trace = run_online(engine, data, stream="one", drift=monitor, reaction=reaction, keep=args.keep)
                detections = [i for i, signals in trace.detections if args.signals == "all" or "outcome" in signals]
                runs.append(
                    {
                        "seed": seed,
                        **judge(trace.correct, detections, trace.label_free, data.task),
                        "seconds": round(time.perf_counter() - started, 1),
                    }
                )
            recoveries = [r for run in runs for r in run["recovery"]]
            delays = [d for run in runs for d in run["delays"]]
            summary = {
                "accuracy_mean": round(statistics.mean(r["accuracy"] for r in runs), 4),
                "recovery_median": statistics.median(recoveries),
                "recovery_mean": round(statistics.mean(recoveries), 1),
                "recovered_before_detection": sum(r["recovered_before_detection"] for r in runs),
                "recovered_before_label_free_detection": sum(r["recovered_before_label_free_detection"] for r in runs),
                "delay_median": statistics.median(delays) if delays else None,
                "missed_switches": sum(r["missed_switches"] for r in runs),
                "switches": len(runs) * (len(spans) - 1),
                "false_alarms_per_1000": round(statistics.mean(r["false_alarms_per_1000"] for r in runs), 2),
                "label_free_delay_median": statistics.median(d)
                if (d := [x for r in runs for x in r["label_free_delays"]])
                else None,
                "label_free_missed": sum(r["label_free_missed"] for r in runs),
                "label_free_false_alarms_per_1000": round(
                    statistics.mean(r["label_free_false_alarms_per_1000"] for r in runs), 2
                ),
            }
            result["runs"][f"{name} / {reaction}"] = {"summary": summary, "per_seed": runs}
            print(f"{name:22s} {reaction:6s} {summary}", flush=True)
    write_json(
        args.out,
        result,
    )


if __name__ == "__main__":
    main()
