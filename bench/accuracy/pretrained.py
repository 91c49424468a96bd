"""A policy trained on some tasks, serving new ones from cold windows (issue 36, item 3).

    python -m bench.accuracy.pretrained [--data DIR] [--seeds 0 1 2] [--variant rl_focal] [--out bench/out/pretrained.json]

bbh_dev's tasks in two halves (:func:`rlens.evaluation.protocols.task_half`): RL-Focal is warm-started on every
question of the tuning half (Algorithm 1), its windows emptied, and then serves the holdout half's tasks as one
stream (the stream protocol: each query answered before its label is seen, learning online as it goes). Against
it on the same stream: RL-Focal from a cold start, and the online baselines (the soft vote, Hedge over the models,
an online per-task stacker: :func:`rlens.evaluation.baselines.online_stacking`), with the best single model per
task in hindsight as a reference. Accuracy in % of the holdout stream, models called per query. ``--variant``: another
RL-Focal variant of ``rlens replay`` (e.g. ``rl_focal_uncalibrated``) for both RL-Focal runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")  # portable numerics (as `rlens replay`): before torch loads
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common.args import add_out, add_seeds, arguments, write_json  # noqa: E402
from bench.common.machine import machine_facts  # noqa: E402
from rlens.evaluation import baselines  # noqa: E402
from rlens.records.dataset import load_dataset  # noqa: E402
from rlens.evaluation.protocols import task_half  # noqa: E402
from rlens.settings import settings  # noqa: E402
from rlens.evaluation.replay import RL_VARIANTS  # noqa: E402
from rlens.focal.config import FocalConfig  # noqa: E402
from rlens.focal.engine import FocalEngine  # noqa: E402
from rlens.focal.schedule import run_online, warm_start  # noqa: E402


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--data", type=Path, default=None, help="recorded dataset (default: the shared bbh_dev)")
    parser.add_argument("--variant", default="rl_focal", choices=list(RL_VARIANTS), help="the RL-Focal variant")
    add_seeds(parser)
    add_out(parser, "bench/out/pretrained.json")
    args = parser.parse_args()
    config = replace(FocalConfig(), **RL_VARIANTS[args.variant][0])
    torch.set_num_threads(1)
    data = load_dataset(args.data or settings().service.shared_data / "bbh_dev")
    tune, holdout = task_half(data, "tune"), task_half(data, "holdout")
    print(machine_facts(), f"tune {tune.n_questions} questions, holdout {holdout.n_questions}", flush=True)
    references = {
        "soft_vote": baselines.soft_voting(holdout),
        "hedge": baselines.hedge(holdout),
        "online_stacking": baselines.online_stacking(holdout),
        "best_single_per_task (hindsight)": baselines.best_single_per_task(holdout, holdout),
    }
    results: dict = {
        name: {"accuracy": float((run.answers == holdout.labels).mean()), "calls": run.models_called}
        for name, run in references.items()
    }
    for name, r in results.items():
        print(f"{name:34s} {100 * r['accuracy']:.1f} %, {r['calls']:.2f} calls", flush=True)
    runs = []
    for seed in args.seeds:
        pre = FocalEngine(data.n_models, data.model_costs, config, seed=seed)
        warm_start(pre, tune)
        pre.reset_windows()  # new tasks: cold windows
        cold = FocalEngine(data.n_models, data.model_costs, config, seed=seed)
        row = {"seed": seed}
        for name, engine in (("pretrained", pre), ("cold_start", cold)):
            trace = run_online(engine, holdout)
            row[name] = {"accuracy": float(trace.correct.mean()), "calls": float(trace.models_called.mean())}
        runs.append(row)
        print(
            f"seed {seed}: pre-trained {100 * row['pretrained']['accuracy']:.1f} % "
            f"({row['pretrained']['calls']:.2f} calls), cold start {100 * row['cold_start']['accuracy']:.1f} % "
            f"({row['cold_start']['calls']:.2f} calls)",
            flush=True,
        )
    for name in ("pretrained", "cold_start"):
        values = [100 * r[name]["accuracy"] for r in runs]
        print(f"{name}: {np.mean(values):.1f} ± {np.std(values):.1f} %", flush=True)
    write_json(args.out, {"machine": machine_facts(), "variant": args.variant, "baselines": results, "runs": runs})


if __name__ == "__main__":
    main()
