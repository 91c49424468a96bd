"""The ``rlens`` command line (typer + rich)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rlens.dataset import DatasetError, load_dataset
from rlens.focal.config import FocalConfig
from rlens.protocols import Protocol

app = typer.Typer(help="rlens: LLM ensembles that learn from feedback.", no_args_is_help=True, add_completion=False)
import_app = typer.Typer(help="Build datasets from other tools' outputs.", no_args_is_help=True)
app.add_typer(import_app, name="import")
console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)


def fail(message: str) -> None:
    errors.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(2)


def progress_bar() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)


@app.command()
def replay(
    data: Path = typer.Option(..., "--data", help="dataset directory in the recorded-outputs format"),
    protocol: Protocol = typer.Option(Protocol.paper, help="paper: per task 80% warm start / 20% online test; stream: cold start over the whole stream"),
    seed: int = typer.Option(0, help="random seed (runs are deterministic under a seed)"),
    out: Path = typer.Option(Path("out/replay"), help="directory for results.json, report.md, report.png, per_query.csv"),
    ablations: bool = typer.Option(True, help="also run the RL-Focal ablations (all models, no diversity, kappa)"),
    workers: int = typer.Option(min(2, os.cpu_count() or 1), min=1, help="processes for the RL-Focal variants"),
    alpha: float = typer.Option(FocalConfig.alpha, min=0.0, help="cost weight in the reward"),
    window: int = typer.Option(FocalConfig.window, min=1, help="sliding-window length W per stream"),
    update_period: int = typer.Option(FocalConfig.update_period, min=1, help="online MAPPO update every T answered queries"),
    feedback_delay: int = typer.Option(FocalConfig.feedback_delay, min=0, help="feedback of a query arrives this many queries later"),
) -> None:
    """Replay a recorded dataset through RL-Focal and every baseline; write the report."""
    from rlens.replay import RL_VARIANTS, replay as run_replay, total_steps
    from rlens.report import write_outputs

    try:
        dataset = load_dataset(data)
    except DatasetError as exc:
        fail(str(exc))
    config = replace(FocalConfig(), alpha=alpha, window=window, update_period=update_period, feedback_delay=feedback_delay)
    variants = list(RL_VARIANTS) if ablations else ["rl_focal"]
    console.print(f"[bold]{dataset.name}[/]: {dataset.n_questions} questions, {dataset.n_models} models, {len(dataset.task_names)} tasks; protocol {protocol.value}, seed {seed}")
    try:
        with progress_bar() as bar:
            task = bar.add_task("RL-Focal warm start + online", total=total_steps(dataset, protocol, config, variants))
            run = run_replay(dataset, protocol, seed, config, variants, workers=workers, progress=lambda n: bar.advance(task, n))
    except ValueError as exc:
        fail(str(exc))
    paths = write_outputs(run, out)

    table = Table(title=f"{dataset.name} — {protocol.value} protocol, {run.results.n_test} test questions")
    table.add_column("method")
    table.add_column("accuracy %", justify="right")
    table.add_column("calls / query", justify="right")
    for name, method in sorted(run.results.methods.items(), key=lambda item: -item[1].accuracy):
        style = "bold green" if name == "rl_focal" else None
        table.add_row(name, f"{100 * method.accuracy:.1f}", f"{method.mean_models_called:.2f}", style=style)
    console.print(table)
    console.print("wrote " + ", ".join(str(p) for p in paths))


@import_app.command("lm-eval")
def import_lm_eval(
    model: list[str] = typer.Option(..., "--model", help="NAME=PATH: a samples_*.jsonl file or a directory of them (repeat per model)"),
    out: Path = typer.Option(..., "--out", help="dataset directory to write"),
    cost: list[str] = typer.Option([], "--cost", help="NAME=COST: relative cost of one call of that model (default 1)"),
) -> None:
    """Build a dataset from lm-evaluation-harness --log_samples outputs of several models."""
    from rlens.importers.lm_eval import import_lm_eval as run_import

    def pairs(values: list[str], what: str) -> dict[str, str]:
        parsed = {}
        for value in values:
            name, sep, rest = value.partition("=")
            if not sep or not name or not rest:
                fail(f"--{what} {value!r}: expected NAME=VALUE")
            if name in parsed:
                fail(f"--{what}: {name!r} given twice")
            parsed[name] = rest
        return parsed

    models = {k: Path(v) for k, v in pairs(model, "model").items()}
    costs = {}
    for name, value in pairs(cost, "cost").items():
        try:
            costs[name] = float(value)
        except ValueError:
            fail(f"--cost {name}={value}: not a number")
        if name not in models:
            fail(f"--cost {name}: no --model of that name")
    try:
        summary = run_import(models, out, costs)
        load_dataset(out)  # the written directory must pass the same validation as any dataset
    except DatasetError as exc:
        fail(str(exc))
    console.print(f"wrote {summary.out}: {summary.n_questions} questions x {summary.n_models} models, tasks {', '.join(summary.tasks)}" + (f"; dropped {summary.dropped} questions missing for some model" if summary.dropped else ""))


if __name__ == "__main__":
    app()
