"""``rlens zoo``: build the zoo of small real models and record streams from it."""

from __future__ import annotations

from pathlib import Path

import typer

from rlens.cli.common import console, fail
from rlens.progress import quiet_transformers
from rlens.progress import progress_bar
from rlens.settings import settings

app = typer.Typer(help="The model zoo: small real models, and the streams recorded from them.", no_args_is_help=True)


@app.command("build")
def zoo_build(
    out: Path | None = typer.Option(None, help="zoo directory (default: $RLENS_ZOO_DIR or ~/.cache/rlens/zoo)"),
    threads: int = typer.Option(
        2,
        min=1,
        max=64,
        help="torch threads for training; the weights depend on it in the last digits, so keep it to rebuild "
        "the same zoo (1 is as fast on a busy 2-core machine, at two thirds of the CPU)",
    ),
) -> None:
    """Train the zoo's specialists (seeded, a few minutes on CPU), add SmolLM2 and Gemma 3, write the manifest."""
    build_zoo_here(out or settings().service.zoo_dir, threads)


def build_zoo_here(out: Path, threads: int = 2) -> None:
    """Build the zoo into ``out`` with a progress bar, then list its models (`rlens zoo build`, and `rlens up`'s
    first run)."""
    from rlens.zoo.build import SPECIALISTS, build_zoo

    quiet_transformers()
    try:
        with progress_bar(console) as bar:
            task = bar.add_task(f"training {len(SPECIALISTS)} specialists", total=sum(s.steps for s in SPECIALISTS))
            models = build_zoo(out, progress=lambda n: bar.advance(task, n), threads=threads)
    except FileNotFoundError as exc:
        fail(str(exc))
    for model in models:
        console.print(f"  {model.name:14s} {model.tokenizer:8s} {model.parameters / 1e6:8.2f} M params  {model.path}")
    console.print(f"wrote {out}")


@app.command("record")
def zoo_record(
    zoo: Path | None = typer.Option(None, help="built zoo directory (default: $RLENS_ZOO_DIR or ~/.cache/rlens/zoo)"),
    out: Path = typer.Option(Path("out/zoo_mc"), help="dataset directory to write"),
    blocks: int = typer.Option(10, min=1, help="task blocks in the stream (the task switches at each block)"),
    block_size: int = typer.Option(120, min=1, help="questions per block"),
    seed: int = typer.Option(0, help="seed of the question stream"),
    families: str | None = typer.Option(
        None,
        help="comma-separated task families the blocks cycle through (default: every family; one family and "
        "--blocks 1: a long single-task stream)",
    ),
    models: str | None = typer.Option(None, help="comma-separated zoo models (default: every model of the zoo)"),
    samples: int = typer.Option(
        0,
        min=0,
        max=64,
        help="open-ended instead: each model samples this many texts per task of the zoo's generation "
        "stream (families arithmetic, counting, ordering, pattern), saved as a samples directory",
    ),
    temperature: float = typer.Option(1.0, min=0.01, help="open-ended: the sampling temperature"),
) -> None:
    """Ask every zoo model every question of a generated stream (multiple choice, or open-ended with --samples);
    save it as a dataset that `rlens replay` reads."""
    from rlens.evaluation.baselines import model_predictions
    from rlens.zoo.build import load_zoo
    from rlens.zoo.record import record_samples, record_stream
    from rlens.zoo.tasks import FAMILIES, GENERATION_FAMILIES, generation_stream

    quiet_transformers()
    try:
        zoo_models = load_zoo(zoo or settings().service.zoo_dir)
    except FileNotFoundError as exc:
        fail(str(exc))
    names = [n.strip() for n in (models or "").split(",") if n.strip()] or [m.name for m in zoo_models]
    unknown = [n for n in names if n not in {m.name for m in zoo_models}]
    if unknown:
        fail(f"unknown zoo model(s) {', '.join(unknown)}; the zoo has {', '.join(m.name for m in zoo_models)}")
    chosen = [m for m in zoo_models if m.name in names]
    family_names = [f.strip() for f in (families or "").split(",") if f.strip()] or None
    allowed = GENERATION_FAMILIES if samples else list(FAMILIES)
    if family_names and set(family_names) - set(allowed):
        fail(
            f"unknown task famil(ies) {', '.join(sorted(set(family_names) - set(allowed)))}; known: {', '.join(allowed)}"
        )
    with progress_bar(console) as bar:
        task = bar.add_task("sampling" if samples else "scoring", total=blocks * block_size * len(chosen))
        advance = lambda n: bar.advance(task, n)  # noqa: E731
        if samples:
            dataset = record_samples(
                chosen,
                generation_stream(family_names or GENERATION_FAMILIES, blocks, block_size, seed),
                out,
                samples,
                temperature,
                seed=seed,
                progress=advance,
            )
        else:
            dataset = record_stream(chosen, out, blocks, block_size, seed, family_names, progress=advance)
    accuracy = (model_predictions(dataset) == dataset.labels[:, None]).mean(0)
    for name, acc in zip(dataset.model_names, accuracy):
        console.print(f"  {name:14s} accuracy {100 * acc:5.1f} %" + (" (its most frequent answer)" if samples else ""))
    console.print(
        f"wrote {out}: {dataset.n_questions} {'tasks' if samples else 'questions'} x {dataset.n_models} models"
    )
