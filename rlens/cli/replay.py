"""``rlens replay`` and ``rlens demo``: a recorded dataset through RL-Focal and every baseline, with a report."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import typer
from rich.table import Table

from rlens.cli.common import console, errors, fail, interrupted, needs_extra
from rlens.records.dataset import load_dataset
from rlens.records.recorded import DatasetError
from rlens.evaluation.protocols import Protocol
from rlens.focal.config import FocalConfig
from rlens.progress import progress_bar
from rlens.settings import settings

if TYPE_CHECKING:
    from rlens.evaluation.replay import Numerics
    from rlens.evaluation.results import ReplayResults
    from rlens.focal.schedule import Reaction


def run_replay(
    data: Path,
    protocol: Protocol,
    seed: int,
    out: Path,
    variants: list[str],
    workers: int,
    config: FocalConfig,
    drift=None,
    numerics: Numerics = "portable",
    pretrained: Path | None = None,
    budgets: tuple[float | None, ...] = (),
) -> None:
    """Replay a dataset through RL-Focal and the baselines with a progress bar; print the table, write the report
    and the run's final policy (``policy.safetensors``); with ``budgets``, RL-Focal under each too (the report's
    accuracy against cost)."""
    from rlens.evaluation.replay import DriftOptions, PolicyFiles, replay as run, total_steps
    from rlens.evaluation.report import write_outputs
    from rlens.focal.policy_file import POLICY_FILE, policy_path

    start = None
    if pretrained is not None:
        start = policy_path(pretrained)
        if start is None:
            fail(f"no policy at {pretrained}: pass a {POLICY_FILE} file, or the output folder of an `rlens replay`")
    saving = out / f".{POLICY_FILE}.partial"  # renamed once the outputs are written

    try:
        dataset = load_dataset(data)
    except DatasetError as exc:
        fail(str(exc))
    console.print(
        f"[bold]{dataset.name}[/]: {dataset.n_questions} questions, {dataset.n_models} models, {len(dataset.task_names)} tasks; protocol {protocol.value}, seed {seed}"
    )
    if config.budget is not None:
        _note_a_budget_below_the_floor(config.budget, config.probe_rate, dataset.model_costs)
    try:
        with progress_bar(console) as bar:
            stages = "warm start + online" if protocol == Protocol.paper else "online from a cold start"
            if start is not None:
                stages = f"online from the policy {start}"
            if budgets:
                stages += f", and under the budgets {', '.join('none' if b is None else f'{b:g}' for b in budgets)}"
            steps = total_steps(dataset, protocol, config, variants, pretrained=start is not None, budgets=budgets)
            task = bar.add_task(f"RL-Focal {stages}", total=steps)
            result = run(
                dataset,
                protocol,
                seed,
                config,
                variants,
                workers=workers,
                progress=lambda n: bar.advance(task, n),
                drift=drift or DriftOptions(),
                numerics=numerics,
                policies=PolicyFiles(start, saving),
                budgets=budgets,
            )
    except ValueError as exc:
        saving.unlink(missing_ok=True)
        fail(str(exc))
    except KeyboardInterrupt:
        saving.unlink(missing_ok=True)
        interrupted(f"stopped the replay; nothing written to {out}")
    paths = write_outputs(result, out)
    if saving.is_file():
        paths.append(saving.replace(out / POLICY_FILE))

    _print_results(result.results, dataset.name, protocol, one_stream=bool(drift and drift.one_stream))
    console.print("wrote " + ", ".join(str(p) for p in paths))


def _note_a_budget_below_the_floor(budget: float, probe_rate: float, costs) -> None:
    from rlens.focal.budget import lowest_spending

    floor = lowest_spending(costs / costs.sum(), probe_rate)
    if budget < floor:
        errors.print(
            f"note: --budget {budget:g} is below the least this pool can spend ({floor:.3f}: its cheapest "
            "model alone, and the probes); RL-Focal will spend about that"
        )


def _print_results(results: ReplayResults, name: str, protocol: Protocol, one_stream: bool) -> None:
    """Every method's accuracy and calls, best first, and what drift detection found at the task switches."""
    table = Table(title=f"{name} — {protocol.value} protocol, {results.n_test} test questions")
    table.add_column("method")
    table.add_column("accuracy %", justify="right")
    table.add_column("calls / query", justify="right")
    for method_name, method in sorted(results.methods.items(), key=lambda item: -item[1].accuracy):
        style = "bold green" if method_name == "rl_focal" else None
        table.add_row(method_name, f"{100 * method.accuracy:.1f}", f"{method.mean_models_called:.2f}", style=style)
    console.print(table)
    if results.cost_curve:
        from rlens.evaluation.report import budget_label

        curve = Table(title="RL-Focal's accuracy against cost (report.md, report.png)")
        for column in ("budget", "cost share spent", "calls / query", "accuracy %"):
            curve.add_column(column, justify="right")
        for p in results.cost_curve:
            curve.add_row(
                budget_label(p), f"{p.cost_share:.3f}", f"{p.mean_models_called:.2f}", f"{100 * p.accuracy:.1f}"
            )
        console.print(curve)
    if (found := results.drift) is not None and found.switches:
        console.print(
            f"drift: {len(found.detections)} detections, {found.switches - found.missed_switches} of {found.switches} task switches detected, "
            f"{found.false_alarms_per_1000:.1f} false alarms per 1,000 questions (report.md)"
        )
        if not one_stream:
            console.print(
                "  (each task had its own window, so a switch was known, not drift to detect; --one-stream plays the "
                "stream under one key, as the service does when it is not told the task)"
            )


WORKERS = typer.Option(min(2, os.cpu_count() or 1), min=1, help="processes for the RL-Focal variants")
DEMO_BUDGETS = "none,0.2,0.3"  # beside the default cap of 0.5: the cost weight alone and two tighter caps


def budget_value(option: str) -> float | None:
    """``--budget``: a share of the pool's cost in [0.001, 1], or none."""
    values = () if "," in option else budget_values(option, "--budget", "0.5")
    if len(values) != 1:
        fail(f"--budget: {option!r} is not one share of the pool's cost (e.g. 0.5) or none")
    return values[0]


def budget_values(option: str, name: str = "--budgets", example: str = "0.2,0.3,0.5") -> tuple[float | None, ...]:
    """``--budgets``: comma-separated shares of the pool's cost in [0.001, 1] or ``none`` (the cost weight alone), or
    empty for no other run."""
    values: list[float | None] = []
    for part in (p.strip() for p in option.split(",")):
        if not part:
            continue
        if part.lower() == "none":
            values.append(None)
            continue
        try:
            value = float(part)
        except ValueError:
            fail(f"{name}: {part!r} is not a number (shares of the pool's cost, e.g. {example})")
        if not 0.001 <= value <= 1.0:
            fail(f"{name}: {part} is outside 0.001-1 (a share of the whole pool's cost per query)")
        values.append(value)
    return tuple(dict.fromkeys(values))


ONE_STREAM = typer.Option(
    False,
    "--one-stream",
    help="one window key for the whole stream (the task unknown, as in the service): task switches become drift",
)


def replay(
    data: Path = typer.Option(..., "--data", help="dataset directory in the recorded-outputs format"),
    protocol: Protocol = typer.Option(
        Protocol.paper,
        help="paper: per task 80% warm start / 20% online test; stream: cold start over the whole stream",
    ),
    seed: int = typer.Option(0, help="random seed (runs are deterministic under a seed)"),
    out: Path = typer.Option(
        Path("out/replay"), help="directory for results.json, report.md, report.png, per_query.csv"
    ),
    variants: str = typer.Option(
        "default",
        help="RL-Focal variants to run, comma-separated (rl_focal, rl_focal_all_models, rl_focal_no_diversity, "
        "rl_focal_kappa, rl_focal_paper_decider, rl_focal_marginal, rl_focal_uncalibrated); default: all but "
        "rl_focal_marginal; all",
    ),
    workers: int = WORKERS,
    numerics: str = typer.Option(
        "portable", help="portable: the same figures for a seed on any x86-64 CPU; native: this CPU's fastest kernels"
    ),
    alpha: float = typer.Option(FocalConfig.alpha, min=0.0, help="cost weight in the reward"),
    budget: str = typer.Option(
        "none" if FocalConfig.budget is None else f"{FocalConfig.budget:g}",
        help="the mean share of the whole pool's cost to spend per query, met online; none: alpha alone decides",
    ),
    budget_cap: bool = typer.Option(
        FocalConfig.budget_cap,
        "--budget-cap/--budget-mean",
        help="the budget as a cap (spending under it is left to alpha) or met on average (spending under it is pushed "
        "up too)",
    ),
    budgets: str = typer.Option(
        "",
        help="also run RL-Focal under each of these budgets (comma-separated shares of the pool's cost, e.g. "
        "none,0.2,0.3; none: the cost weight alone): its accuracy against cost, beside the stackers, in the report",
    ),
    window: int = typer.Option(FocalConfig.window, min=1, help="sliding-window length W per stream"),
    joint_rows: int = typer.Option(
        FocalConfig.joint_rows,
        min=0,
        help="a stream's last labelled queries kept whole, from which its most served pools get a joint fit over "
        "their members' log-probabilities that replaces their vote where it predicts better (0: the vote alone; in "
        "the service RLENS_FOCAL_JOINT_ROWS)",
    ),
    update_period: int = typer.Option(
        FocalConfig.update_period, min=1, help="online MAPPO update every T explored queries"
    ),
    explore_rate: float = typer.Option(
        FocalConfig.explore_rate,
        min=0.0,
        max=1.0,
        help="online: share of queries on which both agents sample (and learn)",
    ),
    feedback_delay: int = typer.Option(
        FocalConfig.feedback_delay, min=0, help="feedback of a query arrives this many queries later"
    ),
    first_probes: int = typer.Option(
        FocalConfig.first_probes,
        min=0,
        help="a stream's first queries that call every model too (while its budget is not overspent; 0: none; in the "
        "service RLENS_FOCAL_FIRST_PROBES)",
    ),
    one_stream: bool = ONE_STREAM,
    drift_reaction: str = typer.Option(
        "none", help="on a drift detection: none, trim (the window keeps its last 5 outcomes) or reset"
    ),
    pretrained: Path | None = typer.Option(
        None,
        help="start from this trained policy instead of the warm start: an earlier replay's output folder (its "
        "policy.safetensors) on other tasks of the same models",
    ),
) -> None:
    """Replay a recorded dataset through RL-Focal and every baseline; write the report (with drift detections)."""
    needs_extra("eval", "matplotlib", "sklearn")
    from rlens.evaluation.replay import DriftOptions

    if drift_reaction not in ("none", "trim", "reset"):
        fail(f"--drift-reaction must be none, trim or reset, got {drift_reaction!r}")
    if numerics not in ("portable", "native"):
        fail(f"--numerics must be portable or native, got {numerics!r}")
    config = replace(
        FocalConfig(),
        alpha=alpha,
        budget=budget_value(budget),
        budget_cap=budget_cap,
        window=window,
        joint_rows=joint_rows,
        update_period=update_period,
        explore_rate=explore_rate,
        feedback_delay=feedback_delay,
        first_probes=first_probes,
    )
    drift = DriftOptions(one_stream, cast("Reaction", drift_reaction))
    run_replay(
        data,
        protocol,
        seed,
        out,
        variant_names(variants),
        workers,
        config,
        drift,
        cast("Numerics", numerics),
        pretrained,
        budget_values(budgets),
    )


def variant_names(option: str) -> list[str]:
    """``--variants``: "default", "all" or a comma-separated list of known RL-Focal variants."""
    from rlens.evaluation.replay import DEFAULT_VARIANTS, RL_VARIANTS

    if option.strip() == "all":
        return list(RL_VARIANTS)
    if option.strip() == "default":
        return list(DEFAULT_VARIANTS)
    names = [name.strip() for name in option.split(",") if name.strip()]
    unknown = [name for name in names if name not in RL_VARIANTS]
    if unknown or not names:
        fail(f"--variants: unknown {unknown or 'empty list'}; known: {', '.join(RL_VARIANTS)} (or default, or all)")
    return names


def demo(
    out: Path = typer.Option(Path("out/demo"), help="directory for results.json, report.md, report.png, per_query.csv"),
    protocol: Protocol = typer.Option(
        Protocol.stream,
        help="stream: cold start, learning online over the whole stream; paper: per task 80% warm start / 20% test",
    ),
    seed: int = typer.Option(0, help="random seed"),
    workers: int = WORKERS,
    one_stream: bool = ONE_STREAM,
    budgets: str = typer.Option(
        DEMO_BUDGETS,
        help="RL-Focal also under each of these budgets (shares of the pool's cost; none: the cost weight alone), for "
        "its accuracy against cost beside the stackers; empty: no other run",
    ),
) -> None:
    """Replay the bundled zoo stream (5 real small models, 5 task families in blocks) through RL-Focal; no network."""
    needs_extra("eval", "matplotlib", "sklearn")
    from rlens.evaluation.replay import DEFAULT_VARIANTS, DriftOptions

    run_replay(
        settings().service.demo_data,
        protocol,
        seed,
        out,
        list(DEFAULT_VARIANTS),
        workers,
        FocalConfig(),
        DriftOptions(one_stream),
        budgets=budget_values(budgets),
    )
