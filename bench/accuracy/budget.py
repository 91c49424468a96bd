"""Accuracy against the cost the user sets (issue 36, item 2): RL-Focal under a budget (the mean share of the whole
pool's cost spent per query, met online: :mod:`rlens.focal.budget`) beside the baselines at their own cost.

    python -m bench.accuracy.budget [--data DIR] [--half all|tune|holdout] [--budgets 0.1 0.2 ...] [--seeds 0 1 2]
                                    [--per-request] [--variant rl_focal] [--out bench/out/budget.json]

Paper protocol (warm start on each task's first part, then the rest as one stream, feedback at once), the same split
for every method. Per budget and seed: RL-Focal's accuracy and mean cost share; two pruning references at the same
budget: *random* (each model in the pool with probability = the budget, at least one) and *reliability* (the k
models with the best warm-split accuracy, k = budget × pool, at least one), both answered by the soft vote of their
pool. Baselines once: the best single model, the soft vote of all models, per-task logistic stacking over all
models, and stacking over the best k models (k chosen on the warm split, by accuracy on its last third when fit on
the first two thirds). Then the budget's tracking on the stream protocol (cold start, all questions in order): the
lowest and highest mean cost share over every 1,000 consecutive queries (sliding), against the budget. With
``--per-request``, also RL-Focal with no deployment budget where every query carries the budget as its own (a cap:
the greedy pool cut to fit, no exploration or probe; paper protocol): its accuracy, mean and highest cost share.
``--variant`` runs another RL-Focal variant of ``rlens replay`` (e.g. ``rl_focal_uncalibrated``). Writes a JSON file and a
plot (accuracy against cost share) beside it.
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
from rlens.evaluation.protocols import Protocol, split, task_half  # noqa: E402
from rlens.records.recorded import RecordedDataset  # noqa: E402
from rlens.settings import settings  # noqa: E402
from rlens.evaluation.replay import RL_VARIANTS, run_variant  # noqa: E402
from rlens.focal.config import FocalConfig  # noqa: E402
from rlens.focal.engine import FocalEngine  # noqa: E402
from rlens.focal.schedule import run_online, warm_start  # noqa: E402

BUDGETS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]


def soft_vote_of(test: RecordedDataset, pools: np.ndarray) -> np.ndarray:
    """Each question's answer: the argmax of its pool's mean distribution (pools bool [N, M])."""
    scores = (test.probs * pools[:, :, None]).sum(1)
    return np.where(test.choice_mask, scores, -np.inf).argmax(1)


def pruned(warm: RecordedDataset, test: RecordedDataset, budget: float, seed: int) -> dict[str, tuple[float, float]]:
    """(accuracy, cost share) of the random and the reliability pruning at ``budget``, soft-voted."""
    share = baselines.cost_shares(test)
    rng = np.random.default_rng(seed)
    random_pools = rng.random((test.n_questions, test.n_models)) < budget
    empty = ~random_pools.any(1)
    random_pools[empty, rng.integers(0, test.n_models, empty.sum())] = True
    accuracy = (baselines.model_predictions(warm) == warm.labels[:, None]).mean(0)
    k = max(1, round(budget * test.n_models))
    best = np.zeros(test.n_models, dtype=bool)
    best[np.argsort(-accuracy)[:k]] = True
    reliable = np.repeat(best[None], test.n_questions, 0)
    out = {}
    for name, pools in (("random", random_pools), ("reliability", reliable)):
        out[name] = (float((soft_vote_of(test, pools) == test.labels).mean()), float((pools * share).sum(1).mean()))
    return out


def only(data: RecordedDataset, keep: list[int]) -> RecordedDataset:
    """The dataset with the models ``keep`` alone."""
    return replace(
        data,
        probs=data.probs[:, keep],
        model_names=[data.model_names[m] for m in keep],
        model_costs=data.model_costs[keep],
    )


def stacking_best_k(warm: RecordedDataset, test: RecordedDataset) -> tuple[float, float, int]:
    """Stacking over the k best models (warm-split accuracy), k chosen on the warm split's last third."""
    order = np.argsort(-(baselines.model_predictions(warm) == warm.labels[:, None]).mean(0))
    fit, check = [], []
    for task in np.unique(warm.task):
        rows = np.flatnonzero(warm.task == task)
        cut = (2 * len(rows)) // 3
        fit += list(rows[:cut])
        check += list(rows[cut:])
    share = baselines.cost_shares(test)

    def run(k: int, train: RecordedDataset, target: RecordedDataset) -> np.ndarray:
        keep = sorted(order[:k])
        result = baselines.stacking(only(train, keep), only(target, keep))
        assert result is not None
        return result.answers

    scores = {
        k: float((run(k, warm.subset(np.array(fit)), warm.subset(np.array(check))) == warm.labels[check]).mean())
        for k in range(1, warm.n_models + 1)
    }
    k = max(scores, key=lambda k: (scores[k], -k))
    accuracy = float((run(k, warm, test) == test.labels).mean())
    return accuracy, float(share[order[:k]].sum()), k


def per_request(
    data: RecordedDataset, warm_index: np.ndarray, test_index: np.ndarray, cap: float, seed: int, variant: str
) -> dict:
    """RL-Focal (``variant``) warm-started on the warm split, every test query with ``cap`` as its own budget (paper
    protocol)."""
    torch.set_num_threads(1)
    config = replace(FocalConfig(), **RL_VARIANTS[variant][0])
    engine = FocalEngine(data.n_models, data.model_costs, config, seed=seed)
    warm_start(engine, data.subset(warm_index))
    trace = run_online(engine, data.subset(test_index), cap=cap)
    return {
        "per_request_accuracy": float(trace.correct.mean()),
        "per_request_cost_share": float(trace.cost_share.mean()),
        "per_request_max": float(trace.cost_share.max()),
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--data", type=Path, default=None, help="recorded dataset (default: the shared bbh_dev)")
    parser.add_argument(
        "--half",
        choices=["all", "tune", "holdout"],
        default="all",
        help="the tasks (rlens.evaluation.protocols.task_half)",
    )
    parser.add_argument("--budgets", type=float, nargs="+", default=BUDGETS)
    parser.add_argument("--per-request", action="store_true", help="also each query with the budget as its own cap")
    parser.add_argument("--variant", default="rl_focal", choices=list(RL_VARIANTS), help="the RL-Focal variant")
    add_seeds(parser)
    add_out(parser, "bench/out/budget.json")
    args = parser.parse_args()
    data = load_dataset(args.data or settings().service.shared_data / "bbh_dev")
    if args.half != "all":
        data = task_half(data, args.half)
    print(machine_facts(), f"{args.half}: {data.n_questions} questions", flush=True)
    warm_index, test_index = split(data, Protocol.paper)
    warm, test = data.subset(warm_index), data.subset(test_index)
    share = baselines.cost_shares(data)
    best = baselines.best_single(warm, test)
    best_model = int((baselines.model_predictions(warm) == warm.labels[:, None]).mean(0).argmax())
    stacked = baselines.stacking(warm, test)
    assert stacked is not None
    stack_k = stacking_best_k(warm, test)
    references = {
        "best_single": (float((best.answers == test.labels).mean()), float(share[best_model])),
        "soft_vote": (float((baselines.soft_voting(test).answers == test.labels).mean()), 1.0),
        "stacking": (float((stacked.answers == test.labels).mean()), 1.0),
        f"stacking_best_{stack_k[2]}": stack_k[:2],
    }
    for name, (accuracy, cost) in references.items():
        print(f"{name:18s} accuracy {100 * accuracy:.1f} %, cost share {cost:.2f}", flush=True)
    rows = []
    for budget in args.budgets:
        for seed in args.seeds:
            config = replace(FocalConfig(), budget=budget, budget_cap=False)
            paper = run_variant(args.variant, data, warm_index, test_index, config, seed, None)
            stream = run_variant(
                args.variant, data, np.array([], dtype=int), np.arange(data.n_questions), config, seed, None
            )
            spent = np.concatenate([[0.0], np.cumsum(stream.cost_share)])
            sliding = (spent[1000:] - spent[:-1000]) / 1000  # every 1,000 consecutive queries
            windows = [float(sliding.min()), float(sliding.max())]
            row = {
                "budget": budget,
                "seed": seed,
                "accuracy": float(paper.correct.mean()),
                "cost_share": float(paper.cost_share.mean()),
                "stream_windows": windows,
                "stream_accuracy": float(stream.correct.mean()),
                **{
                    f"{name}_{what}": value
                    for name, r in pruned(warm, test, budget, seed).items()
                    for what, value in zip(("accuracy", "cost_share"), r)
                },
            }
            if args.per_request:
                row.update(per_request(data, warm_index, test_index, budget, seed, args.variant))
            rows.append(row)
            print(
                f"budget {budget:.2f} seed {seed}: {args.variant} {100 * row['accuracy']:.1f} % at {row['cost_share']:.3f}; "
                f"random {100 * row['random_accuracy']:.1f} %, reliability {100 * row['reliability_accuracy']:.1f} %; "
                f"stream windows {windows[0]:.3f}-{windows[1]:.3f}"
                + (
                    f"; per request {100 * row['per_request_accuracy']:.1f} % at {row['per_request_cost_share']:.3f} "
                    f"(at most {row['per_request_max']:.3f})"
                    if args.per_request
                    else ""
                ),
                flush=True,
            )
    path = write_json(
        args.out,
        {
            "machine": machine_facts(),
            "data": str(args.data or "bbh_dev"),
            "variant": args.variant,
            "references": references,
            "rows": rows,
        },
    )
    plot(rows, references, path.with_suffix(".png"))


def plot(rows: list[dict], references: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    budgets = sorted({r["budget"] for r in rows})
    kinds = [("", "o"), ("random_", "x"), ("reliability_", "s")]
    if "per_request_accuracy" in rows[0]:
        kinds.insert(1, ("per_request_", "^"))
    for name, marker in kinds:
        xs = [
            np.mean([r[f"{name}cost_share" if name else "cost_share"] for r in rows if r["budget"] == b])
            for b in budgets
        ]
        ys = [
            100 * np.mean([r[f"{name}accuracy" if name else "accuracy"] for r in rows if r["budget"] == b])
            for b in budgets
        ]
        ax.plot(
            xs,
            ys,
            marker=marker,
            label={"": "rl_focal under a budget", "per_request_": "rl_focal, each query's own budget"}.get(
                name, name.rstrip("_") + " pruning, soft vote"
            ),
        )
    for name, (accuracy, cost) in references.items():
        ax.scatter([cost], [100 * accuracy], marker="*", s=90)
        ax.annotate(name, (cost, 100 * accuracy), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("mean share of the pool's cost per query")
    ax.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
