"""What a fixed pool, or a confidence cascade, reaches on a long single-task stream at a given cost: the ceiling
beside RL-Focal's budget figures (issue 57, the target at a budget of 0.3).

    python -m bench.accuracy.pool_ceiling [--sets plain families zoo] [--zoo-data DIR] [--sizes 1 2 3 4 5 6]
                                          [--out bench/out/pool_ceiling.json]

The sets are ``bench.accuracy.long_streams``'s. Paper protocol (the first 80 % warm, the last 20 % the test).
For each pool size k, the pool of k models whose stacker (the stacking baseline on the pool's models alone: a
logistic regression on their log-probabilities, fitted on the warm split) scores best **on the test split**: chosen
in hindsight, so no fixed pool of k models does better there (every pool for k <= 4, then forward from the best pool
one size down). Then a cascade that calls the best pair first and every other model where the pair's stacker puts
less than tau on its answer (tau 0.5 to 0.9), answering there with the stacker over every model. Each row's cost is
its share of the pool's cost (the models' prices). Deterministic: no seed.
"""

from __future__ import annotations

import itertools

import numpy as np

from bench.common.args import add_out, arguments, write_json
from bench.accuracy.long_streams import add_sets, validation_sets
from bench.common.machine import machine_facts
from rlens.focal.features import LOG_FLOOR
from rlens.evaluation.protocols import Protocol, split
from rlens.records.recorded import RecordedDataset


def stacker(warm: RecordedDataset, test: RecordedDataset, pool: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The pool's stacker on the test split: (its answers, its probability of them)."""
    from sklearn.linear_model import LogisticRegression

    features = lambda d: np.log(np.maximum(d.probs[:, list(pool)], LOG_FLOOR)).reshape(d.n_questions, -1)  # noqa: E731
    fitted = LogisticRegression(C=1.0, max_iter=2000).fit(features(warm), warm.labels)
    proba = fitted.predict_proba(features(test))
    return fitted.classes_[proba.argmax(1)], proba.max(1)


def ceiling(data: RecordedDataset, sizes: list[int]) -> dict:
    warm_rows, test_rows = split(data, Protocol.paper)
    warm, test = data.subset(warm_rows), data.subset(test_rows)
    if len(np.unique(data.task)) != 1:
        raise SystemExit(f"{data.name}: one task only (a long single-task stream)")
    share = lambda pool: float(data.model_costs[list(pool)].sum() / data.model_costs.sum())  # noqa: E731
    accuracy = lambda pool: float((stacker(warm, test, pool)[0] == test.labels).mean())  # noqa: E731
    every = tuple(range(data.n_models))
    whole = stacker(warm, test, every)[0]  # the stacking baseline (one task): every model
    result: dict = {
        "set": data.name,
        "stacking_all": float((whole == test.labels).mean()),
        "pools": [],
        "cascade": [],
    }
    best: dict[int, tuple[float, tuple[int, ...]]] = {}
    for k in sorted(sizes):
        if k > data.n_models:
            break
        if k <= 4 or k - 1 not in best:
            candidates = list(itertools.combinations(every, k))
        else:
            candidates = [tuple(sorted(best[k - 1][1] + (j,))) for j in every if j not in best[k - 1][1]]
        best[k] = max((accuracy(pool), pool) for pool in candidates)
        result["pools"].append({"size": k, "accuracy": best[k][0], "pool": list(best[k][1]), "cost": share(best[k][1])})
        print(
            f"{data.name}: the best pool of {k}: {100 * best[k][0]:.2f} % at {share(best[k][1]):.2f} of the cost",
            flush=True,
        )
    if 2 in best:
        pair = best[2][1]
        first, confidence = stacker(warm, test, pair)
        for tau in (0.5, 0.6, 0.7, 0.8, 0.9):
            escalated = confidence < tau
            answers = np.where(escalated, whole, first)
            row = {
                "tau": tau,
                "accuracy": float((answers == test.labels).mean()),
                "cost": share(pair) + float(escalated.mean()) * (1 - share(pair)),
            }
            result["cascade"].append(row)
            print(
                f"{data.name}: cascade from {list(pair)}, tau {tau}: {100 * row['accuracy']:.2f} % at {row['cost']:.2f}"
            )
    print(f"{data.name}: stacking over every model {100 * result['stacking_all']:.2f} %", flush=True)
    return result


def main() -> None:
    parser = arguments(__doc__)
    add_sets(parser)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    add_out(parser, "bench/out/pool_ceiling.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    results = [ceiling(data, args.sizes) for _, data in validation_sets(args)]
    write_json(args.out, {"machine": machine_facts(), "sets": results})


if __name__ == "__main__":
    main()
