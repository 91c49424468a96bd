"""RLAE on two real LLMs with different tokenizers (SmolLM2-135M-Instruct + Gemma 3 270M) against the paper's
baselines, on few-shot tasks, with a test on task families the agent never saw, and latency per answer.

    python -m bench.rlae.llm [--zoo DIR] [--seeds 0 1 2] [--span 4] [--episodes 384] [--out out/bench_rlae_llm]
                                   [--validation-only | --latency-only]

Tasks (``rlens/zoo/fewshot.py``, three solved examples then the question, exact match, stop at the newline, at
most 20 tokens). Seen families: add_two_digit, continent, multiply, successor, number_word, past_tense, count_up.
Unseen families (never in training, nor in any choice made on the validation split): add, weekday,
first_letter, uppercase, month, larger. Splits: training 512 tasks of the seen families (seed 100), validation 96
(seed 101), test "seen" 7 blocks of 24 (seed 7), test "unseen" 6 blocks of 24 (seed 8).

Methods, all greedy: each model alone; the uniform token ensemble (GaC); the best static weights of the grid
(0, .25, .5, .75, 1) chosen on the validation split; the ranker ensemble (both models answer in full, a MiniLM
scorer trained on the training split picks one, ``rlens.rlae.ranker``); RL-Focal over the two answers (warm start
on the training split, online on each test stream); RLAE-PPO and RLAE-MAPPO trained on the training split, then
frozen (greedy weights). Latency: seconds per answer at batch 1 on 12 test prompts, same machine, same threads.
Writes results.json, accuracy.png and a table (stdout).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from bench.common.machine import machine_facts
from bench.common.args import add_out, add_seeds, arguments, write_json

from rlens.progress import quiet_transformers
from rlens.progress import progress_bar
from rlens.rlae.agent import RLAEConfig, make_policy
from rlens.rlae.decode import TokenEnsemble
from rlens.evaluation.rlae import correct, decode, rl_focal_correct
from rlens.rlae.observe import SentenceEncoder, obs_dim
from rlens.rlae.ranker import AnswerRanker
from rlens.rlae.train import RLAEAgent, RLAETrainer
from rlens.settings import settings
from rlens.zoo.build import load_backend, load_zoo
from rlens.zoo.fewshot import fewshot_split, fewshot_stream
from rlens.zoo.tasks import GenerationTask

SEEN = ["add_two_digit", "continent", "multiply", "successor", "number_word", "past_tense", "count_up"]
UNSEEN = ["add", "weekday", "first_letter", "uppercase", "month", "larger"]
POOL = ["smollm2-135m", "gemma3-270m"]
GRID = [np.array([w, 1 - w]) for w in (0.25, 0.5, 0.75)]  # the two corners are the single models


def plot(results: dict, path: Path) -> None:
    """Exact match per method on the seen and the unseen families (bars: mean over seeds; points: each seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, (split, per) in zip(axes, results["accuracy"].items()):
        names = list(per)
        for x, name in enumerate(names):
            ax.bar(x, np.mean(per[name]), color="tab:blue" if name.startswith("rlae") else "tab:gray", alpha=0.75)
            ax.scatter([x] * len(per[name]), per[name], color="black", s=10, zorder=3)
        ax.set_xticks(range(len(names)), names, rotation=50, ha="right", fontsize=8)
        ax.set_title(f"{split} families", fontsize=10)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("exact match")
    fig.suptitle(
        f"{' + '.join(results['models'])}, span {results['span']}, {results['episodes']} training episodes", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def latency_per_answer(
    prompts: list[GenerationTask],
    alone: list[TokenEnsemble],
    ensemble: TokenEnsemble,
    ranker: AnswerRanker,
    agents: dict[str, RLAEAgent],
    cfg: RLAEConfig,
) -> dict[str, float]:
    """Seconds per answer at batch 1: each model alone, the ranker ensemble (both answer, then the scorer), RLAE."""
    latency = {}
    for m, name in enumerate(POOL):
        started = time.perf_counter()
        decode(alone[m], prompts, np.ones(1), cfg, batch=1)
        latency[name] = (time.perf_counter() - started) / len(prompts)
    started = time.perf_counter()
    answers = [decode(alone[m], prompts, np.ones(1), cfg, batch=1) for m in range(len(POOL))]
    ranker.choose(prompts, answers)
    latency["ranker ensemble"] = (time.perf_counter() - started) / len(prompts)
    for variant, agent in agents.items():
        started = time.perf_counter()
        decode(ensemble, prompts, agent, cfg, batch=1)
        latency[f"rlae_{variant}"] = (time.perf_counter() - started) / len(prompts)
    return latency


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--zoo", type=Path, default=None)
    add_seeds(parser)
    parser.add_argument("--span", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=384)
    parser.add_argument("--variants", nargs="+", default=["ppo", "mappo"], choices=["ppo", "mappo"])
    add_out(parser, "out/bench_rlae_llm")
    parser.add_argument("--quick", action="store_true", help="a smoke run: an eighth of every split, 64 episodes")
    parser.add_argument(
        "--latency-only",
        action="store_true",
        help="only the latency table, with untrained agents and a ranker fitted on 32 training tasks (neither's "
        "cost depends on its weights; the answers' lengths may)",
    )
    parser.add_argument(
        "--validation-only",
        action="store_true",
        help="only train the RLAE agents and score them on the validation split (to choose settings such as the "
        "span there, never on the test streams); writes validation.json",
    )
    args = parser.parse_args()
    scale = 8 if args.quick else 1
    args.episodes = 64 if args.quick else args.episodes
    torch.set_num_threads(2)
    quiet_transformers()
    console = Console()
    console.print(f"machine: {machine_facts()}; {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    zoo = {m.name: m for m in load_zoo(args.zoo or settings().service.zoo_dir)}
    backends = [load_backend(zoo[name]) for name in POOL]
    ensemble, encoder = TokenEnsemble(backends), SentenceEncoder()
    alone = [TokenEnsemble([b]) for b in backends]
    cfg = RLAEConfig(span=args.span, max_tokens=20, episodes=args.episodes, episodes_per_update=64)
    train, validation = fewshot_split(SEEN, 512 // scale, seed=100), fewshot_split(SEEN, 96 // scale, seed=101)
    tests = {"seen": fewshot_stream(SEEN, 24 // scale, seed=7), "unseen": fewshot_stream(UNSEEN, 24 // scale, seed=8)}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.latency_only:
        fit = train[:32]
        ranker = AnswerRanker(encoder, len(POOL)).fit(fit, [decode(a, fit, np.ones(1), cfg, batch=32) for a in alone])
        agents = {
            v: RLAEAgent(
                make_policy(obs_dim(len(POOL)), len(POOL), replace(cfg, variant=v), seed=0), encoder, cfg, len(POOL)
            )
            for v in args.variants
        }
        latency = latency_per_answer(tests["seen"][::14][:12], alone, ensemble, ranker, agents, cfg)
        write_json(
            args.out / "latency.json",
            {"machine": machine_facts(), "latency_s": latency},
        )
        print("latency, s per answer at batch 1: " + ", ".join(f"{k} {v:.2f}" for k, v in latency.items()))
        return

    def trained(variant: str, seed: int, bar, task) -> RLAETrainer:
        """An RLAE agent trained on the training split (its run in OUT/runs/VARIANT-SEED), progress on ``task``."""
        trainer = RLAETrainer(
            ensemble, encoder, POOL, replace(cfg, variant=variant), args.out / f"runs/{variant}-{seed}", seed=seed
        )
        trainer.run(
            train,
            lambda n, reward: bar.update(
                task, advance=n, description=f"rlae {variant} seed {seed} (reward {reward:.2f})"
            ),
        )
        return trainer

    if args.validation_only:
        scores = {}
        for variant in args.variants:
            for seed in args.seeds:
                with progress_bar(console) as bar:
                    task = bar.add_task(f"rlae {variant} seed {seed}", total=args.episodes + len(validation))
                    trainer = trained(variant, seed, bar, task)
                    texts = decode(
                        ensemble, validation, trainer.agent, cfg, batch=32, progress=lambda n: bar.advance(task, n)
                    )
                scores[f"{variant}-{seed}"] = float(correct(texts, validation).mean())
                print(
                    f"rlae {variant} seed {seed}, span {args.span}: validation {100 * scores[f'{variant}-{seed}']:.1f} %"
                )
        summary = {"machine": machine_facts(), "span": args.span, "episodes": args.episodes, "validation": scores}
        write_json(
            args.out / "validation.json",
            summary,
        )
        return
    hits: dict[str, dict[str, list[list[bool]]]] = {split: {} for split in tests}
    focal_calls: dict[str, list[float]] = {split: [] for split in tests}

    def record(split: str, name: str, texts: list[str]) -> None:
        hits[split].setdefault(name, []).append(correct(texts, tests[split]).tolist())

    with progress_bar(console) as bar:
        n_test = sum(map(len, tests.values()))
        task = bar.add_task("single models", total=len(POOL) * (len(train) + len(validation) + n_test))
        outputs = {split: [] for split in ["train", "validation", *tests]}
        for m, name in enumerate(POOL):
            for split, tasks in [("train", train), ("validation", validation), *tests.items()]:
                outputs[split].append(
                    decode(alone[m], tasks, np.ones(1), cfg, batch=32, progress=lambda n: bar.advance(task, n))
                )
            for split in tests:
                record(split, name, outputs[split][m])
        task = bar.add_task("uniform, static weights", total=len(GRID) * len(validation) + 2 * n_test)
        for split in tests:
            record(
                split,
                "uniform (GaC)",
                decode(ensemble, tests[split], np.ones(2), cfg, batch=32, progress=lambda n: bar.advance(task, n)),
            )
        candidates = [np.array([1.0, 0.0]), np.array([0.0, 1.0]), *GRID]
        validation_accuracy = [
            correct(outputs["validation"][0], validation).mean(),
            correct(outputs["validation"][1], validation).mean(),
        ]
        validation_accuracy += [
            correct(
                decode(ensemble, validation, w, cfg, batch=32, progress=lambda n: bar.advance(task, n)), validation
            ).mean()
            for w in GRID
        ]
        best = candidates[int(np.argmax(validation_accuracy))]
        for split in tests:
            if best.max() == 1.0:  # a corner: the single model's own outputs
                record(split, "best static (grid)", outputs[split][int(best.argmax())])
            else:
                record(
                    split,
                    "best static (grid)",
                    decode(ensemble, tests[split], best, cfg, batch=32, progress=lambda n: bar.advance(task, n)),
                )
        ranker = AnswerRanker(encoder, len(POOL)).fit(train, outputs["train"])
        for split in tests:
            chosen = ranker.choose(tests[split], outputs[split])
            record(split, "ranker ensemble", [outputs[split][m][n] for n, m in enumerate(chosen)])
        for seed in args.seeds:
            for split in tests:
                families = sorted({t.family for t in train + tests[split]})
                focal, called = rl_focal_correct(
                    outputs["train"], train, outputs[split], tests[split], POOL, families, seed
                )
                hits[split].setdefault("rl_focal", []).append(focal.tolist())
                focal_calls[split].append(float(called.mean()))
        agents = {}
        for variant in args.variants:
            for seed in args.seeds:
                task = bar.add_task(f"rlae {variant} seed {seed}", total=args.episodes + n_test)
                trainer = trained(variant, seed, bar, task)
                for split in tests:
                    record(
                        split,
                        f"rlae_{variant}",
                        decode(
                            ensemble,
                            tests[split],
                            trainer.agent,
                            cfg,
                            batch=32,
                            progress=lambda n: bar.advance(task, n),
                        ),
                    )
                agents[variant] = trainer.agent

    latency = latency_per_answer(tests["seen"][::14][:12], alone, ensemble, ranker, agents, cfg)

    accuracy = {
        split: {name: [float(np.mean(run)) for run in runs] for name, runs in per.items()}
        for split, per in hits.items()
    }
    results = {
        "machine": machine_facts(),
        "models": POOL,
        "span": args.span,
        "episodes": args.episodes,
        "seeds": args.seeds,
        "grid_candidates": [c.tolist() for c in candidates],
        "grid_validation_accuracy": [float(a) for a in validation_accuracy],
        "grid_best": best.tolist(),
        "accuracy": accuracy,
        "rl_focal_mean_calls": {s: float(np.mean(c)) for s, c in focal_calls.items()},
        "latency_s": latency,
        "per_family": {
            split: {
                name: {
                    f: float(
                        np.mean([np.mean([h for h, t in zip(run, tests[split]) if t.family == f]) for run in runs])
                    )
                    for f in dict.fromkeys(t.family for t in tests[split])
                }
                for name, runs in per.items()
            }
            for split, per in hits.items()
        },
        "per_task": hits,
    }
    write_json(
        args.out / "results.json",
        results,
    )
    plot(results, args.out / "accuracy.png")
    for split in tests:
        families = list(dict.fromkeys(t.family for t in tests[split]))
        print(
            f"\n{split} families ({len(tests[split])} tasks): | method | exact match, mean | min–max | "
            + " | ".join(families)
            + " |"
        )
        print("|---|---|---|" + "---|" * len(families))
        for name, values in accuracy[split].items():
            fam = " | ".join(f"{100 * results['per_family'][split][name][f]:.0f}" for f in families)
            print(
                f"| {name} | {100 * np.mean(values):.1f} % | {100 * min(values):.1f}–{100 * max(values):.1f} | {fam} |"
            )
    print(
        "\nvalidation accuracy of the grid's weights: "
        + ", ".join(f"{c} {a:.3f}" for c, a in zip(results["grid_candidates"], results["grid_validation_accuracy"]))
        + f"; best {best.tolist()}"
    )
    print("latency, s per answer at batch 1: " + ", ".join(f"{k} {v:.2f}" for k, v in latency.items()))


if __name__ == "__main__":
    main()
