"""``rlens serve-model`` (a local model behind an OpenAI-compatible API) and ``rlens pool check``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from rlens.cli.common import console, fail
from rlens.progress import quiet_transformers

pool_app = typer.Typer(help="Pool configurations: the models a worker ensembles.", no_args_is_help=True)


def serve_model(
    path: Path = typer.Argument(..., help="model directory (Hugging Face format, or holding a GGUF file)"),
    port: int = typer.Option(8000, min=1, max=65535, help="TCP port"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on"),
    gguf_file: str | None = typer.Option(None, help="GGUF file inside the directory"),
    name: str | None = typer.Option(None, help="served model name (default: the directory's name)"),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:1, ..."),
) -> None:
    """Serve a local model over an OpenAI-compatible completions API (/v1/completions, /v1/models)."""
    from rlens.backends.base import BackendError
    from rlens.backends.hf import TransformersBackend
    from rlens.models.serve import create_app
    from rlens.service.common.http_server import serve

    quiet_transformers()
    try:
        backend = TransformersBackend.load(path, gguf_file=gguf_file, device=device)
    except (BackendError, OSError, ValueError) as exc:
        fail(f"cannot load {path}: {exc}")
    name = name or path.name
    console.print(f"serving [bold]{name}[/] at http://{host}:{port}/v1")
    serve(create_app(backend, name), host=host, port=port, log_level="warning")


@pool_app.command("check")
def pool_check(config: Path = typer.Argument(..., help="pool configuration (JSON)")) -> None:
    """Build every backend of a pool and ask each a probe question; exit 1 if any fails."""
    import time

    from rlens.backends.base import BackendError
    from rlens.models.pool import PoolConfigError, build_backend, load_pool_config

    quiet_transformers()
    try:
        pool = load_pool_config(config)
    except PoolConfigError as exc:
        fail(str(exc))
    table = Table(title=f"{config}: {len(pool.models)} models")
    for column in ("model", "backend", "cost", "probe", "latency ms"):
        table.add_column(column)
    failed = 0
    for model in pool.models:
        try:
            backend = build_backend(model)
            probe = backend.probe_query()
            loaded = time.perf_counter()
            scores = backend.score_choices(probe)
            status, latency = (
                f"ok: P({probe.choices[0]!r}) = {scores.probabilities()[0]:.2f}",
                f"{1000 * (time.perf_counter() - loaded):.1f}",
            )
        except (BackendError, OSError, ValueError, KeyError) as exc:
            status, latency, failed = f"[red]failed: {exc}[/]", "-", failed + 1
        table.add_row(model.name, model.backend, f"{model.cost:g}", status, latency)
    console.print(table)
    if failed:
        raise typer.Exit(1)
