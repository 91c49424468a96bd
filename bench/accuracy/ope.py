"""How well off-policy evaluation estimates policies it did not log, where the truth is known (issue 35, item 2).

    python -m bench.accuracy.ope [--data DIR|synthetic-plain|synthetic-families ...] [--seeds 0 1 2]
        [--calibration-rows 200] [--greedy] [--probe-rate 0.05] [--out bench/out/ope.json]

Recorded data holds every model's answer to every question, so a stream can be logged under one policy and, on the
very same contexts, every other policy's reward and accuracy computed exactly. Per dataset: the candidate policies are
trained (warm start, Algorithm 1) on the tuning half of the tasks (:func:`rlens.evaluation.protocols.task_half`),
or, on a stream of one task, on its first third (:func:`halves`); the logging policy, RL-Focal warm-started there
with the seed, then serves the rest online (Algorithm 2: 5 %
of queries explored, 5 % probes or ``--probe-rate``, feedback at once) and logs what a worker logs (its pool, answer and propensity,
the answers of the models it called, the window statistics). Each candidate is then estimated from that log alone,
and its true value computed with every answer known. Candidates (21 with 5 models): RL-Focal warm-started with seeds
0–2, with the cost weight α 0, 0.08, 0.16, 0.32, 0.5 and 1, without the Decider, with the supervised Fusion start only, untrained (seeds 0–2),
the logging engine as it ended; each single model; the whole pool's soft vote. Per estimator: bias, RMSE and 95 %
interval coverage over candidates and seeds, and the Spearman correlation of estimated and true values per seed.
``--calibration-rows R``: the logging policy keeps each model's calibration per stream and votes with it
(``RLENS_FOCAL_CALIBRATION_ROWS``), and logs each called model's calibrated distribution; every candidate is then
judged as it would serve there, with the vote. Candidates are judged as they would serve (the estimates and the truth
alike: their greedy action on the greedy share, a sample of their Fusion on the explored share, as the gate judges
them); ``--greedy``: on their greedy actions alone. ``synthetic-plain`` and ``synthetic-families`` are issue 57's long
single-task validation sets (10,000 questions, 11 models, seed 0; the second with the models in 3 families that share
their mistakes: :mod:`bench.accuracy.long_streams`).
"""

from __future__ import annotations

import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")  # portable numerics (as `rlens replay`): before torch loads
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import time  # noqa: E402
from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common.args import add_out, add_seeds, arguments, write_json  # noqa: E402
from bench.common.datasets import SYNTHETIC, dataset  # noqa: E402
from bench.common.machine import machine_facts  # noqa: E402
from rlens.evaluation.logged import FixedPool, FocalPolicy, LoggedQuery, Policy, evaluate, true_value  # noqa: E402
from rlens.evaluation.protocols import task_half  # noqa: E402
from rlens.records.recorded import RecordedDataset  # noqa: E402
from rlens.focal.config import FocalConfig  # noqa: E402
from rlens.focal.engine import FocalEngine  # noqa: E402
from rlens.focal.schedule import questions, run_online, warm_start  # noqa: E402
from rlens.settings import settings  # noqa: E402

ESTIMATORS = ("exact", "replay", "ips", "snips", "dr")


def halves(data: RecordedDataset) -> tuple[RecordedDataset, RecordedDataset]:
    """(what the candidates and the logging policy are trained on, what is logged): the tuning and the holdout
    half of the tasks; a stream of one task, its first third and the rest, in stream order."""
    if len(np.unique(data.task)) > 1:
        return task_half(data, "tune"), task_half(data, "holdout")
    third = data.n_questions // 3
    return data.subset(np.arange(third)), data.subset(np.arange(third, data.n_questions))


def trained(data: RecordedDataset, seed: int, **config) -> FocalEngine:
    engine = FocalEngine(data.n_models, data.model_costs, replace(FocalConfig(), **config), seed=seed)
    warm_start(engine, data)
    return engine


def candidates(train: RecordedDataset) -> list[Policy]:
    """The candidate policies (20 with 5 models), trained on the tuning half."""
    m = train.n_models
    out: list[Policy] = [FocalPolicy(f"rl_focal seed {s}", trained(train, s)) for s in (0, 1, 2)]
    out += [FocalPolicy(f"rl_focal alpha {a:g}", trained(train, 0, alpha=a)) for a in (0.0, 0.08, 0.16, 0.32, 0.5, 1.0)]
    out.append(FocalPolicy("no Decider (all models)", trained(train, 0, use_decider=False)))
    out.append(
        FocalPolicy(
            "supervised Fusion start only",
            trained(train, 0, decider_warm_passes=0, fusion_warm_passes=0, joint_warm_passes=0),
        )
    )
    out += [FocalPolicy(f"untrained seed {s}", FocalEngine(m, train.model_costs, seed=s)) for s in (0, 1, 2)]
    out += [FixedPool(f"only {name}", np.eye(m, dtype=bool)[j]) for j, name in enumerate(train.model_names)]
    out.append(FixedPool("soft vote of all", np.ones(m, dtype=bool)))
    return out


def logged_run(engine: FocalEngine, data: RecordedDataset) -> tuple[list[LoggedQuery], list[LoggedQuery]]:
    """Serve ``data`` online with ``engine`` (one window per task); what the worker would log, and the same
    contexts with every model's answer (the truth's view)."""
    qs = questions(data)
    logged: list[LoggedQuery] = []
    full: list[LoggedQuery] = []

    def served(i, decision, answer) -> None:
        q = qs[i]
        window = engine.window(decision.key)
        propensity = engine.propensity(decision, answer)
        view = LoggedQuery(
            state=decision.state.copy(),
            probs=q.probs * decision.called[:, None],
            known=decision.called.copy(),
            reliability=window.reliability().copy(),
            label_prior=window.label_prior(q.probs.shape[1]).copy(),
            pool=decision.pool.copy(),
            answer=answer.answer,
            propensity=propensity,
            label=q.label,
            probe=decision.called is engine.everyone,  # the engine calls the whole pool on a probe
            explore_rate=engine.cfg.explore_rate,
        )
        if engine.calibrations is not None and q.decider_choices:  # what the worker logs, and every model's
            calibration = engine.calibrations(decision.key)
            rows = [calibration.calibrated(p, m) for m, p in enumerate(q.probs)]
            every = np.array([np.full(q.probs.shape[1], np.nan) if r is None else r for r in rows])
            view = replace(
                view,
                calibrated=np.where(decision.called[:, None], every, np.nan),
                calibration_prior=calibration.prior(q.probs.shape[1]).copy(),
            )
            logged.append(view)
            full.append(replace(view, probs=q.probs, known=np.ones(engine.n_models, dtype=bool), calibrated=every))
        else:
            logged.append(view)
            full.append(replace(view, probs=q.probs, known=np.ones(engine.n_models, dtype=bool)))

    run_online(engine, data, served=served)
    return logged, full


def spearman(x: list[float], y: list[float]) -> float:
    """Rank correlation (ties share their mean rank) over the pairs with an estimate."""
    from scipy.stats import spearmanr

    pairs = [(a, b) for a, b in zip(x, y) if not np.isnan(a)]
    if len(pairs) < 3:
        return float("nan")
    xs, ys = zip(*pairs)
    return float(spearmanr(xs, ys).statistic)


def main() -> None:
    parser = arguments(__doc__)
    default = [str(settings().service.shared_data / "bbh_dev"), str(settings().service.demo_data)]
    parser.add_argument(
        "--data",
        nargs="+",
        default=default,
        help=f"recorded datasets, or {' / '.join(SYNTHETIC)} (default: bbh_dev, the bundled stream)",
    )
    parser.add_argument(
        "--calibration-rows",
        type=int,
        default=FocalConfig.calibration_rows,
        help="the logging policy's calibrations (0: none)",
    )
    parser.add_argument("--greedy", action="store_true", help="judge the candidates on their greedy actions alone")
    parser.add_argument(
        "--probe-rate",
        type=float,
        default=FocalConfig.probe_rate,
        help="the logging policy's share of queries that call the whole pool (RLENS_FOCAL_PROBE_RATE)",
    )
    add_seeds(parser)
    add_out(parser, "bench/out/ope.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_facts())
    rows, summary = [], {}
    for path in args.data:
        data = dataset(path)
        train, test = halves(data)
        started = time.perf_counter()
        policies = candidates(train)
        print(
            f"{data.name}: {len(policies)} candidates trained on {train.n_questions} questions in {time.perf_counter() - started:.0f} s"
        )
        cost_share = data.model_costs / data.model_costs.sum()
        alpha = FocalConfig().alpha
        for seed in args.seeds:
            logging = trained(train, seed, calibration_rows=args.calibration_rows, probe_rate=args.probe_rate)
            logged, full = logged_run(logging, test)
            ended = FocalPolicy("logging engine as it ended", logging)
            for policy in [*policies, ended]:
                truth = true_value(full, policy, cost_share, alpha, serving=not args.greedy)
                found = evaluate(logged, policy, cost_share, alpha, serving=not args.greedy)
                for metric in ("reward", "accuracy"):
                    row = {
                        "data": data.name,
                        "seed": seed,
                        "policy": policy.name,
                        "metric": metric,
                        "truth": truth[metric],
                    }
                    row.update({name: found[metric][name].to_dict() for name in ESTIMATORS})
                    rows.append(row)
            probes = sum(q.probe for q in logged)
            print(f"  seed {seed}: {len(logged)} logged queries, {probes} probes")
        for metric in ("reward", "accuracy"):
            mine = [r for r in rows if r["data"] == data.name and r["metric"] == metric]
            per_estimator = {}
            for name in ESTIMATORS:
                errors = np.array([r[name]["value"] - r["truth"] for r in mine])  # nan: no matched query (snips)
                covered = np.mean([r[name]["low"] <= r["truth"] <= r[name]["high"] for r in mine])
                ranks = [
                    spearman(
                        [r[name]["value"] for r in mine if r["seed"] == s], [r["truth"] for r in mine if r["seed"] == s]
                    )
                    for s in args.seeds
                ]
                per_estimator[name] = {
                    "bias": float(np.nanmean(errors)),
                    "rmse": float(np.sqrt(np.nanmean(errors**2))),
                    "no_estimate": int(np.isnan(errors).sum()),
                    "coverage": float(covered),
                    "spearman": float(np.mean(ranks)),
                    "spearman_per_seed": ranks,
                    "median_ess": float(np.median([r[name]["ess"] for r in mine])),
                }
                e = per_estimator[name]
                print(
                    f"  {metric:8s} {name:5s} bias {e['bias']:+.3f}  rmse {e['rmse']:.3f}  coverage {100 * e['coverage']:.0f} %  "
                    f"spearman {e['spearman']:.2f}  median ESS {e['median_ess']:.0f}"
                )
            summary[f"{data.name}/{metric}"] = per_estimator
    write_json(
        args.out,
        {
            "machine": machine_facts(),
            "seeds": args.seeds,
            "calibration_rows": args.calibration_rows,
            "serving": not args.greedy,
            "probe_rate": args.probe_rate,
            "summary": summary,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
