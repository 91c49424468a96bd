"""``rlens import``: datasets from other tools' outputs."""

from __future__ import annotations

from pathlib import Path

import typer

from rlens.cli.common import console, fail
from rlens.records.dataset import load_dataset
from rlens.records.recorded import DatasetError

app = typer.Typer(help="Build datasets from other tools' outputs.", no_args_is_help=True)


@app.command("lm-eval")
def import_lm_eval(
    model: list[str] = typer.Option(
        ..., "--model", help="NAME=PATH: a samples_*.jsonl file or a directory of them (repeat per model)"
    ),
    out: Path = typer.Option(..., "--out", help="dataset directory to write"),
    cost: list[str] = typer.Option([], "--cost", help="NAME=COST: relative cost of one call of that model (default 1)"),
) -> None:
    """Build a dataset from lm-evaluation-harness --log_samples outputs of several models."""
    from rlens.evaluation.importers.lm_eval import import_lm_eval as run_import

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
    console.print(
        f"wrote {summary.out}: {summary.n_questions} questions x {summary.n_models} models, tasks {', '.join(summary.tasks)}"
        + (f"; dropped {summary.dropped} questions missing for some model" if summary.dropped else "")
    )
