"""What simple online rules reach under the stream protocol when they see every model's outcome (full information),
against the best single model per task chosen in hindsight.

    python -m bench.accuracy.stream_bound [--data DIR] [--tasks all|tune|holdout] [--windows 32 64 128 0]

Per task (one stream key per task, as in ``rlens replay --protocol stream``), from a cold start, each question is
answered from the outcomes of the task's earlier questions (the last W; 0: all of them), every model's outcome
known after each question:

* ``follow_the_leader``: the answer of the model with the most right answers in the window (ties: the first);
* ``reliability_vote``: the choice with the highest sum over models of exp(20 (r_m - max r)) log p_m(c), r_m the
  window accuracy (a vote that trusts the leaders, with every model called).

These rules know more than RL-Focal does online (it sees only the models it called, plus 5 % probes) and nothing
of the future. Deterministic: no seed.
"""

from __future__ import annotations


import numpy as np

from rlens.records.dataset import load_dataset
from rlens.records.recorded import RecordedDataset
from rlens.settings import settings
from rlens.evaluation.protocols import task_half
from bench.common.args import arguments


def online_accuracy(data: RecordedDataset, window: int, rule: str) -> float:
    picks = data.probs.argmax(-1)  # [N, M]: each model's answer
    right = picks == data.labels[:, None]
    log_probs = np.log(data.probs + 1e-9)
    hits = 0
    history: dict[int, list[np.ndarray]] = {}
    for i in range(data.n_questions):
        rows = history.setdefault(int(data.task[i]), [])
        recent = rows[-window:] if window else rows
        reliability = np.mean(recent, axis=0) if recent else np.full(right.shape[1], 0.5)
        if rule == "follow_the_leader":
            answer = picks[i, reliability.argmax()]
        else:
            weights = np.exp(20.0 * (reliability - reliability.max()))
            scores = weights @ log_probs[i]
            answer = np.where(data.choice_mask[i], scores, -np.inf).argmax()
        hits += answer == data.labels[i]
        rows.append(right[i])
    return hits / data.n_questions


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--data", default=str(settings().service.shared_data / "bbh_dev"))
    parser.add_argument("--tasks", default="all", choices=["all", "tune", "holdout"])
    parser.add_argument("--windows", type=int, nargs="+", default=[32, 64, 128, 0])
    args = parser.parse_args()
    data = load_dataset(args.data)
    if args.tasks != "all":
        data = task_half(data, args.tasks)
    right = data.probs.argmax(-1) == data.labels[:, None]
    hindsight = sum(right[data.task == t].mean(0).max() * (data.task == t).sum() for t in np.unique(data.task))
    print(
        f"{data.name}, tasks {args.tasks}: best single model per task in hindsight {100 * hindsight / data.n_questions:.1f} %"
    )
    print("| window | follow_the_leader % | reliability_vote % |\n|---|---:|---:|")
    for window in args.windows:
        accuracies = [100 * online_accuracy(data, window, rule) for rule in ("follow_the_leader", "reliability_vote")]
        print(f"| {window or 'all'} | {accuracies[0]:.1f} | {accuracies[1]:.1f} |")


if __name__ == "__main__":
    main()
