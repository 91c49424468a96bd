"""``rlens up`` step by step: check what it is pointed at, write the pool, open the stack, start its processes, keep
them running. Each step raises :class:`UpError` with one line for the user; nothing is left running after one."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from redis.exceptions import RedisError

from rlens.redis_clients import sync_redis
from rlens.records.dataset import load_dataset
from rlens.records.recorded import DatasetError
from rlens.local import kafka as apache_kafka
from rlens.local.kafka import LocalKafka
from rlens.local.load import BrokerUnreachable, probe_broker
from rlens.local.servers import broker_port_taken
from rlens.local.stack import LocalStack, carried_state, clear_state, write_replay_pool, write_zoo_pool
from rlens.models.pool import PoolConfigError, load_pool_config, parse_pool_config
from rlens.ports import port_taken
from rlens.service.common.kafka import BrokerRefused, settle_idempotence
from rlens.service.common.security import redact_url
from rlens.config_file import config_path
from rlens.settings import Settings
from rlens.zoo.build import MANIFEST

READY_TIMEOUT_S = 180.0
WARM_READY_TIMEOUT_S = 3600.0  # a warm start trains the learner before it is ready: minutes on a busy machine


class UpError(Exception):
    """What stops ``rlens up``, in one line."""


@dataclass
class UpOptions:
    """What ``rlens up`` was asked for (its command-line options)."""

    workdir: Path
    strategy: str
    pool: Path | None  # a pool file; None: the recorded dataset (rl_focal) or the zoo models (rlae)
    replay: Path  # rl_focal: the recording whose answers are cached (its models are zoo models) or replayed
    recorded_only: bool  # rl_focal: replay the recording (its questions only) instead of running its models
    zoo_models: list[str]
    workers: int
    partitions: int
    learner_shards: int  # 1: one learner; more: that many shards and a trainer
    broker_port: int
    broker: str  # auto, kafka or tansu: the broker to start (when none is set)
    gateway: bool
    warm_start: Path | None
    fresh: bool


def redis_to_use(settings: Settings, env_url: str | None) -> str | None:
    """The Redis the stack uses: ``RLENS_REDIS_URL`` if set (it must answer), else the default one if it answers,
    else None (the stack starts its own)."""
    if env_url is None:
        try:
            sync_redis(settings.redis.url.get_secret_value(), socket_connect_timeout=0.5).ping()
            return settings.redis.url.get_secret_value()
        except RedisError:
            return None
    try:
        sync_redis(env_url, socket_connect_timeout=2).ping()
    except RedisError as exc:
        where = set_by("RLENS_REDIS_URL", "[redis] url")
        raise UpError(
            f"Redis does not answer at {redact_url(env_url)} ({where}): {exc} Start it, fix the URL, "
            f"or unset {where} and `rlens up` starts its own."
        ) from None
    return env_url


def check_broker(settings: Settings, bootstrap: str) -> None:
    try:
        asyncio.run(probe_broker(settings.updated({"kafka_bootstrap": bootstrap})))
    except BrokerUnreachable:
        where = set_by("RLENS_KAFKA_BOOTSTRAP", "[kafka] bootstrap")
        raise UpError(
            f"no Kafka broker answers at {bootstrap} ({where}): start it, fix the address, "
            f"or unset {where} and `rlens up` starts its own."
        ) from None


def set_by(variable: str, key: str) -> str:
    """Where a setting that ``rlens up`` uses came from: its variable, or the configuration file's key."""
    return variable if os.environ.get(variable) or config_path() is None else f"{key} in {config_path()}"


def pool_file(options: UpOptions, settings: Settings, build_zoo: Callable[[Path], None]) -> Path:
    """The pool the workers serve: the given file (checked before anything starts: a typo is one line, not a crashed
    worker), or one written into the work folder."""
    if options.pool is not None:
        load_pool_config(options.pool)
        return options.pool
    if settings.pool.models is not None:  # the configuration file's [[pool.models]]
        path = options.workdir / "pool.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        pool = parse_pool_config(
            {"models": settings.pool.models},
            f"[[pool.models]] in {config_path()}" if config_path() else "RLENS_POOL_MODELS",
        )
        path.write_text(pool.model_dump_json(indent=1))
        return path
    if settings.pool.file is not None:
        load_pool_config(settings.pool.file)
        return settings.pool.file
    if options.strategy == "rlae":
        return write_zoo_pool(settings.service.zoo_dir, options.zoo_models, options.workdir / "pool.json")
    if options.recorded_only:
        return write_replay_pool(options.replay, options.workdir / "pool.json")
    names = load_dataset(options.replay).model_names
    if not (settings.service.zoo_dir / MANIFEST).is_file():
        build_zoo(settings.service.zoo_dir)
    try:
        return write_zoo_pool(settings.service.zoo_dir, names, options.workdir / "pool.json", recorded=options.replay)
    except FileNotFoundError as exc:
        raise UpError(f"{exc}: the models of {options.replay} must be zoo models, or pass --recorded-only") from None


def open_stack(
    options: UpOptions,
    settings: Settings,
    kafka: str | None,
    redis_env: str | None,
    build_zoo: Callable[[Path], None],
    say: Callable[[str], None] = print,
) -> LocalStack:
    """Checks, the pool file (the zoo built by ``build_zoo`` first, when the pool needs it and it is not), the stack's
    broker and Redis (started or reached), its idempotence check; ``say`` tells which broker it started."""
    if options.learner_shards > options.partitions:
        raise UpError(
            f"--learner-shards {options.learner_shards} exceeds --partitions {options.partitions}: the shards beyond "
            "them would join nothing"
        )
    if options.gateway and settings.gateway.port and port_taken(settings.gateway.port):
        raise UpError(
            f"port {settings.gateway.port} is taken (another `rlens up`, or another program): pass --gateway-port, "
            "or --no-gateway"
        )
    redis_url = redis_to_use(settings, redis_env)
    broker, which = "tansu", ""
    if kafka is not None:
        check_broker(settings, kafka)
    elif port_taken(options.broker_port):  # before a zoo is built
        raise UpError(broker_port_taken(options.broker_port))
    else:
        broker, which = broker_to_start(options.broker, options.workdir, say)
    try:
        pool = pool_file(options, settings, build_zoo)
        stack = LocalStack(
            settings.updated({"pool_file": pool.resolve()}),
            options.workdir,
            options.partitions,
            kafka,
            redis_url,
            options.broker_port,
            redis_dir=options.workdir / "redis",  # a second `rlens up` on the folder has the windows of the first
            broker=broker,
            fresh=options.fresh,
        )
    except (DatasetError, PoolConfigError, RuntimeError, FileNotFoundError) as exc:
        raise UpError(str(exc)) from None
    try:
        asyncio.run(settle_idempotence(stack.settings))  # the processes settle it alike
    except BrokerRefused as exc:
        stack.stop()
        raise UpError(str(exc)) from None
    except KeyboardInterrupt:  # Ctrl-C here: nothing of the stack outlives it
        stack.stop(timeout_s=2)
        raise
    if which:
        say(which)
    return stack


def broker_to_start(choice: str, workdir: Path, say: Callable[[str], None]) -> tuple[str, str]:
    """kafka or tansu for ``choice`` (auto: Apache Kafka where Java and its jars are here), and the line that says
    which; Apache Kafka's jars fetched first when it is asked for by name."""
    problem, version = apache_kafka.java_problem(), apache_kafka.VERSION
    if choice == "kafka":
        if problem is not None:
            raise UpError(f"--broker kafka: {problem}")
        if not apache_kafka.fetched():
            say(f"fetching Apache Kafka {version} from Maven Central into {apache_kafka.jars()} (once, about 100 MB)")
            try:
                apache_kafka.fetch()
            except RuntimeError as exc:
                raise UpError(str(exc)) from None
    elif choice == "auto":
        choice = "kafka" if problem is None and apache_kafka.fetched() else "tansu"
    if choice == "kafka":
        return choice, f"broker: Apache Kafka {version}, its data in {workdir / 'kafka'} (--broker tansu: in memory)"
    if problem is not None:
        return choice, f"broker: tansu, in memory ({problem}: no Apache Kafka)"
    if not apache_kafka.fetched():
        return choice, (
            f"broker: tansu, in memory (Java is here: --broker kafka fetches Apache Kafka {version} once and runs it "
            "instead, its latency steady under load and its topics kept across restarts)"
        )
    return choice, "broker: tansu, in memory"


def prepare_state(stack: LocalStack, options: UpOptions) -> list[str]:
    """``--fresh``: clear the learner's checkpoints and the Redis keys. The lines to show: what was cleared, or what
    is carried over from a previous run."""
    try:
        lines = []
        if options.fresh:
            clear_state(stack.settings, options.workdir)
            lines.append(
                f"fresh start: no learner checkpoint in {options.workdir}, no Redis keys under "
                f"{stack.settings.redis.prefix!r}"
                + (", no topics in its Apache Kafka" if isinstance(stack.broker, LocalKafka) else "")
            )
        return lines + [
            f"carried over: {line} (--fresh starts clean)" for line in carried_state(stack.settings, options.workdir)
        ]
    except RedisError as exc:
        stack.stop()
        raise UpError(f"Redis at {redact_url(stack.settings.redis.url.get_secret_value())} failed: {exc}") from None


def start_processes(
    stack: LocalStack, options: UpOptions, progress: Callable[[list[str], float], None] | None = None
) -> None:
    """The learner, the workers and the gateway, until every one is ready (TimeoutError or RuntimeError if not);
    ``progress`` hears which are still starting. A warm start trains first: it is waited for far longer."""
    warm = ["--warm-start", str(options.warm_start)] if options.warm_start else []
    if options.learner_shards > 1:
        stack.start_learner_shards(options.learner_shards, *warm)
    else:
        stack.start_learner(*warm)
    for _ in range(options.workers):
        stack.start_worker()
    if options.gateway:
        stack.start_gateway()
    stack.wait_ready(READY_TIMEOUT_S if options.warm_start is None else WARM_READY_TIMEOUT_S, progress)


def supervise(stack: LocalStack, stopping: Callable[[], bool], restarted: Callable[[str], None]) -> None:
    """Restart what crashed, once a second, until ``stopping()`` (a SIGTERM to the group reaches the children too:
    they are not restarted then)."""
    while not stopping():
        time.sleep(1)
        if stopping():
            break
        for what in stack.restart_crashed():
            restarted(what)
