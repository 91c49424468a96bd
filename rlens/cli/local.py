"""``rlens up`` (the whole service on this machine) and ``rlens load`` (recorded traffic through a running one)."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.table import Table

from rlens.cli.zoo import build_zoo_here
from rlens.cli.common import CONFIG, DEFAULT_WORKDIR, POOL, console, errors, fail, interrupted
from rlens.cli.rlae import DEFAULT_RLAE_MODELS
from rlens.progress import LineProgress
from rlens.settings import settings


def up(
    config: Path | None = CONFIG,
    pool: Path | None = POOL,
    strategy: str | None = typer.Option(
        None,
        help="rl_focal (multiple-choice queries; open-ended ones over the models' sampled answers) or rlae (open-ended "
        "queries, token ensemble); default: $RLENS_STRATEGY, rl_focal",
    ),
    replay: Path | None = typer.Option(
        None,
        help="rl_focal without --pool: the recorded dataset whose models serve (the zoo's, which the first `rlens up` "
        "builds), its recorded answers cached; default: the bundled stream",
    ),
    recorded_only: bool = typer.Option(
        False,
        "--recorded-only",
        help="rl_focal without --pool: replay the recording alone (starts in seconds, no zoo; only its own questions "
        "get an answer, any other prompt a 502)",
    ),
    zoo_models: str = typer.Option(
        DEFAULT_RLAE_MODELS, help="rlae without --pool: these zoo models, in process (needs `rlens zoo build`)"
    ),
    workers: int = typer.Option(2, min=1, help="worker processes (one consumer group)"),
    learner_shards: int = typer.Option(
        1, min=1, help="more than 1: that many learner shards join and one trainer trains (at most --partitions)"
    ),
    partitions: int = typer.Option(
        4, min=1, help="partitions of the per-query topics (queries, answers, feedback, experience, dead letters)"
    ),
    workdir: Path = typer.Option(DEFAULT_WORKDIR, help="logs, the pool file and the learner's checkpoints"),
    warm_start: Path | None = typer.Option(
        None,
        help="warm-start the learner (first start only): a recorded dataset (rl_focal), an `rlens rlae train` run (rlae)",
    ),
    broker_port: int = typer.Option(9092, help="port of the embedded broker (when RLENS_KAFKA_BOOTSTRAP is not set)"),
    broker: str | None = typer.Option(
        None,
        help="the broker to start when RLENS_KAFKA_BOOTSTRAP is not set: kafka (Apache Kafka, Java 17+; its jars "
        "fetched once), tansu (in memory) or auto (kafka where Java and its jars are here); default: "
        "$RLENS_KAFKA_EMBEDDED, auto",
    ),
    fresh: bool = typer.Option(
        False,
        "--fresh",
        help="start clean: delete the learner's checkpoints in --workdir, every Redis key under RLENS_REDIS_PREFIX and "
        "the topics of the Apache Kafka it starts (--broker kafka)",
    ),
    gateway: bool = typer.Option(True, help="run the OpenAI-compatible gateway too (its key: <workdir>/gateway.key)"),
    gateway_port: int | None = typer.Option(
        None, help="the gateway's port (0: a free one); default: $RLENS_GATEWAY_PORT, 8000"
    ),
) -> None:
    """Run the whole service here: a Kafka-protocol broker, Redis, the learner and N workers (Ctrl-C stops it).

    RLENS_KAFKA_BOOTSTRAP and RLENS_REDIS_URL point it at real ones instead of starting them. Without RLENS_REDIS_URL
    it uses the Redis at 127.0.0.1:6379 if one answers, else starts its own.
    """
    if strategy is not None and strategy not in ("rl_focal", "rlae"):
        fail(f"--strategy must be rl_focal or rlae, got {strategy!r}")
    if broker is not None and broker not in ("auto", "kafka", "tansu"):
        fail(f"--broker must be auto, kafka or tansu, got {broker!r}")
    stack = None
    try:  # Ctrl-C from the first moment (the imports take seconds): one line, never typer's silent 130
        from rlens.local.up import UpError, UpOptions, open_stack, prepare_state

        base = settings()
        s = base.updated(
            {
                "strategy": strategy or base.service.strategy,
                "gateway_port": base.gateway.port if gateway_port is None else gateway_port,
            }
        )
        options = UpOptions(
            workdir,
            s.service.strategy,
            pool,
            replay or s.service.demo_data,
            recorded_only,
            [n.strip() for n in zoo_models.split(",")],
            workers,
            partitions,
            learner_shards,
            broker_port,
            broker or s.kafka.embedded,
            gateway,
            warm_start,
            fresh,
        )
        kafka, redis = external_services()
        stack = open_stack(options, s, kafka, redis, build_zoo, lambda line: console.print(line, highlight=False))
        for line in prepare_state(stack, options):
            console.print(line.replace("carried over:", "[yellow]carried over:[/]", 1))
    except KeyboardInterrupt:  # before the processes start; first, as UpError may not be imported yet
        if stack is not None:
            stack.stop(timeout_s=2)
        interrupted("the stack was stopped before it was up")
    except UpError as exc:
        fail(str(exc))
    _run_until_stopped(stack, options)


def _run_until_stopped(stack, options) -> None:
    """Start the learner and workers (a status line names who is still starting), then supervise them until
    Ctrl-C or SIGTERM; a stack stopped before it was up stops at once, a running one drains."""
    import signal

    from rlens.local.up import start_processes, supervise  # imported by `up` already

    stop: list[int] = []
    ready = False
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))

    def on_sigint(*_) -> None:  # remembered too: a KeyboardInterrupt raised while a child is forked is swallowed
        stop.append(2)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        with console.status("starting the learner and the workers") as status:

            def starting(waiting: list[str], elapsed_s: float) -> None:
                if 2 in stop:
                    raise KeyboardInterrupt
                counts = {role: waiting.count(role) for role in dict.fromkeys(waiting)}
                shown = ", ".join(f"{role} ×{n}" if n > 1 else role for role, n in counts.items())
                status.update(f"starting: {shown} ({elapsed_s:.0f} s)")

            start_processes(stack, options, starting)
        ready = True
        show_stack(stack, options)
        supervise(stack, lambda: bool(stop), lambda what: console.print(f"[yellow]restarted[/] {what}"))
    except KeyboardInterrupt:
        if not ready:  # nothing to drain yet: stop at once
            stack.stop(timeout_s=2)
            interrupted("the stack was stopped before it was up")
    except (RuntimeError, TimeoutError) as exc:
        stack.stop()
        fail(str(exc))
    console.print("stopping (workers drain and commit, the learner checkpoints)")
    stack.stop()


def build_zoo(zoo_dir: Path) -> None:
    """The first `rlens up`'s zoo, built where `rlens zoo build` puts it."""
    console.print(
        f"the model zoo is not in {zoo_dir} yet: building it once (about 8 minutes on 2 cores; --recorded-only "
        "starts without it)"
    )
    build_zoo_here(zoo_dir)


def external_services() -> tuple[str | None, str | None]:
    """The Kafka bootstrap and Redis URL to use instead of starting them: RLENS_KAFKA_BOOTSTRAP / RLENS_REDIS_URL, or
    the configuration file's [kafka] bootstrap / [redis] url."""
    from rlens.config_file import config_path, read_config
    from rlens.settings import Settings

    path = config_path()
    configured = read_config(path, Settings.group_keys()) if path else {}
    return (
        os.environ.get("RLENS_KAFKA_BOOTSTRAP") or configured.get("kafka", {}).get("bootstrap"),
        os.environ.get("RLENS_REDIS_URL") or configured.get("redis", {}).get("url"),
    )


def show_stack(stack, options) -> None:
    """What is up, and where: the addresses, the next command, each process's HTTP side, the gateway's key."""
    from rlens.service.common.security import redact_url

    s = stack.settings
    console.print(
        f"[bold green]rlens is up[/] ({s.service.strategy}): Kafka {s.kafka.bootstrap}, Redis {redact_url(s.redis.url.get_secret_value())}, "
        f"pool {s.pool.file}, {options.workers} workers; logs and secrets.env in {options.workdir}"
    )
    console.print(
        "send traffic with: rlens load"
        + ("" if options.workdir == DEFAULT_WORKDIR else f" --stack {options.workdir}")
        + " --rate 50"
        + (" --tasks zoo" if s.service.strategy == "rlae" else "")
        + f"  (it reads {stack.client_env}: the address, topics and prefixes)",
        highlight=False,
    )
    urls = stack.http_urls()
    for name, url in sorted(urls.items()):
        console.print(f"  {name.split(':')[0]:8s} {url}/metrics  /healthz  /readyz", highlight=False)
        if name.startswith("learner:"):
            console.print(f"live dashboard: {url}/dashboard", highlight=False)
    if options.gateway:
        url = next(u for n, u in urls.items() if n.startswith("gateway:"))
        console.print(
            f"OpenAI-compatible gateway: {url}/v1 (docs {url}/docs); "
            + (
                f"its key: export OPENAI_API_KEY=$(cat {stack.gateway_key})"
                if stack.gateway_key
                else f"its keys: {s.gateway.keys_file} (rlens keys add --file {s.gateway.keys_file})"
            ),
            highlight=False,
        )


def load(
    data: Path | None = typer.Option(
        None, "--data", help="dataset to play as multiple-choice traffic (default: the bundled stream)"
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

    from rlens.local.load import SEND_TRIES, BrokerUnreachable, TrafficError, play, probe_broker, traffic_of
    from rlens.local.stack import client_settings

    try:
        name, traffic = traffic_of(data or settings().service.demo_data, tasks, limit)
    except TrafficError as exc:
        fail(str(exc))
    s = client_settings(stack)
    if s is None and stack != DEFAULT_WORKDIR:  # named, so it must be there
        what = "no such folder" if not stack.exists() else "no client.env there"
        fail(f"--stack {stack}: {what}; start a stack there with `rlens up --workdir {stack}`")
    if s is not None:
        errors.print(f"reaching the stack of {stack / 'client.env'}", highlight=False)
    s = s or settings()
    if bootstrap:
        s = s.updated({"kafka_bootstrap": bootstrap})
    try:
        asyncio.run(probe_broker(s))
    except BrokerUnreachable as exc:
        fail(str(exc))
    title = f"{name} → {s.kafka.bootstrap}: {rate:g} queries/s, feedback after {feedback_delay:g} s"
    shown = LoadView(title, len(traffic))
    try:
        report = asyncio.run(play(s, traffic, rate, feedback_delay, idle_timeout, on_answer=shown.update))
    except KeyboardInterrupt:
        shown.close()
        report = shown.latest
        console.print(
            f"interrupted: answered {report.answered} of {report.sent} sent; accuracy {100 * report.accuracy:.1f} %"
        )
        raise typer.Exit(130)
    shown.finish(report)
    console.print()
    for task, (correct, answered) in sorted(report.per_task.items()):
        console.print(f"  {task:40s} {100 * correct / max(answered, 1):5.1f} % of {answered}")
    console.print(
        f"answered {report.answered} of {len(traffic)} in {report.elapsed_s:.1f} s; accuracy {100 * report.accuracy:.1f} %; {report.duplicates} duplicate answers"
    )
    if report.send_failures:
        console.print(f"{report.send_failures} queries or feedback the broker refused {SEND_TRIES} times (logged)")
    if report.answered < len(traffic) or report.send_failures:
        raise typer.Exit(1)


LOAD_COLUMNS = (
    "sent",
    "answered",
    "accuracy %",
    "last 200 %",
    "calls / query",
    "p50 ms",
    "p99 ms",
    "duplicates",
    "policy",
)


class LoadView:
    """``rlens load``'s progress: a live table on a terminal; elsewhere (a pipe, a log) a line per 10 % of the
    traffic or every 10 s, and the table at the end."""

    def __init__(self, title: str, total: int):
        from rich.live import Live

        from rlens.local.load import LoadReport

        self.title, self.total, self.latest = title, total, LoadReport()
        self.live = (
            Live(self.table(self.latest), console=console, refresh_per_second=4) if console.is_terminal else None
        )
        self.lines = LineProgress(console, every_s=10.0)
        self.line = self.lines.add_task("answered", total=total)
        if self.live is not None:
            self.live.start()

    def table(self, report) -> Table:
        table = Table(title=self.title)
        for column in LOAD_COLUMNS:
            table.add_column(column, justify="right")
        table.add_row(
            str(report.sent),
            f"{report.answered}/{self.total}",
            f"{100 * report.accuracy:.1f}",
            f"{100 * report.recent_accuracy():.1f}",
            f"{sum(report.models_called) / max(len(report.models_called), 1):.2f}",
            f"{report.latency_percentile(50):.0f}",
            f"{report.latency_percentile(99):.0f}",
            str(report.duplicates),
            str(max(report.policy_versions, default=0)),
        )
        return table

    def update(self, report) -> None:
        self.latest = report
        if self.live is not None:
            self.live.update(self.table(report))
        else:
            self.lines.update(self.line, advance=report.answered - self.lines.tasks[self.line].done)

    def finish(self, report) -> None:
        """The last table: kept on a terminal, printed once elsewhere."""
        if self.live is None:
            console.print(self.table(report))
        else:
            self.live.update(self.table(report))
            self.close()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
