"""Writes a replay's outputs: results.json, report.md, report.png and per_query.csv."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from rlens.drift import task_blocks  # noqa: E402
from rlens.evaluation.replay import ReplayRun  # noqa: E402
from rlens.evaluation.results import CostPoint, MethodResult  # noqa: E402

PLOTTED = ("rl_focal", "best_single", "best_single_per_task", "soft_vote", "stacking", "hedge")
ROLLING = 50


def _rolling(values: np.ndarray, width: int) -> np.ndarray:
    cumulative = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - width)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def _task_blocks(task: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, task id) of each contiguous block of the stream."""
    return [(start, end, int(task[start])) for start, end in task_blocks(task)]


def short_labels(names: list[str], width: int = 20) -> list[str]:
    """Each name cut to ``width`` characters, still telling the names apart: a long one keeps its start, then "…",
    then as much of its end as tells it from every other name with that start (an end that starts a word first)."""

    def label(name: str) -> str:
        if len(name) <= width:
            return name
        words = [t for t in range(width - 1) if t == 0 or name[len(name) - t - 1] in "_-. "]
        for tail in words + list(range(width - 1)):
            head, end = name[: width - 1 - tail], name[len(name) - tail :]
            if not any(o != name and o.startswith(head) and o.endswith(end) for o in names):
                return f"{head}…{end}"
        return name[: width - 1] + "…"

    return [label(name) for name in names]


def shared_labels(
    points: list[tuple[str, float, float]], near: float, near_x: float = 0.3
) -> list[tuple[float, float, list[str]]]:
    """One label per group of (name, x, y) points, in their order: a point within ``near_x`` in x and ``near`` in y
    of a label's point joins that label's names; the label stays at its first point."""
    labels: list[tuple[float, float, list[str]]] = []
    for name, x, y in points:
        shared = next((label for label in labels if abs(label[0] - x) < near_x and abs(label[1] - y) < near), None)
        if shared is None:
            labels.append((x, y, [name]))
        else:
            shared[2].append(name)
    return labels


def _accuracy_against_cost(axis, run: ReplayRun) -> None:
    """Every method's accuracy against the share of the pool's cost it spent per query: RL-Focal's variants in black, the stacker
    and the other ensembles of every model in colour, each model alone in grey (the oracle, an upper bound, left
    out); points that nearly coincide share one label, best first. With a cost curve, RL-Focal under each budget
    (dashed, each point's budget beneath it)."""
    methods = {name: m for name, m in run.results.methods.items() if name != "oracle"}
    singles = [m for name, m in methods.items() if name.startswith("single:")]

    def cost(m: MethodResult) -> float:
        return m.cost_share or 0.0  # set for every method of a replay

    axis.scatter(
        [cost(m) for m in singles],
        [100 * m.accuracy for m in singles],
        color="silver",
        s=18,
        label="each model alone",
    )
    shown = sorted(
        ((name, m) for name, m in methods.items() if not name.startswith("single:")),
        key=lambda item: -item[1].accuracy,
    )
    accuracies = [100 * m.accuracy for m in methods.values()]
    near = max(max(accuracies) - min(accuracies), 10.0) / 30  # points closer than this share one label
    for name, method in shown:
        ours = name.startswith("rl_focal")
        x, y = cost(method), 100 * method.accuracy
        axis.scatter(
            x,
            y,
            color="black" if ours else ("tab:blue" if "stacking" in name else "tab:orange"),
            marker="o" if ours else "s",
            s=36 if name in ("rl_focal", "stacking") else 20,
            zorder=3,
        )
    points = [
        (
            name.removeprefix("rl_focal_") if name.startswith("rl_focal_") else name,
            cost(m),
            100 * m.accuracy,
        )
        for name, m in shown
    ]
    for x, y, names in shared_labels(points, near, near_x=0.03):
        right = x > 0.6  # labels of the costly points go to their left
        axis.annotate(
            ", ".join(names),
            (x, y),
            xytext=(-5 if right else 5, 0),
            textcoords="offset points",
            fontsize=7,
            va="center",
            ha="right" if right else "left",
            fontweight="bold" if {"rl_focal", "stacking"} & set(names) else "normal",
        )
    curve = sorted((p for p in run.results.cost_curve or [] if p.budget is not None), key=lambda p: p.cost_share)
    if curve:
        axis.plot(
            [p.cost_share for p in curve],
            [100 * p.accuracy for p in curve],
            color="black",
            linestyle="--",
            linewidth=1,
            marker="D",
            markersize=4,
            label="rl_focal under each budget",
        )
        for p in curve:
            axis.annotate(
                f"{p.budget:g}",
                (p.cost_share, 100 * p.accuracy),
                xytext=(0, -10),
                textcoords="offset points",
                fontsize=6,
            )
    axis.set_xlim(0, 1.05)
    axis.set_xlabel("share of the whole pool's cost per query (mean)")
    axis.set_ylabel("accuracy (%)")
    axis.set_title("accuracy against cost (black: RL-Focal's variants)", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right", fontsize=7, frameon=False)


def write_plot(run: ReplayRun, path: Path) -> None:
    test, results = run.test, run.results
    fig = plt.figure(figsize=(16, 7))
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 1.3], width_ratios=[3, 1.25])
    top = fig.add_subplot(grid[0, 0])
    bottom = fig.add_subplot(grid[1, 0], sharex=top)
    top.tick_params(labelbottom=False)
    _accuracy_against_cost(fig.add_subplot(grid[:, 1]), run)
    x = np.arange(results.n_test)
    for name in PLOTTED:
        if name in run.answers:
            correct = (run.answers[name] == test.labels).astype(float)
            style = {"linewidth": 2.2, "color": "black"} if name == "rl_focal" else {"linewidth": 1.1, "alpha": 0.85}
            top.plot(
                x,
                100 * _rolling(correct, ROLLING),
                label=f"{name} ({100 * results.methods[name].accuracy:.1f}%)",
                **style,
            )
    for axis in (top, bottom):
        for start, _, _ in _task_blocks(test.task)[1:]:
            axis.axvline(start, color="grey", linestyle=":", linewidth=0.8)
    blocks = _task_blocks(test.task)
    labels = dict(zip((b[2] for b in blocks), short_labels([test.task_name(b[2]) for b in blocks])))
    for start, end, task_id in blocks:
        top.text(
            (start + end) / 2,
            1.5,
            labels[task_id],
            rotation=90,
            fontsize=7,
            ha="center",
            va="bottom",
            color="dimgrey",
        )
    drift = results.drift
    if drift is not None and drift.detections:
        top.plot(
            drift.detections,
            [4] * len(drift.detections),
            "v",
            color="tab:red",
            markersize=7,
            label=f"drift detected ({len(drift.detections)}; {'one stream key' if drift.one_stream else 'a key per task'})",
        )
    top.set_ylabel(f"rolling accuracy (%, last {ROLLING})")
    top.set_ylim(0, 100)
    # legends above their axes, never over the curves
    top.legend(loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=8, ncol=4, frameon=False)
    fig.suptitle(
        f"{results.dataset}: protocol {results.protocol}, seed {results.seed}, {results.n_test} test questions (dotted: task switches)"
    )
    bottom.plot(
        x, _rolling(run.models_called.astype(float), ROLLING), color="tab:red", label="models called (incl. probes)"
    )
    bottom.plot(x, _rolling(run.pool_size.astype(float), ROLLING), color="black", label="RL-Focal pool size")
    bottom.set_ylim(0, len(results.models) + 0.5)
    bottom.set_ylabel("models")
    bottom.set_xlabel("test question (stream order)")
    bottom.legend(loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=8, ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(run: ReplayRun) -> str:
    results = run.results
    ranked = sorted(results.methods.items(), key=lambda item: -item[1].accuracy)
    lines = [
        f"# Replay of `{results.dataset}` — protocol `{results.protocol}`, seed {results.seed}",
        "",
        f"{results.n_test} test questions, {len(results.models)} models, {results.elapsed_s:.1f} s.",
        "",
        "| method | accuracy % | models called / query | description |",
        "|---|---:|---:|---|",
    ]
    lines += [
        f"| {name} | {100 * m.accuracy:.1f} | {m.mean_models_called:.2f} | {m.description} |" for name, m in ranked
    ]
    tasks = list(results.methods["rl_focal"].per_task) if "rl_focal" in results.methods else list(ranked[0][1].per_task)
    shown = [
        name
        for name in ("rl_focal", "best_single", "best_single_per_task", "soft_vote", "stacking", "oracle")
        if name in results.methods
    ]
    lines += [
        "",
        "## Per task (accuracy %)",
        "",
        "| task | " + " | ".join(shown) + " |",
        "|---|" + "---:|" * len(shown),
    ]
    for task in tasks:
        lines.append(
            f"| {task} | " + " | ".join(f"{100 * results.methods[n].per_task[task]:.1f}" for n in shown) + " |"
        )
    if (drift := results.drift) is not None:
        keys = (
            "one window key for the whole stream (task switches are drift inside it)"
            if drift.one_stream
            else "a window key per task"
        )
        median = lambda values: f"{statistics.median(values):g}" if values else "–"  # noqa: E731
        lines += [
            "",
            "## Drift (RL-Focal, the learner's detector on its outcomes)",
            "",
            f"{keys}; detector {drift.detector}, reaction `{drift.reaction}`.",
            "",
            "| detections | switches detected | median delay | false alarms / 1,000 | median recovery |",
            "|---:|---:|---:|---:|---:|",
            f"| {len(drift.detections)} | {drift.switches - drift.missed_switches} of {drift.switches} | {median(drift.delays)} | "
            f"{drift.false_alarms_per_1000:.1f} | {median(drift.recovery)} |",
            "",
            "Delay: questions from a switch to its first detection. Recovery: questions from a switch until the rolling accuracy over",
            "the last 20 answers is within 2 points of the block's second half. Detections are the red marks on the plot.",
        ]
    lines += _cost_lines(run)
    lines += ["", "![rolling accuracy and pool size](report.png)", ""]
    return "\n".join(lines)


def budget_label(point: CostPoint) -> str:
    """A cost curve point's budget as the report and the terminal show it."""
    if point.budget is None:
        return "none (the cost weight alone)"
    return f"{point.budget:g} (a cap)" if point.cap else f"{point.budget:g}"


def _cost_lines(run: ReplayRun) -> list[str]:
    """report.md's accuracy against cost: RL-Focal as run and under each budget, beside the stackers."""
    results = run.results
    if not results.cost_curve:
        return []
    lines = [
        "",
        "## Accuracy against cost (RL-Focal under each budget)",
        "",
        "| budget | share of the pool's cost spent | models called / query | accuracy % |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {budget_label(p)} | {p.cost_share:.3f} | {p.mean_models_called:.2f} | {100 * p.accuracy:.1f} |"
        for p in results.cost_curve
    ]
    references = [name for name in ("stacking", "online_stacking", "soft_vote") if name in results.methods]
    if references:
        lines += [
            "",
            "Every model, each query: "
            + ", ".join(f"{name} {100 * results.methods[name].accuracy:.1f} %" for name in references)
            + " (share 1.0).",
        ]
    return lines


def write_per_query(run: ReplayRun, path: Path) -> None:
    names = list(run.answers)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["position", "task", "label", "rl_focal_pool_size", "rl_focal_models_called", *names])
        for i in range(run.results.n_test):
            task = run.test.task_name(run.test.task[i])
            writer.writerow(
                [
                    i,
                    task,
                    int(run.test.labels[i]),
                    int(run.pool_size[i]),
                    int(run.models_called[i]),
                    *(int(run.answers[n][i]) for n in names),
                ]
            )


def write_outputs(run: ReplayRun, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md", out / "report.png", out / "per_query.csv"]
    paths[0].write_text(run.results.model_dump_json(indent=2) + "\n")
    paths[1].write_text(markdown(run))
    write_plot(run, paths[2])
    write_per_query(run, paths[3])
    return paths
