"""Accuracy of RL-Focal and the baselines over several seeds, both protocols (figures for BENCHMARKS.md).

    python -m bench.accuracy.replay [--data DIR|NAME] [--seeds 0 1 2 3 4] [--protocols paper stream] [--out bench/out]
                                 [--tasks all|tune|holdout] [--variants rl_focal ...] [--set explore_rate=0.25 ...]

Runs the same code path as ``rlens replay`` (portable numerics) per seed, writes every run's results.json under
OUT/<protocol>/seed<k>/ and a summary (mean and sample std over seeds) to OUT/summary.json and OUT/summary.md.
``--tasks tune`` keeps the tasks settings may be chosen on, ``holdout`` the others (:func:`rlens.evaluation.protocols.task_half`);
``--set`` overrides FocalConfig fields; ``--data`` also takes a named synthetic set (:mod:`bench.common.datasets`:
``synthetic-switches-1`` to ``-3``, the stream protocol's first pools). The machine (CPU, cores, load) is printed
first and saved in the summary.
"""

from __future__ import annotations

import time
from dataclasses import fields, replace

import numpy as np

from bench.common.machine import machine_facts
from bench.common.args import add_out, add_seeds, arguments, write_json
from bench.common.datasets import SYNTHETIC, dataset
from rlens.settings import settings
from rlens.focal.config import FocalConfig
from rlens.evaluation.protocols import Protocol, task_half
from rlens.evaluation.replay import DEFAULT_VARIANTS, RL_VARIANTS, replay
from rlens.evaluation.report import write_outputs

SHOWN = (
    "rl_focal",
    "rl_focal_all_models",
    "rl_focal_no_diversity",
    "rl_focal_kappa",
    "rl_focal_paper_decider",
    "rl_focal_marginal",
    "rl_focal_uncalibrated",
    "best_single",
    "best_single_per_task",
    "plurality",
    "soft_vote",
    "hedge",
    "stacking",
    "oracle",
)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument(
        "--data",
        default=str(settings().service.shared_data / "bbh_dev"),
        help=f"a recorded dataset directory, or {' / '.join(SYNTHETIC)}",
    )
    add_seeds(parser, [0, 1, 2, 3, 4])
    parser.add_argument("--protocols", nargs="+", default=["paper", "stream"], choices=[p.value for p in Protocol])
    parser.add_argument("--workers", type=int, default=2)
    add_out(parser, "bench/out")
    parser.add_argument("--tasks", default="all", choices=["all", "tune", "holdout"])
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(RL_VARIANTS))
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="FocalConfig overrides")
    args = parser.parse_args()
    config = FocalConfig()
    types = {f.name: type(getattr(config, f.name)) for f in fields(FocalConfig)}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in types:
            parser.error(f"--set {item}: FocalConfig has no field {name!r}")
        config = replace(
            config, **{name: value.lower() in ("1", "true", "yes") if types[name] is bool else types[name](value)}
        )
    data = dataset(args.data)
    if args.tasks != "all":
        data = task_half(data, args.tasks)
    machine = machine_facts()
    print(f"{machine}; tasks {args.tasks} ({len(set(data.task.tolist()))}); overrides {args.set or 'none'}", flush=True)
    summary: dict = {"machine": machine, "tasks": args.tasks, "overrides": args.set}
    for protocol in map(Protocol, args.protocols):
        runs, seconds = [], []
        for seed in args.seeds:
            start = time.perf_counter()
            run = replay(data, protocol, seed=seed, config=config, variants=args.variants, workers=args.workers)
            seconds.append(time.perf_counter() - start)
            write_outputs(run, args.out / protocol.value / f"seed{seed}")
            runs.append(run.results)
            focal = run.results.methods[args.variants[0]]
            print(
                f"{protocol.value} seed {seed}: {args.variants[0]} {100 * focal.accuracy:.1f}% calls {focal.mean_models_called:.2f} ({seconds[-1]:.0f} s)",
                flush=True,
            )
        methods = {}
        for name in SHOWN:
            if name in runs[0].methods:
                acc = np.array([100 * r.methods[name].accuracy for r in runs])
                calls = np.array([r.methods[name].mean_models_called for r in runs])
                extra = (
                    {
                        "greedy_accuracy_mean": round(
                            100 * float(np.mean([r.methods[name].greedy_accuracy for r in runs])), 2
                        )
                    }
                    if name in args.variants
                    else {}
                )
                methods[name] = {
                    **extra,
                    "accuracy_mean": round(float(acc.mean()), 2),
                    "accuracy_std": round(float(acc.std(ddof=1)) if len(acc) > 1 else 0.0, 2),
                    "accuracy_per_seed": acc.round(2).tolist(),
                    "calls_mean": round(float(calls.mean()), 2),
                }
        summary[protocol.value] = {
            "seeds": args.seeds,
            "n_test": runs[0].n_test,
            "seconds_per_replay": round(float(np.mean(seconds)), 1),
            "methods": methods,
        }
    write_json(args.out / "summary.json", summary, indent=2)
    lines = []
    for protocol, block in summary.items():
        if protocol not in ("paper", "stream"):
            continue
        lines += [
            f"### {protocol} ({block['n_test']} test questions, seeds {block['seeds']}, {block['seconds_per_replay']} s per replay)",
            "",
            "| method | accuracy % mean ± std | per seed | models called |",
            "|---|---:|---|---:|",
        ]
        lines += [
            f"| {n} | {m['accuracy_mean']:.1f} ± {m['accuracy_std']:.1f} | {', '.join(f'{a:.1f}' for a in m['accuracy_per_seed'])} | {m['calls_mean']:.2f} |"
            for n, m in block["methods"].items()
        ]
        lines.append("")
    (args.out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
