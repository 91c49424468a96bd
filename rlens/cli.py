"""The ``rlens`` command line (typer + rich)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, cast

import typer
from rich.console import Console
from rich.table import Table

from rlens.evaluation.dataset import DatasetError, load_dataset
from rlens.focal.config import FocalConfig
from rlens.progress import LineProgress, progress_bar
from rlens.evaluation.protocols import Protocol
from rlens.settings import settings

if TYPE_CHECKING:  # the commands import what they run lazily (a quick `rlens --help`)
    from typing import Literal

    from rlens.evaluation.replay import Numerics
    from rlens.focal.schedule import Reaction
    from rlens.rlae.decode import SpanWeightedDecoder, Weights

app = typer.Typer(help="rlens: LLM ensembles that learn from feedback.", no_args_is_help=True, add_completion=False)
import_app = typer.Typer(help="Build datasets from other tools' outputs.", no_args_is_help=True)
app.add_typer(import_app, name="import")
pool_app = typer.Typer(help="Pool configurations: the models a worker ensembles.", no_args_is_help=True)
app.add_typer(pool_app, name="pool")
zoo_app = typer.Typer(
    help="The model zoo: small real models, and the streams recorded from them.", no_args_is_help=True
)
app.add_typer(zoo_app, name="zoo")
keys_app = typer.Typer(
    help="The gateway's API keys (stored hashed; each bound to a tenant, its streams and a rate).", no_args_is_help=True
)
app.add_typer(keys_app, name="keys")
rlae_app = typer.Typer(
    help="RLAE: token-level ensembles whose weights an RL agent sets span by span.", no_args_is_help=True
)
app.add_typer(rlae_app, name="rlae")
PIPED_WIDTH = 160  # rich's 80 columns for a pipe or a log file cut the wider tables' headers (rlens load's 9 columns)
console = Console(soft_wrap=True, width=None if os.isatty(1) else PIPED_WIDTH)
errors = Console(stderr=True, soft_wrap=True)


DEFAULT_WORKDIR = Path("out/up")  # `rlens up`'s work folder, where `rlens load` looks for the stack by default
DEFAULT_RLAE_MODELS = "arith-char,count-bpe,order-char,pattern-bpe"  # the zoo's specialists of the RLAE families


def fail(message: str) -> NoReturn:
    errors.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(2)


def interrupted(what: str) -> NoReturn:
    """Ctrl-C: one line and the shell's exit code for SIGINT (130), no traceback."""
    errors.print(f"interrupted: {what}", highlight=False)
    raise typer.Exit(130)


def quiet_transformers() -> None:
    """No transformers progress bars or advisory warnings on the terminal; rlens shows its own progress."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the service runs without the model extras (the `hf` extra)
        return

    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's own tqdm bar
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


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
) -> None:
    """Replay a dataset through RL-Focal and the baselines with a progress bar; print the table, write the report."""
    from rlens.evaluation.replay import DriftOptions, replay as run, total_steps
    from rlens.evaluation.report import write_outputs

    try:
        dataset = load_dataset(data)
    except DatasetError as exc:
        fail(str(exc))
    console.print(
        f"[bold]{dataset.name}[/]: {dataset.n_questions} questions, {dataset.n_models} models, {len(dataset.task_names)} tasks; protocol {protocol.value}, seed {seed}"
    )
    try:
        with progress_bar(console) as bar:
            stages = "warm start + online" if protocol == Protocol.paper else "online from a cold start"
            task = bar.add_task(f"RL-Focal {stages}", total=total_steps(dataset, protocol, config, variants))
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
            )
    except ValueError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        interrupted(f"stopped the replay; nothing written to {out}")
    paths = write_outputs(result, out)

    table = Table(title=f"{dataset.name} — {protocol.value} protocol, {result.results.n_test} test questions")
    table.add_column("method")
    table.add_column("accuracy %", justify="right")
    table.add_column("calls / query", justify="right")
    for name, method in sorted(result.results.methods.items(), key=lambda item: -item[1].accuracy):
        style = "bold green" if name == "rl_focal" else None
        table.add_row(name, f"{100 * method.accuracy:.1f}", f"{method.mean_models_called:.2f}", style=style)
    console.print(table)
    if (found := result.results.drift) is not None and found.switches:
        console.print(
            f"drift: {len(found.detections)} detections, {found.switches - found.missed_switches} of {found.switches} task switches detected, "
            f"{found.false_alarms_per_1000:.1f} false alarms per 1,000 questions (report.md)"
        )
        if not (drift and drift.one_stream):
            console.print(
                "  (each task had its own window, so a switch was known, not drift to detect; --one-stream plays the "
                "stream under one key, as the service does when it is not told the task)"
            )
    console.print("wrote " + ", ".join(str(p) for p in paths))


WORKERS = typer.Option(min(2, os.cpu_count() or 1), min=1, help="processes for the RL-Focal variants")
ONE_STREAM = typer.Option(
    False,
    "--one-stream",
    help="one window key for the whole stream (the task unknown, as in the service): task switches become drift",
)


@app.command()
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
        "rl_focal_kappa, rl_focal_paper_decider, rl_focal_marginal); default: all but rl_focal_marginal; all",
    ),
    workers: int = WORKERS,
    numerics: str = typer.Option(
        "portable", help="portable: the same figures for a seed on any x86-64 CPU; native: this CPU's fastest kernels"
    ),
    alpha: float = typer.Option(FocalConfig.alpha, min=0.0, help="cost weight in the reward"),
    window: int = typer.Option(FocalConfig.window, min=1, help="sliding-window length W per stream"),
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
    one_stream: bool = ONE_STREAM,
    drift_reaction: str = typer.Option(
        "none", help="on a drift detection: none, trim (the window keeps its last 5 outcomes) or reset"
    ),
) -> None:
    """Replay a recorded dataset through RL-Focal and every baseline; write the report (with drift detections)."""
    from rlens.evaluation.replay import DriftOptions

    if drift_reaction not in ("none", "trim", "reset"):
        fail(f"--drift-reaction must be none, trim or reset, got {drift_reaction!r}")
    if numerics not in ("portable", "native"):
        fail(f"--numerics must be portable or native, got {numerics!r}")
    config = replace(
        FocalConfig(),
        alpha=alpha,
        window=window,
        update_period=update_period,
        explore_rate=explore_rate,
        feedback_delay=feedback_delay,
    )
    drift = DriftOptions(one_stream, cast("Reaction", drift_reaction))
    run_replay(data, protocol, seed, out, variant_names(variants), workers, config, drift, cast("Numerics", numerics))


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


@app.command()
def demo(
    out: Path = typer.Option(Path("out/demo"), help="directory for results.json, report.md, report.png, per_query.csv"),
    protocol: Protocol = typer.Option(
        Protocol.stream,
        help="stream: cold start, learning online over the whole stream; paper: per task 80% warm start / 20% test",
    ),
    seed: int = typer.Option(0, help="random seed"),
    workers: int = WORKERS,
    one_stream: bool = ONE_STREAM,
) -> None:
    """Replay the bundled zoo stream (5 real small models, 5 task families in blocks) through RL-Focal; no network."""
    from rlens.evaluation.replay import DEFAULT_VARIANTS, DriftOptions

    run_replay(
        settings().demo_data,
        protocol,
        seed,
        out,
        list(DEFAULT_VARIANTS),
        workers,
        FocalConfig(),
        DriftOptions(one_stream),
    )


@app.command("serve-model")
def serve_model(
    path: Path = typer.Argument(..., help="model directory (Hugging Face format, or holding a GGUF file)"),
    port: int = typer.Option(8000, min=1, max=65535, help="TCP port"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on"),
    gguf_file: str | None = typer.Option(None, help="GGUF file inside the directory"),
    name: str | None = typer.Option(None, help="served model name (default: the directory's name)"),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:1, ..."),
) -> None:
    """Serve a local model over an OpenAI-compatible completions API (/v1/completions, /v1/models)."""
    import uvicorn

    from rlens.backends.base import BackendError
    from rlens.backends.hf import TransformersBackend
    from rlens.models.serve import create_app

    quiet_transformers()
    try:
        backend = TransformersBackend.load(path, gguf_file=gguf_file, device=device)
    except (BackendError, OSError, ValueError) as exc:
        fail(f"cannot load {path}: {exc}")
    name = name or path.name
    console.print(f"serving [bold]{name}[/] at http://{host}:{port}/v1")
    uvicorn.run(create_app(backend, name), host=host, port=port, log_level="warning")


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


def service_settings(pool: Path | None):
    """The settings, with ``--pool`` (if given) as the pool file."""
    return settings().model_copy(update={"pool_file": pool}) if pool else settings()


POOL = typer.Option(None, "--pool", help="pool file (default: $RLENS_POOL_FILE)")


@app.command()
def worker(pool: Path | None = POOL) -> None:
    """Run an ensemble worker: queries from Kafka, answers and experience to Kafka (stops cleanly on SIGTERM)."""
    from rlens.models.pool import PoolConfigError
    from rlens.service.run import run_worker

    quiet_transformers()
    try:
        run_worker(service_settings(pool))
    except (PoolConfigError, ValueError) as exc:
        fail(str(exc))


@app.command()
def learner(
    pool: Path | None = POOL,
    warm_start: Path | None = typer.Option(
        None,
        help="when there is no checkpoint yet, start from: a recorded dataset (rl_focal), an `rlens rlae train` run (rlae)",
    ),
) -> None:
    """Run the learner: joins experience with feedback, updates windows and policy, checkpoints, publishes."""
    from rlens.models.pool import PoolConfigError
    from rlens.service.run import run_learner

    try:
        run_learner(service_settings(pool), warm_start)
    except (
        PoolConfigError,
        DatasetError,
        ValueError,
        RuntimeError,
    ) as exc:  # RuntimeError: its directory or group is taken
        fail(str(exc))


@app.command()
def gateway(
    port: int | None = typer.Option(None, help="port (default: $RLENS_GATEWAY_PORT, 8000)"),
    keys: Path | None = typer.Option(
        None, "--keys", help="API keys file (default: $RLENS_GATEWAY_KEYS_FILE, rlens-keys.json)"
    ),
) -> None:
    """Run the OpenAI-compatible gateway: /v1/chat/completions, /v1/completions, /v1/models, /v1/feedback,
    /v1/answers/{id} in front of the Kafka service (stops cleanly on SIGTERM)."""
    from rlens.service.gateway.api_keys import KeysError
    from rlens.service.gateway.app import run_gateway
    from rlens.service.common.kafka import BrokerRefused
    from rlens.service.common.security import SecretsError

    s = settings()
    s = s.model_copy(
        update={k: v for k, v in {"gateway_port": port, "gateway_keys_file": keys}.items() if v is not None}
    )
    try:
        run_gateway(s)
    except (KeysError, SecretsError, BrokerRefused) as exc:
        fail(str(exc))


KEYS_FILE = typer.Option(None, "--file", help="keys file (default: $RLENS_GATEWAY_KEYS_FILE, rlens-keys.json)")


def keys_file(path: Path | None) -> Path:
    path = path or settings().gateway_keys_file
    if path is None:
        fail("no keys file: pass --file or set RLENS_GATEWAY_KEYS_FILE")
    return path


@keys_app.command("add")
def keys_add(
    tenant: str = typer.Option(..., help="who owns the key's queries (no other tenant can read or rate them)"),
    streams: str = typer.Option(
        "*", help="stream keys the key may use, comma-separated fnmatch patterns (support-*,billing)"
    ),
    rate: float = typer.Option(20.0, min=0.001, help="sustained requests per second"),
    burst: int = typer.Option(40, min=1, help="requests at once above the sustained rate"),
    file: Path | None = KEYS_FILE,
) -> None:
    """Make an API key: prints it once (only its hash is stored)."""
    from rlens.service.gateway.api_keys import KeysError, add_key

    path = keys_file(file)
    try:
        key, record = add_key(path, tenant, [p.strip() for p in streams.split(",") if p.strip()], rate, burst)
    except (KeysError, ValueError) as exc:
        fail(str(exc))
    errors.print(
        f"key {record.id} for tenant {tenant!r} (streams {', '.join(record.streams)}; {rate:g}/s, bursts of {burst}) added to {path}; it is shown once:"
    )
    print(key)


@keys_app.command("list")
def keys_list(file: Path | None = KEYS_FILE) -> None:
    """The keys in the file (ids, tenants, streams, rates; never the keys)."""
    import datetime

    from rlens.service.gateway.api_keys import KeysError, read_records

    path = keys_file(file)
    try:
        records = read_records(path)
    except KeysError as exc:
        fail(str(exc))
    table = Table(title=str(path))
    for column in ("id", "tenant", "streams", "rate/s", "burst", "created", "state"):
        table.add_column(column)
    for r in records:
        created = datetime.datetime.fromtimestamp(r.created_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
        table.add_row(
            r.id,
            r.tenant,
            ",".join(r.streams),
            f"{r.rate_per_s:g}",
            str(r.burst),
            created,
            "revoked" if r.revoked else "active",
        )
    console.print(table)


@keys_app.command("revoke")
def keys_revoke(
    key_id: str = typer.Argument(..., help="the key's id (`rlens keys list`)"), file: Path | None = KEYS_FILE
) -> None:
    """Revoke a key: running gateways refuse it within a second (they re-read the file when it changes)."""
    from rlens.service.gateway.api_keys import KeysError, revoke_key

    path = keys_file(file)
    try:
        record = revoke_key(path, key_id)
    except KeysError as exc:
        fail(str(exc))
    console.print(f"revoked key {record.id} of tenant {record.tenant!r} in {path}")


@app.command()
def secrets() -> None:
    """Print fresh values of the service's secrets as RLENS_* lines (an env file): the feedback secret for the
    workers, the learner and the gateway; the policy signing key for the learner only; the verify key for the workers."""
    from rlens.service.common.security import generate_secrets

    print("# rlens service secrets: RLENS_POLICY_SIGNING_KEY belongs to the learner alone")
    for name, value in generate_secrets().items():
        print(f"{name}={value}")


@app.command()
def up(
    pool: Path | None = POOL,
    strategy: str = typer.Option(
        settings().strategy,
        help="rl_focal (multiple-choice queries; open-ended ones over the models' sampled answers) or rlae (open-ended queries, token ensemble)",
    ),
    replay: Path = typer.Option(
        settings().demo_data, help="rl_focal without --pool: serve this recorded dataset's models (replay backends)"
    ),
    zoo_models: str = typer.Option(
        DEFAULT_RLAE_MODELS, help="rlae without --pool: these zoo models, in process (needs `rlens zoo build`)"
    ),
    workers: int = typer.Option(2, min=1, help="worker processes (one consumer group)"),
    partitions: int = typer.Option(
        4, min=1, help="partitions of the per-query topics (queries, answers, feedback, experience, dead letters)"
    ),
    workdir: Path = typer.Option(DEFAULT_WORKDIR, help="logs, the pool file and the learner's checkpoints"),
    warm_start: Path | None = typer.Option(
        None,
        help="warm-start the learner (first start only): a recorded dataset (rl_focal), an `rlens rlae train` run (rlae)",
    ),
    broker_port: int = typer.Option(9092, help="port of the embedded broker (when RLENS_KAFKA_BOOTSTRAP is not set)"),
    fresh: bool = typer.Option(
        False,
        "--fresh",
        help="start clean: delete the learner's checkpoints in --workdir and every Redis key under RLENS_REDIS_PREFIX",
    ),
    gateway: bool = typer.Option(True, help="run the OpenAI-compatible gateway too (its key: <workdir>/gateway.key)"),
    gateway_port: int = typer.Option(settings().gateway_port, help="the gateway's port (0: a free one)"),
) -> None:
    """Run the whole service here: a Kafka-protocol broker, Redis, the learner and N workers (Ctrl-C stops it).

    RLENS_KAFKA_BOOTSTRAP and RLENS_REDIS_URL point it at real ones instead of starting them. Without RLENS_REDIS_URL
    it uses the Redis at 127.0.0.1:6379 if one answers, else starts its own.
    """
    import asyncio
    import signal
    import time

    from redis import Redis
    from redis.exceptions import RedisError

    from rlens.models.pool import PoolConfigError, load_pool_config
    from rlens.service.common.kafka import BrokerRefused, check_idempotence
    from rlens.local.load import BrokerUnreachable, probe_broker
    from rlens.ports import port_taken
    from rlens.service.common.security import redact_url
    from rlens.local.stack import LocalStack, carried_state, clear_state, write_replay_pool, write_zoo_pool

    if strategy not in ("rl_focal", "rlae"):
        fail(f"--strategy must be rl_focal or rlae, got {strategy!r}")
    s = settings().model_copy(update={"strategy": strategy, "gateway_port": gateway_port})
    if gateway and gateway_port and port_taken(gateway_port):
        fail(
            f"port {gateway_port} is taken (another `rlens up`, or another program): pass --gateway-port, or --no-gateway"
        )
    kafka = os.environ.get("RLENS_KAFKA_BOOTSTRAP")
    redis_url = os.environ.get("RLENS_REDIS_URL")
    if redis_url is None:
        try:
            Redis.from_url(s.redis_url.get_secret_value(), socket_connect_timeout=0.5).ping()
            redis_url = s.redis_url.get_secret_value()
        except RedisError:
            pass
    else:
        try:
            Redis.from_url(redis_url, socket_connect_timeout=2).ping()
        except RedisError as exc:
            fail(
                f"Redis does not answer at {redact_url(redis_url)} (RLENS_REDIS_URL): {exc} Start it, fix the URL, "
                "or unset RLENS_REDIS_URL and `rlens up` starts its own."
            )
    if kafka is not None:
        try:
            asyncio.run(probe_broker(s.model_copy(update={"kafka_bootstrap": kafka})))
        except BrokerUnreachable:
            fail(
                f"no Kafka broker answers at {kafka} (RLENS_KAFKA_BOOTSTRAP): start it, fix the address, "
                "or unset RLENS_KAFKA_BOOTSTRAP and `rlens up` starts its own."
            )
    try:
        if pool is not None:
            load_pool_config(pool)  # before anything starts: a typo is one line, not a crashed worker
            pool_file = pool
        elif strategy == "rlae":
            pool_file = write_zoo_pool(s.zoo_dir, [n.strip() for n in zoo_models.split(",")], workdir / "pool.json")
        else:
            pool_file = write_replay_pool(replay, workdir / "pool.json")
        stack = LocalStack(
            s.model_copy(update={"pool_file": pool_file.resolve()}), workdir, partitions, kafka, redis_url, broker_port
        )
    except (DatasetError, PoolConfigError, RuntimeError, FileNotFoundError) as exc:
        fail(str(exc))
    try:
        asyncio.run(check_idempotence(stack.settings))
    except BrokerRefused as exc:
        stack.stop()
        fail(str(exc))
    try:
        if fresh:
            clear_state(stack.settings, workdir)
            console.print(
                f"fresh start: no learner checkpoint in {workdir}, no Redis keys under {stack.settings.redis_prefix!r}"
            )
        for line in carried_state(stack.settings, workdir):
            console.print(f"[yellow]carried over:[/] {line} (--fresh starts clean)")
    except RedisError as exc:
        stack.stop()
        fail(f"Redis at {redact_url(stack.settings.redis_url.get_secret_value())} failed: {exc}")
    stop = []
    ready = False
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        stack.start_learner(*(["--warm-start", str(warm_start)] if warm_start else []))
        for _ in range(workers):
            stack.start_worker()
        if gateway:
            stack.start_gateway()
        with console.status("starting the learner and the workers"):
            stack.wait_ready(180)
        ready = True
        redis_shown = redact_url(stack.settings.redis_url.get_secret_value())
        console.print(
            f"[bold green]rlens is up[/] ({strategy}): Kafka {stack.settings.kafka_bootstrap}, Redis {redis_shown}, pool {pool_file}, {workers} workers; logs and secrets.env in {workdir}"
        )
        console.print(
            "send traffic with: rlens load"
            + ("" if workdir == DEFAULT_WORKDIR else f" --stack {workdir}")
            + " --rate 50"
            + (" --tasks zoo" if strategy == "rlae" else "")
            + f"  (it reads {stack.client_env}: the address, topics and prefixes)",
            highlight=False,
        )
        for name, url in sorted(stack.http_urls().items()):
            console.print(f"  {name.split(':')[0]:8s} {url}/metrics  /healthz  /readyz", highlight=False)
            if name.startswith("learner:"):
                console.print(f"live dashboard: {url}/dashboard", highlight=False)
        if gateway:
            url = next(u for n, u in stack.http_urls().items() if n.startswith("gateway:"))
            console.print(
                f"OpenAI-compatible gateway: {url}/v1 (docs {url}/docs); its key: export OPENAI_API_KEY=$(cat {stack.gateway_key})",
                highlight=False,
            )
        while not stop:
            time.sleep(1)
            if stop:  # SIGTERM to the process group reaches the children too: do not restart them
                break
            for what in stack.restart_crashed():
                console.print(f"[yellow]restarted[/] {what}")
    except KeyboardInterrupt:
        if not ready:  # nothing to drain yet: stop at once
            stack.stop(timeout_s=2)
            interrupted("the stack was stopped before it was up")
    except (RuntimeError, TimeoutError) as exc:
        stack.stop()
        fail(str(exc))
    console.print("stopping (workers drain and commit, the learner checkpoints)")
    stack.stop()


@app.command()
def load(
    data: Path = typer.Option(
        settings().demo_data, "--data", help="dataset to play as multiple-choice traffic (default: the bundled stream)"
    ),
    tasks: str | None = typer.Option(
        None,
        help="open-ended traffic (rlae, or rl_focal over the models' samples) instead: a JSON-lines task file {prompt, reference[, family]}, or 'zoo' for the zoo's generation stream (8 blocks of 50, task switches)",
    ),
    rate: float = typer.Option(100.0, min=0.001, help="queries per second"),
    feedback_delay: float = typer.Option(0.0, min=0.0, help="seconds from a query's answer to its feedback"),
    limit: int | None = typer.Option(None, min=1, help="only the first N questions"),
    idle_timeout: float = typer.Option(60.0, min=1.0, help="give up after this many seconds without an answer"),
    stack: Path = typer.Option(
        DEFAULT_WORKDIR,
        help="the work folder of the `rlens up` to load: its client.env gives the address, topics and prefixes "
        "(RLENS_* variables override it)",
    ),
    bootstrap: str | None = typer.Option(None, help="Kafka bootstrap servers (overrides the stack's and the env's)"),
) -> None:
    """Play a dataset (or open-ended tasks) as live traffic through a running service and print live accuracy."""
    import asyncio

    from rich.live import Live

    from rlens.local.stack import CLIENT_ENV
    from rlens.settings import Settings

    from rlens.rlae.tasks import TaskFileError, read_tasks
    from rlens.local.load import (
        BrokerUnreachable,
        LoadReport,
        new_run_id,
        open_ended_queries,
        play,
        probe_broker,
        queries_of,
    )
    from rlens.zoo.record import QUESTIONS_FILE, read_questions
    from rlens.zoo.tasks import GENERATION_FAMILIES, generation_stream

    if tasks is not None:
        try:
            open_ended = (
                generation_stream(GENERATION_FAMILIES, 8, 50, seed=7) if tasks == "zoo" else read_tasks(Path(tasks))
            )
        except TaskFileError as exc:
            fail(str(exc))
        name, traffic = (
            "zoo generation stream" if tasks == "zoo" else tasks,
            open_ended_queries(open_ended, new_run_id())[:limit],
        )
    else:
        try:
            dataset = load_dataset(data)
        except DatasetError as exc:
            fail(str(exc))
        prompts = (
            [(q.prompt, q.choices) for q in read_questions(data / QUESTIONS_FILE)]
            if (data / QUESTIONS_FILE).is_file()
            else None
        )
        name, traffic = dataset.name, queries_of(dataset, prompts, new_run_id())[:limit]
    client_env = stack / CLIENT_ENV
    s = Settings(_env_file=client_env) if client_env.is_file() else settings()  # type: ignore[call-arg]
    if bootstrap:
        s = s.model_copy(update={"kafka_bootstrap": bootstrap})
    if client_env.is_file():
        errors.print(f"reaching the stack of {client_env}", highlight=False)

    def status(report) -> Table:
        table = Table(title=f"{name} → {s.kafka_bootstrap}: {rate:g} queries/s, feedback after {feedback_delay:g} s")
        for column in (
            "sent",
            "answered",
            "accuracy %",
            "last 200 %",
            "calls / query",
            "p50 ms",
            "p99 ms",
            "duplicates",
            "policy",
        ):
            table.add_column(column, justify="right")
        table.add_row(
            str(report.sent),
            f"{report.answered}/{len(traffic)}",
            f"{100 * report.accuracy:.1f}",
            f"{100 * report.recent_accuracy():.1f}",
            f"{sum(report.models_called) / max(len(report.models_called), 1):.2f}",
            f"{report.latency_percentile(50):.0f}",
            f"{report.latency_percentile(99):.0f}",
            str(report.duplicates),
            str(max(report.policy_versions, default=0)),
        )
        return table

    try:
        asyncio.run(probe_broker(s))
    except BrokerUnreachable as exc:
        fail(str(exc))
    latest = [LoadReport()]  # play's report, as it fills (what a Ctrl-C sums up)
    # on a terminal a live table; elsewhere (a pipe, a log) a line per 10 % of the traffic, or every 10 s
    live = Live(status(LoadReport()), console=console, refresh_per_second=4) if console.is_terminal else None
    lines = LineProgress(console, every_s=10.0)
    line = lines.add_task("answered", total=len(traffic))

    def seen(report: LoadReport) -> None:
        latest[0] = report
        if live is not None:
            live.update(status(report))
        else:
            lines.update(line, advance=report.answered - lines.tasks[line].done)

    try:
        if live is not None:
            live.start()
        report = asyncio.run(play(s, traffic, rate, feedback_delay, idle_timeout, on_answer=seen))
        if live is not None:
            live.update(status(report))
        else:
            console.print(status(report))
    except KeyboardInterrupt:
        report = latest[0]
        console.print(
            f"interrupted: answered {report.answered} of {report.sent} sent; accuracy {100 * report.accuracy:.1f} %"
        )
        raise typer.Exit(130)
    finally:
        if live is not None:
            live.stop()
    console.print()
    for task, (correct, answered) in sorted(report.per_task.items()):
        console.print(f"  {task:40s} {100 * correct / max(answered, 1):5.1f} % of {answered}")
    console.print(
        f"answered {report.answered} of {len(traffic)} in {report.elapsed_s:.1f} s; accuracy {100 * report.accuracy:.1f} %; {report.duplicates} duplicate answers"
    )
    if report.answered < len(traffic):
        raise typer.Exit(1)


@zoo_app.command("build")
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
    from rlens.zoo.build import SPECIALISTS, build_zoo

    quiet_transformers()
    out = out or settings().zoo_dir
    try:
        with progress_bar(console) as bar:
            task = bar.add_task(f"training {len(SPECIALISTS)} specialists", total=sum(s.steps for s in SPECIALISTS))
            models = build_zoo(out, progress=lambda n: bar.advance(task, n), threads=threads)
    except FileNotFoundError as exc:
        fail(str(exc))
    for model in models:
        console.print(f"  {model.name:14s} {model.tokenizer:8s} {model.parameters / 1e6:8.2f} M params  {model.path}")
    console.print(f"wrote {out}")


@zoo_app.command("record")
def zoo_record(
    zoo: Path | None = typer.Option(None, help="built zoo directory (default: $RLENS_ZOO_DIR or ~/.cache/rlens/zoo)"),
    out: Path = typer.Option(Path("out/zoo_mc"), help="dataset directory to write"),
    blocks: int = typer.Option(10, min=1, help="task blocks in the stream (the task switches at each block)"),
    block_size: int = typer.Option(120, min=1, help="questions per block"),
    seed: int = typer.Option(0, help="seed of the question stream"),
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
    from rlens.zoo.tasks import GENERATION_FAMILIES, generation_stream

    quiet_transformers()
    try:
        zoo_models = load_zoo(zoo or settings().zoo_dir)
    except FileNotFoundError as exc:
        fail(str(exc))
    names = [n.strip() for n in (models or "").split(",") if n.strip()] or [m.name for m in zoo_models]
    unknown = [n for n in names if n not in {m.name for m in zoo_models}]
    if unknown:
        fail(f"unknown zoo model(s) {', '.join(unknown)}; the zoo has {', '.join(m.name for m in zoo_models)}")
    chosen = [m for m in zoo_models if m.name in names]
    with progress_bar(console) as bar:
        task = bar.add_task("sampling" if samples else "scoring", total=blocks * block_size * len(chosen))
        advance = lambda n: bar.advance(task, n)  # noqa: E731
        if samples:
            dataset = record_samples(
                chosen,
                generation_stream(GENERATION_FAMILIES, blocks, block_size, seed),
                out,
                samples,
                temperature,
                seed=seed,
                progress=advance,
            )
        else:
            dataset = record_stream(chosen, out, blocks, block_size, seed, progress=advance)
    accuracy = (model_predictions(dataset) == dataset.labels[:, None]).mean(0)
    for name, acc in zip(dataset.model_names, accuracy):
        console.print(f"  {name:14s} accuracy {100 * acc:5.1f} %" + (" (its most frequent answer)" if samples else ""))
    console.print(
        f"wrote {out}: {dataset.n_questions} {'tasks' if samples else 'questions'} x {dataset.n_models} models"
    )


@import_app.command("lm-eval")
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
        zoo_models = {m.name: m for m in load_zoo(zoo or settings().zoo_dir)}
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


@rlae_app.command("train")
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
    with progress_bar(console) as bar:
        task = bar.add_task("training", total=episodes)
        state = trainer.run(
            train_tasks, lambda n, reward: bar.update(task, advance=n, description=f"training (reward {reward:.2f})")
        )
    write_training_plot(state.curve, out / "training.png", f"RLAE-{variant.upper()}, span {span}: {', '.join(names)}")
    console.print(
        f"{state.episodes} episodes, {state.updates} updates; last reward {state.curve[-1][1]:.2f}; wrote {out} (training.png)"
    )


@rlae_app.command("generate")
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


if __name__ == "__main__":  # last, so that every command is registered first (`python -m rlens.cli rlae train`)
    app()
