"""``rlens ope``'s work: candidate policies from learner checkpoints, every estimator's value of each on a log, and
the report (``ope.json``, ``ope.md``, ``ope.png``: each candidate's estimates with their intervals)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rlens.checkpoint import CheckpointStore
from rlens.evaluation.logged import FocalPolicy, LoggedQuery, evaluate, reward
from rlens.evaluation.ope import Estimate, direct
from rlens.focal.engine import FocalEngine
from rlens.focal.checkpoint import load_engine

SHOWN = ("replay", "exact", "dr", "snips", "ips")
FEW_PROBES = 0.1  # below this share of probe rows, close candidates are not ranked reliably (BENCHMARKS.md)


def few_probes(queries: list[LoggedQuery]) -> str | None:
    """A warning when the log's probe rows are too few to rank candidates that lie close together; else None."""
    share = sum(q.probe for q in queries) / max(len(queries), 1)
    if share >= FEW_PROBES:
        return None
    return (
        f"only {100 * share:.0f} % of the logged queries are probes: the estimates are wide, and candidates within a "
        "few points of one another are not ranked reliably (at 5 % probes, 0.69 rank correlation on bbh_dev; at 20 %, "
        "gated promotion's default, 0.87: BENCHMARKS.md); RLENS_FOCAL_PROBE_RATE raises it"
    )


def checkpoint_policy(directory: Path, model_costs: np.ndarray) -> FocalPolicy:
    """The greedy policy of the newest verified checkpoint in a learner's checkpoint directory."""
    engine = FocalEngine(len(model_costs), model_costs)
    if load_engine(CheckpointStore(directory, lock=False), engine) is None:  # beside the running learner
        raise ValueError(f"{directory}: no checkpoint of a learner here")
    return FocalPolicy(str(directory), engine)


def served(queries: list[LoggedQuery], cost_share: np.ndarray, alpha: float) -> dict[str, Estimate]:
    """What the logging policy itself got (its own traffic: a plain mean)."""
    labelled = [q for q in queries if q.label >= 0]
    return {
        "reward": direct(np.array([reward(q.pool, q.answer, q.label, cost_share, alpha) for q in labelled])),
        "accuracy": direct(np.array([float(q.answer == q.label) for q in labelled])),
    }


def estimate_all(
    queries: list[LoggedQuery],
    policies: list[FocalPolicy],
    cost_share: np.ndarray,
    alpha: float,
    serving: bool = True,
) -> dict[str, dict[str, dict[str, Estimate]]]:
    """Candidate name -> metric -> estimator -> estimate (under the serving mixture each query logged, or of the
    greedy actions alone); "served" holds the logging policy's own figures."""
    out = {"served": {metric: {"on-policy": e} for metric, e in served(queries, cost_share, alpha).items()}}
    for policy in policies:
        out[policy.name] = evaluate(queries, policy, cost_share, alpha, serving)
    return out


def write_report(results: dict, queries: list[LoggedQuery], out: Path, serving: bool = True) -> list[Path]:
    """``ope.json``, ``ope.md`` and ``ope.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    as_json = {
        name: {m: {e: v.to_dict() for e, v in by.items()} for m, by in metrics.items()}
        for name, metrics in results.items()
    }
    probes = sum(q.probe for q in queries)
    (out / "ope.json").write_text(
        json.dumps({"queries": len(queries), "probes": probes, "serving": serving, "results": as_json}, indent=1)
    )
    judged = (
        "as they would serve: their greedy action on the greedy share of each query, a sample of their Fusion's own "
        "distribution on the explored share the log records (as the gate judges them)"
        if serving
        else "on their greedy actions alone"
    )
    lines = [
        f"# Off-policy evaluation on {len(queries)} logged queries ({probes} probes)",
        "",
        f"Candidates are judged {judged}. `replay` is the estimator to read first (exact where the log holds the "
        "answers a candidate needs, a reward model corrected on the probe rows elsewhere); `exact` uses the probe "
        "rows alone.",
        "",
        *([f"**Note**: {warning}.", ""] if (warning := few_probes(queries)) else []),
        "| policy | estimator | reward [95 % CI] | accuracy [95 % CI] | n | ESS |",
        "|---|---|---|---|---:|---:|",
    ]
    for name, metrics in results.items():
        for estimator in metrics["reward"]:
            r, a = metrics["reward"][estimator], metrics["accuracy"][estimator]
            lines.append(
                f"| {name} | {estimator} | {r.value:.3f} [{r.low:.3f}, {r.high:.3f}] | "
                f"{100 * a.value:.1f} % [{100 * a.low:.1f}, {100 * a.high:.1f}] | {r.n} | {r.ess:.0f} |"
            )
    (out / "ope.md").write_text("\n".join(lines) + "\n")
    return [out / "ope.json", out / "ope.md", plot(results, out / "ope.png")]


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 1.2 + 0.5 * len(names)), sharey=True)
    for ax, metric in zip(axes, ("reward", "accuracy")):
        for row, name in enumerate(names):
            shown = [e for e in SHOWN if e in results[name][metric]] or list(results[name][metric])
            for k, estimator in enumerate(shown):
                e = results[name][metric][estimator]
                y = row + 0.12 * (k - (len(shown) - 1) / 2)
                ax.errorbar(
                    e.value,
                    y,
                    xerr=[[e.value - e.low], [e.high - e.value]],
                    fmt="o",
                    ms=3,
                    capsize=2,
                    color=f"C{SHOWN.index(estimator) if estimator in SHOWN else 5}",
                    label=estimator if row == 0 or name == "served" else None,
                )
        ax.set_yticks(range(len(names)), [n[-40:] for n in names], fontsize=8)
        ax.set_xlabel(metric)
        ax.grid(axis="x", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[1].legend(unique.values(), unique.keys(), fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
