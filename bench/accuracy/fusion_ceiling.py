"""The Fusion agent's supervised ceiling against per-task stacking, paper protocol (issue 15, item 3).

    python -m bench.accuracy.fusion_ceiling [--tasks tune|holdout|all] [--seeds 0 1 2] [--epochs 0 4 12] [--precision]

No Decider, no RL, no sliding window: every model is called, each task's reliabilities and label prior come from
its whole warm-start split (what a full window would hold), and the Fusion network is trained by cross-entropy on
the warm-start labels alone (``rlens.focal.supervised.fit_fusion``, RL-Focal's optimiser settings), once shared by
the tasks as RL-Focal does and once per task. What it scores on the test split bounds what the Fusion's features and
network can reach there with these labels; stacking is the per-task logistic regression of the baselines.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from bench.common.machine import machine_facts
from bench.common.args import add_out, add_seeds, arguments, write_json
from rlens.evaluation.baselines import stacking
from rlens.records.dataset import load_dataset
from rlens.records.recorded import RecordedDataset
from rlens.settings import settings
from rlens.evaluation.protocols import Protocol, split, task_half
from rlens.focal.agents import Fusion
from rlens.focal.config import FocalConfig
from rlens.focal.features import (
    fusion_observations,
    padded_choices,
    reliability_weighted_log_probs,
)
from rlens.focal.supervised import fit_fusion
from rlens.focal.window import OutcomeWindow


def task_statistics(warm: RecordedDataset, task: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``task``'s reliabilities [M] and label prior [C] from a window holding its whole warm split (what a full
    window would hold), and each model's precision per choice [M, C]: P(label = c | it votes c), shrunk toward the
    prior with weight 2."""
    rows = np.flatnonzero(warm.task == task)
    n_choices = int(warm.choice_mask[rows[0]].sum())
    votes, labels = warm.probs[rows].argmax(2), warm.labels[rows]
    window = OutcomeWindow(warm.n_models, len(rows))
    window.extend(votes, labels, np.zeros(len(rows)))
    prior = window.label_prior(n_choices)
    voted = votes[:, :, None] == np.arange(n_choices)  # [n, M, C]
    hits = (voted & (labels[:, None, None] == np.arange(n_choices))).sum(0)
    return window.reliability(), prior, (hits + 2 * prior) / (voted.sum(0) + 2)


def task_features(
    data: RecordedDataset, rows: np.ndarray, statistics: tuple[np.ndarray, np.ndarray, np.ndarray], precision: bool
) -> list[np.ndarray]:
    """Fusion observations of ``rows`` of ``data`` with every model in the pool and a task's
    :func:`task_statistics`; with ``precision``, 2M more per choice (:func:`precision_features`)."""
    reliability, prior, model_precision = statistics
    everyone = np.ones((1, data.n_models), dtype=bool)
    out = []
    for i in rows:
        valid = np.flatnonzero(data.choice_mask[i])
        probs = data.probs[i][:, valid]
        row = fusion_observations(probs[None], everyone, reliability[None], prior[None, : len(valid)])[0]
        out.append(np.concatenate([row, precision_features(probs, model_precision)], 1) if precision else row)
    return out


def precision_features(probs: np.ndarray, model_precision: np.ndarray) -> np.ndarray:
    """[C, 2M] for one question (probs [M, C]): for the choice model m votes for, log P(label = c | m votes c); for
    every other choice, log of the rest of that probability shared evenly by them (a stacking-like, per-choice view
    of each model's bias)."""
    m, c = probs.shape
    vote = probs.argmax(1)
    own = np.log(model_precision[np.arange(m), vote] + 1e-3)  # [M]
    rest = np.log((1 - model_precision[np.arange(m), vote]) / max(c - 1, 1) + 1e-3)
    is_vote = np.arange(c)[:, None] == vote[None, :]  # [C, M]
    return np.concatenate([np.where(is_vote, own, 0.0), np.where(is_vote, 0.0, rest)], 1).astype(np.float32)


def trained_fusion(features: list[np.ndarray], labels: np.ndarray, n_models: int, epochs: int, seed: int) -> Fusion:
    cfg = FocalConfig()
    torch.manual_seed(seed)
    fusion = Fusion(features[0].shape[1], cfg.hidden, reliability_weighted_log_probs(n_models))
    if epochs:
        optimizer = torch.optim.Adam(fusion.parameters(), lr=cfg.lr, eps=1e-5)
        generator = torch.Generator().manual_seed(seed)
        fit_fusion(
            fusion, optimizer, features, labels.tolist(), epochs, cfg.minibatch_size, cfg.max_grad_norm, generator
        )
    return fusion


def answers(fusion: Fusion, features: list[np.ndarray]) -> np.ndarray:
    padded, mask = padded_choices(features)
    with torch.no_grad():
        return fusion.scores(torch.from_numpy(padded), torch.from_numpy(mask)).argmax(-1).numpy()


def mean_std(accuracies: list[float]) -> str:
    spread = np.std(accuracies, ddof=1) if len(accuracies) > 1 else 0.0
    return f"{100 * np.mean(accuracies):.1f} ± {100 * spread:.1f} %"


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--data", type=Path, default=None, help="default: bbh_dev under the shared datasets")
    parser.add_argument("--tasks", choices=("tune", "holdout", "all"), default="tune")
    add_seeds(parser)
    parser.add_argument("--epochs", type=int, nargs="+", default=[0, 4, 12])
    parser.add_argument(
        "--precision", action="store_true", help="add each model's per-choice precision to the features (2M more)"
    )
    add_out(parser, "bench/out/fusion_ceiling.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine_facts()}", flush=True)
    data = load_dataset(args.data or settings().service.shared_data / "bbh_dev")
    if args.tasks != "all":
        data = task_half(data, args.tasks)
    warm_index, test_index = split(data, Protocol.paper)
    warm, test = data.subset(warm_index), data.subset(test_index)
    tasks = np.unique(test.task)
    per_task = {}
    for t in tasks:
        statistics = task_statistics(warm, t)
        per_task[int(t)] = (
            task_features(warm, np.flatnonzero(warm.task == t), statistics, args.precision),
            warm.labels[warm.task == t],
            task_features(test, np.flatnonzero(test.task == t), statistics, args.precision),
            test.labels[test.task == t],
        )
    train_x = [f for t in tasks for f in per_task[t][0]]
    train_y = np.concatenate([per_task[t][1] for t in tasks])
    test_x = [f for t in tasks for f in per_task[t][2]]
    test_y = np.concatenate([per_task[t][3] for t in tasks])
    results: dict = {
        "tasks": args.tasks,
        "precision": args.precision,
        "seeds": args.seeds,
        "test_questions": len(test_y),
    }
    run = stacking(warm, test)
    if run is None:
        raise SystemExit("the warm-start split is empty: stacking needs one")
    results["stacking"] = float((run.answers == test.labels).mean())
    print(f"stacking (per task): {100 * results['stacking']:.1f} %")
    for epochs in args.epochs:
        shared = [
            float((answers(trained_fusion(train_x, train_y, data.n_models, epochs, s), test_x) == test_y).mean())
            for s in args.seeds
        ]
        results[f"fusion_shared_{epochs}"] = shared
        print(f"Fusion shared by the tasks, {epochs} epochs: {mean_std(shared)}")
        if not epochs:
            continue  # an untrained Fusion is the same per task
        own = []
        for s in args.seeds:
            right = sum(
                int((answers(trained_fusion(x, y, data.n_models, epochs, s), tx) == ty).sum())
                for x, y, tx, ty in per_task.values()
            )
            own.append(right / len(test_y))
        results[f"fusion_per_task_{epochs}"] = own
        print(f"Fusion per task, {epochs} epochs: {mean_std(own)}")
    write_json(
        args.out,
        results,
    )


if __name__ == "__main__":
    main()
