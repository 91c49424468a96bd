"""``rlens rlae``: train the RLAE agent offline, and generate with the token ensemble."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import typer

from rlens.cli.common import console, fail, needs_extra
from rlens.progress import quiet_transformers
from rlens.progress import progress_bar
from rlens.settings import settings

if TYPE_CHECKING:
    from typing import Literal

    from rlens.rlae.decode import SpanWeightedDecoder, Weights

app = typer.Typer(help="RLAE: token-level ensembles whose weights an RL agent sets span by span.", no_args_is_help=True)
DEFAULT_RLAE_MODELS = "arith-char,count-bpe,order-char,pattern-bpe"  # the zoo's specialists of the RLAE families


def rlae_decoder(zoo: Path | None, models: str, pool: Path | None, top_k: int) -> tuple[list[str], SpanWeightedDecoder]:
    """(model names, decoder): zoo models by name, or a pool file (:func:`rlens.models.pool.build_rlae_decoder`)."""
    from rlens.models.pool import PoolConfigError, build_rlae_decoder, load_pool_config
    from rlens.rlae.decode import TokenEnsemble
    from rlens.zoo.build import load_backend, load_zoo

    quiet_transformers()
    if pool is not None:
        try:
            config = load_pool_config(pool)
        except PoolConfigError as exc:
            fail(str(exc))
        try:
            return [m.name for m in config.models], build_rlae_decoder(config, top_k)
        except PoolConfigError as exc:
            fail(f"{pool}: {exc}")
    try:
        zoo_models = {m.name: m for m in load_zoo(zoo or settings().service.zoo_dir)}
    except FileNotFoundError as exc:
        fail(str(exc))
    names = [n.strip() for n in models.split(",") if n.strip()]
    unknown = [n for n in names if n not in zoo_models]
    if unknown or not names:
        fail(f"unknown zoo model(s) {', '.join(unknown) or '(none given)'}; the zoo has {', '.join(zoo_models)}")
    return names, TokenEnsemble([load_backend(zoo_models[n]) for n in names])


def write_training_plot(curve: list[tuple[int, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e for e, _ in curve], [r for _, r in curve], marker=".")
    ax.set_xlabel("training episodes")
    ax.set_ylabel("mean reward (exact match) per update")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@app.command("train")
def rlae_train(
    out: Path = typer.Option(
        Path("out/rlae"), help="run directory: checkpoints, training.png (an existing run resumes)"
    ),
    variant: str = typer.Option(
        "ppo", help="ppo (one agent, Dirichlet weights) or mappo (one agent per model, centralized critic)"
    ),
    models: str = typer.Option(DEFAULT_RLAE_MODELS, help="comma-separated zoo models"),
    zoo: Path | None = typer.Option(None, help="built zoo directory (default: $RLENS_ZOO_DIR or ~/.cache/rlens/zoo)"),
    pool: Path | None = typer.Option(
        None, help="a pool file instead of zoo models: all `transformers`, or all `openai` servers (top-k)"
    ),
    top_k: int = typer.Option(5, min=1, max=20, help="with a pool of servers: top tokens asked of each per step"),
    tasks: str | None = typer.Option(
        None,
        help="JSON lines of {prompt, reference[, family]}, or 'fewshot' (1000 few-shot tasks for the real LLMs); default: 1000 zoo generation tasks",
    ),
    span: int = typer.Option(4, min=1, help="tokens per span: the agent sets the weights every SPAN tokens"),
    max_tokens: int = typer.Option(16, min=1, help="generated tokens per episode at most"),
    episodes: int = typer.Option(6144, min=1, help="training episodes"),
    observe: str = typer.Option(
        "prompt",
        help="what the agent's MiniLM embeds: 'prompt' (once per generation) or 'text' (prompt + text so far, every span)",
    ),
    seed: int = typer.Option(0, help="seed of the policy, the task order and the sampling"),
) -> None:
    """Train the RLAE agent offline on prompts + references (reward: exact match), with checkpoints after every update."""
    from rlens.rlae.agent import RLAEConfig
    from rlens.rlae.observe import SentenceEncoder
    from rlens.rlae.tasks import TaskFileError, read_tasks
    from rlens.rlae.train import RLAETrainer
    from rlens.zoo.fewshot import FAMILIES as FEWSHOT_FAMILIES, fewshot_split
    from rlens.zoo.tasks import GENERATION_FAMILIES, generation_split

    quiet_transformers()
    needs_extra("eval", "matplotlib")  # the training curve's plot
    if variant not in ("ppo", "mappo"):
        fail(f"--variant must be ppo or mappo, got {variant!r}")
    if observe not in ("prompt", "text"):
        fail(f"--observe must be prompt or text, got {observe!r}")
    try:
        if tasks == "fewshot":
            train_tasks = fewshot_split(list(FEWSHOT_FAMILIES), 1000, seed=100)
        else:
            train_tasks = read_tasks(Path(tasks)) if tasks else generation_split(GENERATION_FAMILIES, 1000, seed=100)
    except TaskFileError as exc:
        fail(str(exc))
    names, decoder = rlae_decoder(zoo, models, pool, top_k)
    cfg = RLAEConfig(
        variant=cast('Literal["ppo", "mappo"]', variant),
        span=span,
        max_tokens=max_tokens,
        episodes=episodes,
        observe=cast('Literal["prompt", "text"]', observe),
    )
    try:
        trainer = RLAETrainer(decoder, SentenceEncoder(), names, cfg, out, seed)
    except ValueError as exc:
        fail(str(exc))
    if trainer.state.episodes:
        console.print(f"resuming {out} at {trainer.state.episodes} episodes")
    console.print(f"RLAE-{variant.upper()} over {', '.join(names)}; span {span}, {len(train_tasks)} training tasks")
    try:
        with progress_bar(console) as bar:
            task = bar.add_task("training", total=episodes)
            state = trainer.run(
                train_tasks,
                lambda n, reward: bar.update(task, advance=n, description=f"training (reward {reward:.2f})"),
            )
    finally:  # the run directory is free again when the command ends, not when the trainer is collected
        trainer.store.close()
    write_training_plot(state.curve, out / "training.png", f"RLAE-{variant.upper()}, span {span}: {', '.join(names)}")
    console.print(
        f"{state.episodes} episodes, {state.updates} updates; last reward {state.curve[-1][1]:.2f}; wrote {out} (training.png)"
    )


@app.command("generate")
def rlae_generate(
    prompts: list[str] = typer.Argument(
        ..., help="prompts to answer (the zoo's form: 'Q: add: 12+7=\\nA:'; \\n is read as a newline)"
    ),
    run: Path | None = typer.Option(None, help="a `rlens rlae train` run directory (its agent sets the weights)"),
    weights: str | None = typer.Option(
        None, help="fixed weights instead of an agent: 'uniform' or comma-separated numbers"
    ),
    models: str = typer.Option(
        DEFAULT_RLAE_MODELS, help="comma-separated zoo models (with --weights; a run knows its own)"
    ),
    zoo: Path | None = typer.Option(None, help="built zoo directory (default: $RLENS_ZOO_DIR or ~/.cache/rlens/zoo)"),
    pool: Path | None = typer.Option(
        None, help="a pool file instead of zoo models: all `transformers`, or all `openai` servers (top-k)"
    ),
    top_k: int = typer.Option(5, min=1, max=20, help="with a pool of servers: top tokens asked of each per step"),
    span: int = typer.Option(4, min=1, help="tokens per span (with --weights; a run knows its own)"),
    max_tokens: int = typer.Option(16, min=1, help="tokens to generate at most"),
) -> None:
    """Generate with the token ensemble: a trained agent's span-wise weights, or fixed weights; prints each span's weights."""
    import numpy as np

    from rlens.rlae.observe import SentenceEncoder
    from rlens.rlae.train import STOP, load_agent

    quiet_transformers()
    if (run is None) == (weights is None):
        fail("give either --run (a trained agent) or --weights (uniform or numbers)")
    texts = [p.replace("\\n", "\n") for p in prompts]
    if run is not None:
        try:
            agent, run_models, _ = load_agent(run, SentenceEncoder())
        except FileNotFoundError as exc:
            fail(str(exc))
        names, decoder = rlae_decoder(zoo, ",".join(run_models), pool, top_k)
        if names != run_models:
            fail(f"the run was trained on {', '.join(run_models)}, the pool has {', '.join(names)}")
        source: Weights = agent.weights_fn(texts, greedy=True)
        span = agent.cfg.span
    else:
        names, decoder = rlae_decoder(zoo, models, pool, top_k)
        try:
            fixed = (
                np.ones(len(names))
                if weights == "uniform"
                else np.array([float(w) for w in (weights or "").split(",")])
            )
        except ValueError:
            fail(f"--weights must be 'uniform' or comma-separated numbers, got {weights!r}")
        if fixed.shape != (len(names),) or (fixed < 0).any() or fixed.sum() <= 0:
            fail(
                f"--weights needs {len(names)} non-negative numbers with a positive sum (one per model: {', '.join(names)})"
            )
        source = fixed
    outputs = decoder.generate_batch(texts, source, max_tokens=max_tokens, span=span, stop=STOP)
    for prompt, out in zip(texts, outputs):
        console.print(f"[bold]{prompt!r}[/] -> {out.text!r} ({out.finish_reason})", highlight=False)
        for k, w in enumerate(out.span_weights):
            console.print(f"  span {k}: " + "  ".join(f"{n} {x:.2f}" for n, x in zip(names, w)), highlight=False)
