"""RLAE-PPO and RLAE-MAPPO against every baseline on the zoo's generation stream (exact match).

    python -m bench.rlae.zoo [--zoo DIR] [--models arith-char count-bpe ...] [--seeds 0 1 2] [--span 4] [--episodes 6144]
                               [--variants ppo mappo | --variants] [--shots 2] [--grid-tasks 256] [--out out/bench_rlae]

Training split: 1000 open-ended tasks of uniformly drawn families (seed 100). Test stream: 8 blocks of 50 tasks,
the family switching at every block (seed 7). Families: arithmetic, counting, ordering, pattern (no zoo model
answers the antonyms family). Methods, all decoded greedily with the same stop ("\\n") and token budget:
each single model; the uniform token ensemble (GaC); the best static weights of a simplex grid (step 0.25) searched
on 256 training tasks; the ranker ensemble (every model answers in full, a MiniLM scorer trained on the training
split's answers picks one, ``rlens.rlae.ranker``); RL-Focal (warm start on the training split's greedy answers,
then online on the stream); RLAE-PPO and RLAE-MAPPO trained offline on the training split, then frozen (greedy
weights) on the stream. ``--variants`` with no value runs the baselines only.
Writes results.json, a table (stdout) and accuracy.png (per method, seeds as points; rolling accuracy on the stream).

A pool may mix the specialists with the zoo's general LLMs (pool (c) of issue 16: ``--models smollm2-135m
gemma3-270m arith-char ...``). The specialists read the prompt as they were trained; a general LLM (a zoo model
trained on no family) first reads ``--shots`` solved examples of each family (drawn with seed 99, apart from every
split), the same for every task, since the task's family is not given to the ensemble.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from bench.common.machine import machine_facts
from bench.common.args import add_out, add_seeds, arguments, write_json
from rlens.progress import quiet_transformers
from rlens.rlae.agent import RLAEConfig
from rlens.rlae.decode import TokenEnsemble
from rlens.evaluation.rlae import correct, decode, grid_search, rl_focal_correct
from rlens.rlae.observe import SentenceEncoder
from rlens.rlae.ranker import AnswerRanker
from rlens.rlae.train import RLAETrainer
from rlens.settings import settings
from rlens.zoo.build import load_backend, load_zoo
from rlens.zoo.tasks import generation_split, generation_stream, training_example

FAMILIES = ["arithmetic", "counting", "ordering", "pattern"]
SPECIALISTS = ["arith-char", "count-bpe", "order-char", "pattern-bpe"]


def plot(results: dict, test_families: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 1.4]})
    names = list(results["accuracy"])
    for x, name in enumerate(names):
        values = results["accuracy"][name]
        left.bar(x, np.mean(values), color="tab:blue" if name.startswith("rlae") else "tab:gray", alpha=0.7)
        left.scatter([x] * len(values), values, color="black", s=10, zorder=3)
    left.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    left.set_ylabel("exact match on the test stream")
    left.set_ylim(0, 1)
    width = 10
    for name in ["rlae_ppo", "rlae_mappo", "rl_focal", "ranker ensemble", "uniform (GaC)", results["best_single"]]:
        if name not in results["per_task"]:
            continue
        per_task = np.mean(results["per_task"][name], 0)
        right.plot(
            np.arange(width - 1, len(per_task)), np.convolve(per_task, np.ones(width) / width, mode="valid"), label=name
        )
    for b in range(0, len(test_families), 50):
        right.axvline(b, color="lightgray", lw=0.8)
        right.text(b + 2, 0.02, test_families[b][:5], fontsize=7, color="gray")
    right.set_xlabel(f"test stream (rolling mean over {width} tasks; task switch every 50)")
    right.set_ylim(0, 1.05)
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--zoo", type=Path, default=None)
    parser.add_argument(
        "--models", nargs="+", default=SPECIALISTS, help="the pool: zoo models (default: the 4 specialists)"
    )
    add_seeds(parser)
    parser.add_argument("--span", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=6144)
    parser.add_argument(
        "--variants", nargs="*", default=["ppo", "mappo"], choices=["ppo", "mappo"], help="none: the baselines only"
    )
    parser.add_argument("--shots", type=int, default=2, help="solved examples per family a general LLM reads first")
    parser.add_argument(
        "--grid-tasks", type=int, default=256, help="training tasks the static-weight grid is searched on (0: no grid)"
    )
    add_out(parser, "out/bench_rlae")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    torch.set_num_threads(2)
    quiet_transformers()
    models = {m.name: m for m in load_zoo(args.zoo or settings().service.zoo_dir)}
    zoo = [models[name] for name in args.models]
    names = [m.name for m in zoo]
    backends = [load_backend(m) for m in zoo]
    rng = np.random.default_rng(99)
    shots = "".join(
        p + " " + c.strip() + "\n" for p, c in (training_example(f, rng) for f in FAMILIES for _ in range(args.shots))
    )
    contexts = ["" if m.trained_on else shots for m in zoo]  # general LLMs read the solved examples first
    ensemble, encoder = TokenEnsemble(backends, contexts=contexts), SentenceEncoder()
    cfg = RLAEConfig(span=args.span, episodes=args.episodes)
    train, test = generation_split(FAMILIES, 1000, seed=100), generation_stream(FAMILIES, 8, 50, seed=7)
    args.out.mkdir(parents=True, exist_ok=True)
    per_task: dict[str, list[list[bool]]] = {}
    seconds: dict[str, float] = {}
    focal_calls: list[float] = []

    def record(name: str, hits: np.ndarray, started: float) -> None:
        per_task.setdefault(name, []).append(hits.tolist())
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - started

    with Progress() as bar:
        task = bar.add_task("single models", total=len(zoo) * (len(train) + len(test)))
        train_outputs, test_outputs = [], []
        for m, backend in enumerate(backends):
            started = time.perf_counter()
            alone = TokenEnsemble([backend], contexts=[contexts[m]])
            train_outputs.append(decode(alone, train, np.ones(1), cfg, progress=lambda n: bar.advance(task, n)))
            test_outputs.append(decode(alone, test, np.ones(1), cfg, progress=lambda n: bar.advance(task, n)))
            record(names[m], correct(test_outputs[-1], test), started)
        started = time.perf_counter()
        chosen = AnswerRanker(encoder, len(zoo)).fit(train, train_outputs).choose(test, test_outputs)
        record("ranker ensemble", correct([test_outputs[m][n] for n, m in enumerate(chosen)], test), started)
        task = bar.add_task("uniform + grid search", total=len(test) * (1 + bool(args.grid_tasks)))
        started = time.perf_counter()
        record(
            "uniform (GaC)",
            correct(decode(ensemble, test, np.ones(len(zoo)), cfg, progress=lambda n: bar.advance(task, n)), test),
            started,
        )
        search = None
        if args.grid_tasks:
            started = time.perf_counter()
            search = grid_search(ensemble, train[: args.grid_tasks], cfg, 0.25)
            record(
                "best static (grid)",
                correct(decode(ensemble, test, search.best, cfg, progress=lambda n: bar.advance(task, n)), test),
                started,
            )
        for seed in args.seeds:
            started = time.perf_counter()
            hits, called = rl_focal_correct(train_outputs, train, test_outputs, test, names, FAMILIES, seed)
            record("rl_focal", hits, started)
            focal_calls.append(float(called.mean()))
        for variant in args.variants:
            for seed in args.seeds:
                task = bar.add_task(f"rlae {variant} seed {seed}", total=args.episodes + len(test))
                started = time.perf_counter()
                trainer = RLAETrainer(
                    ensemble,
                    encoder,
                    names,
                    replace(cfg, variant=variant),
                    args.out / f"runs/{variant}-{seed}",
                    seed=seed,
                )
                trainer.run(
                    train,
                    lambda n, reward: bar.update(
                        task, advance=n, description=f"rlae {variant} seed {seed} (reward {reward:.2f})"
                    ),
                )
                texts = decode(ensemble, test, trainer.agent, cfg, progress=lambda n: bar.advance(task, n))
                record(f"rlae_{variant}", correct(texts, test), started)

    accuracy = {name: [float(np.mean(run)) for run in runs] for name, runs in per_task.items()}
    best_single = max(names, key=lambda n: accuracy[n][0])
    results = {
        "models": names,
        "span": args.span,
        "episodes": args.episodes,
        "seeds": args.seeds,
        "shots": shots,
        "grid_best": None if search is None else search.best.tolist(),
        "grid_best_train_accuracy": None if search is None else float(search.accuracy.max()),
        "best_single": best_single,
        "accuracy": accuracy,
        "per_family": {
            name: {
                f: float(np.mean([np.mean([h for h, t in zip(run, test) if t.family == f]) for run in runs]))
                for f in FAMILIES
            }
            for name, runs in per_task.items()
        },
        "seconds": seconds,
        "rl_focal_mean_calls": float(np.mean(focal_calls)),
        "per_task": per_task,
    }
    write_json(
        args.out / "results.json",
        results,
    )
    plot(results, [t.family for t in test], args.out / "accuracy.png")
    print(f"| method | exact match (mean over {len(args.seeds)} seeds) | min–max | " + " | ".join(FAMILIES) + " |")
    print("|---|---|---|" + "---|" * len(FAMILIES))
    for name, values in accuracy.items():
        fam = " | ".join(f"{100 * results['per_family'][name][f]:.1f}" for f in FAMILIES)
        print(f"| {name} | {100 * np.mean(values):.1f} % | {100 * min(values):.1f}–{100 * max(values):.1f} | {fam} |")
    grid = "no grid" if search is None else f"grid best weights {dict(zip(names, search.best.round(2)))}"
    print(f"{grid}; RL-Focal mean calls {np.mean(focal_calls):.2f}")


if __name__ == "__main__":
    main()
