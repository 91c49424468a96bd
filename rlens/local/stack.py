"""The whole service on one machine: broker, Redis, one learner and N workers as child processes.

``rlens up`` runs it until Ctrl-C / SIGTERM; the fault tests use it to kill and restart single processes.
Without ``kafka_bootstrap`` / ``redis_url`` it starts its own tansu broker and ``redis-server``; with them it uses
the given ones (real clusters, or a Redis that already runs). Secrets not in the settings (feedback secret, policy
keys) come from ``<workdir>/secrets.env`` (mode 0600), made on the first start, so a restarted stack keeps them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from typing import Callable, TypeGuard, cast
from pathlib import Path

from pydantic import SecretStr

from rlens import locks
from rlens.records.dataset import load_dataset
from rlens.service.common.kafka import ensure_topics
from rlens.local.kafka import LocalKafka
from rlens.local.servers import LocalBroker, LocalRedis, die_with_parent
from rlens.ports import free_port
from rlens.service.common.security import generate_secrets
from rlens.settings import Settings, variable_of, variables

SECRETS = ("feedback_secret", "policy_signing_key", "policy_verify_key")
ASKED_TO_STOP = (-signal.SIGTERM, -signal.SIGINT)  # exit codes of a process stopped on purpose (not restarted)


SECRETS_ENV = "secrets.env"


def workdir_secrets(workdir: Path) -> dict[str, str]:
    """The stack's secrets as settings field → value, from ``secrets.env`` (written on first use, mode 0600)."""
    path = workdir / SECRETS_ENV
    if not path.is_file():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in generate_secrets().items())
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.removeprefix("RLENS_").lower(): v for k, v in pairs}


CLIENT_ENV = "client.env"
CLIENT_SETTINGS = (  # what a client (`rlens load`) or an operator command (`rlens policy`, `rlens ope`) needs
    "kafka_bootstrap",
    "kafka_security_protocol",
    "kafka_sasl_mechanism",
    "kafka_sasl_username",
    "kafka_ssl_cafile",
    "kafka_acks",
    "kafka_idempotence",
    "kafka_fetch_max_wait_ms",
    "topic_prefix",
    "redis_url",
    "redis_prefix",
    "checkpoint_dir",  # the learner's checkpoints and its off-policy log
    "pool_file",
)


def write_client_env(settings: Settings, workdir: Path) -> Path:
    """``<workdir>/client.env`` (mode 0600: a Redis URL may hold a password): the RLENS_* lines a second terminal
    needs to reach this stack (`rlens load --stack`, `rlens policy --stack`, `rlens ope --stack`)."""
    checkpoints = settings.learner.checkpoint_dir.resolve()  # read from any folder
    values = settings.updated(checkpoint_dir=checkpoints).as_variables(CLIENT_SETTINGS)
    path = Path(workdir) / CLIENT_ENV
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in values.items())
    os.chmod(path, 0o600)  # a file of an earlier version kept its mode
    return path


def client_settings(workdir: Path) -> Settings | None:
    """The settings of a client of the stack in ``workdir`` (its ``client.env``; RLENS_* variables override it),
    or None when there is no stack there."""
    path = Path(workdir) / CLIENT_ENV
    return Settings(_env_file=path) if path.is_file() else None  # type: ignore[call-arg]


def workdir_gateway_key(workdir: Path) -> Path:
    """The stack's gateway key file (``keys.json``, hashed) and the key itself (``gateway.key``, mode 0600): made on
    first use, for tenant ``local`` on every stream; the path of the key."""
    from rlens.service.gateway.api_keys import add_key

    key_path = workdir / "gateway.key"
    if not key_path.is_file():
        key, _ = add_key(workdir / "keys.json", "local", ["*"], rate_per_s=1000.0, burst=2000)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
    return key_path


def write_replay_pool(dataset_dir: Path, path: Path) -> Path:
    """A pool file of every model of a recorded dataset, as ``replay`` backends (costs from the dataset)."""
    dataset = load_dataset(dataset_dir)
    models = [
        {
            "name": name,
            "backend": "replay",
            "cost": float(cost),
            "options": {"dataset": str(Path(dataset_dir).resolve()), "model": i},
        }
        for i, (name, cost) in enumerate(zip(dataset.model_names, dataset.model_costs))
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"models": models}, indent=1))
    return path


def write_zoo_pool(zoo_dir: Path, names: list[str], path: Path, recorded: Path | None = None) -> Path:
    """A pool file of zoo models by name, as in-process ``transformers`` backends; with ``recorded``, a recorded
    dataset of theirs whose answers the workers take from the recording (their output cache)."""
    from rlens.zoo.build import load_zoo

    zoo = {m.name: m for m in load_zoo(zoo_dir)}
    unknown = [n for n in names if n not in zoo]
    if unknown:
        raise FileNotFoundError(f"zoo model(s) {', '.join(unknown)} not in {zoo_dir}; it has {', '.join(zoo)}")
    models = [
        {
            "name": n,
            "backend": "transformers",
            "cost": zoo[n].cost,
            "options": {"path": zoo[n].path, **({"gguf_file": zoo[n].gguf_file} if zoo[n].gguf_file else {})},
        }
        for n in names
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pool = {"models": models, **({"recorded": str(Path(recorded).resolve())} if recorded else {})}
    path.write_text(json.dumps(pool, indent=1))
    return path


def carried_state(settings: Settings, workdir: Path) -> list[str]:
    """What a stack started on ``workdir`` and ``settings.redis_url`` would carry over from earlier runs, in words."""
    from rlens.redis_clients import sync_redis

    from rlens.checkpoint import CheckpointStore

    found = []
    directory = Path(workdir) / "learner"
    latest = CheckpointStore(directory, lock=False).latest() if directory.is_dir() else None
    if latest is not None:
        state = json.loads((latest / "state.json").read_text())
        found.append(
            f"the learner resumes its checkpoint v{state['version']} ({state['stats']['joined']} transitions joined) from {directory}"
        )
    redis = sync_redis(settings.redis.url.get_secret_value(), socket_connect_timeout=1)
    try:
        streams = sum(1 for _ in redis.scan_iter(f"{settings.redis.prefix}:win:*", count=1000))
    finally:
        redis.close()
    if streams:
        found.append(f"Redis holds the windows of {streams} streams under the prefix {settings.redis.prefix!r}")
    return found


def clear_state(settings: Settings, workdir: Path) -> None:
    """Forget what earlier runs left: the learner's checkpoints in ``workdir`` and every Redis key under the prefix."""
    from rlens.redis_clients import sync_redis

    shutil.rmtree(Path(workdir) / "learner", ignore_errors=True)
    redis = sync_redis(settings.redis.url.get_secret_value(), socket_connect_timeout=1)
    try:
        for key in redis.scan_iter(f"{settings.redis.prefix}:*", count=1000):
            redis.delete(key)
    finally:
        redis.close()


class LocalStack:
    def __init__(
        self,
        settings: Settings,
        workdir: Path,
        partitions: int = 4,
        kafka_bootstrap: str | None = None,
        redis_url: str | None = None,
        broker_port: int | None = None,
        redis_dir: Path | None = None,
        broker: str = "tansu",
        fresh: bool = False,
    ):
        """``redis_dir``: where the stack's own Redis keeps its data (none: nothing persists). ``broker``: the one it
        starts without ``kafka_bootstrap``: tansu (memory only), or kafka (Apache Kafka, its data in the work
        folder's ``kafka``, deleted first with ``fresh``; its jars fetched already: :func:`rlens.local.kafka.fetch`)."""
        self.workers: list[subprocess.Popen] = []
        self.workers_started = 0  # each new worker logs to worker-<n>.log
        self.learner: subprocess.Popen | None = None
        self.shards: dict[int, subprocess.Popen] = {}  # a sharded learner's shards by index (the learner: its trainer)
        self.shard_count = 0
        self.gateway: subprocess.Popen | None = None
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # before anything starts: one stack per work folder, and no learner of another on its checkpoints
        try:
            self._workdir_lock = locks.acquire(self.workdir / ".stack.lock", f"work folder {self.workdir}")
        except locks.LockedError as exc:
            raise locks.LockedError(f"{exc} (another `rlens up`): stop it, or pass another --workdir") from None
        learner = locks.holder(self.workdir / "learner" / ".lock", f"the checkpoints in {self.workdir / 'learner'}")
        if learner:
            locks.release(self._workdir_lock)
            raise locks.LockedError(f"{learner} (a learner): stop it, or pass another --workdir")
        self.broker: LocalBroker | LocalKafka | None = None
        self.redis: LocalRedis | None = None
        try:
            self._start_infra(settings, partitions, kafka_bootstrap, redis_url, broker_port, redis_dir, broker, fresh)
        except BaseException:
            self.stop()
            raise

    def _start_infra(
        self,
        settings: Settings,
        partitions: int,
        kafka_bootstrap: str | None,
        redis_url: str | None,
        broker_port,
        redis_dir: Path | None,
        broker: str,
        fresh: bool,
    ) -> None:
        if kafka_bootstrap is None:
            if broker == "kafka":
                self.broker = LocalKafka(broker_port or free_port(), self.workdir / "kafka", fresh)
            else:
                self.broker = LocalBroker(broker_port)
        self.redis = None if redis_url else LocalRedis(data_dir=redis_dir)
        kafka_bootstrap = kafka_bootstrap or cast(LocalBroker | LocalKafka, self.broker).bootstrap
        redis_url = redis_url or cast(LocalRedis, self.redis).url
        own = workdir_secrets(self.workdir)
        secrets = {
            k: (own[k] if k == "policy_verify_key" else SecretStr(own[k]))
            for k in SECRETS
            if getattr(settings.security, k) is None
        }
        configured_keys = "keys_file" in settings.gateway.model_fields_set  # the operator's own keys file
        # the fetch waits of the stack's own broker (LocalBroker's for tansu, LocalKafka's), unless set
        waits = {
            name: getattr(self.broker, constant)
            if self.broker is not None and name not in settings.kafka.model_fields_set
            else getattr(settings.kafka, name)
            for name, constant in (
                ("fetch_max_wait_ms", "FETCH_MAX_WAIT_MS"),
                ("background_fetch_max_wait_ms", "BACKGROUND_FETCH_MAX_WAIT_MS"),
            )
        }
        self.settings = settings.updated(
            {
                "kafka_bootstrap": kafka_bootstrap,
                **{f"kafka_{name}": wait for name, wait in waits.items()},
                "kafka_partitions": partitions,
                "redis_url": SecretStr(redis_url),
                "checkpoint_dir": self.workdir / "learner",
                "gateway_keys_file": settings.gateway.keys_file if configured_keys else self.workdir / "keys.json",
                **secrets,
            }
        )
        asyncio.run(ensure_topics(self.settings, partitions))
        # a key of the stack's own, unless the keys are the operator's
        self.gateway_key = None if configured_keys else workdir_gateway_key(self.workdir)
        self.client_env = write_client_env(self.settings, self.workdir)

    def env(self, command: str) -> dict[str, str]:
        """The environment of the child process running ``rlens <command>``: the stack's settings as RLENS_*
        variables, with only its own secrets (the policy signing key goes to the learner alone)."""
        known = variables()  # the stack's settings replace the parent's, whichever name the parent used
        env = {**{k: v for k, v in os.environ.items() if k.upper() not in known}, **self.settings.as_variables()}
        if command != "learner":
            env.pop("RLENS_POLICY_SIGNING_KEY", None)
        return env

    def _spawn(self, command: str, log_name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.workdir / log_name, "ab")
        return subprocess.Popen(
            [sys.executable, "-m", "rlens.cli", command, *args],
            env=self.env(command) | (env or {}),
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # none outlives the process that started it
        )

    def start_worker(self) -> subprocess.Popen:
        process = self._spawn("worker", f"worker-{self.workers_started}.log")
        self.workers.append(process)
        self.workers_started += 1
        return process

    def start_learner(self, *args: str) -> subprocess.Popen:
        self.learner_args = args
        self.learner = self._spawn("learner", "learner.log", *args)
        return self.learner

    def start_learner_shards(self, shards: int, *args: str) -> None:
        """The learner as ``shards`` shards and a trainer (``RLENS_LEARNER_ROLE``; ``args``: the trainer's), each
        checkpointing in a folder of its own under the learner's; the trainer is :attr:`learner`."""
        self.start_trainer(*args)
        for shard in range(shards):
            self.start_shard(shard, shards)

    def start_trainer(self, *args: str) -> subprocess.Popen:
        """The trainer of a sharded learner (:attr:`learner`): it trains on what the shards hand on."""
        self.learner_args = args
        self.learner = self._spawn("learner", "trainer.log", *args, env=self._learner_role("trainer", 1))
        return self.learner

    def start_shard(self, shard: int, shards: int) -> subprocess.Popen:
        """Learner shard ``shard`` of ``shards`` (again, after a crash: it resumes from its checkpoints)."""
        self.shard_count = shards
        self.shards[shard] = self._spawn(
            "learner", f"shard-{shard}.log", env=self._learner_role("shard", shards, shard)
        )
        return self.shards[shard]

    def _learner_role(self, role: str, shards: int, shard: int = 0) -> dict[str, str]:
        name = f"shard-{shard}" if role == "shard" else role
        values = {
            "role": role,
            "shards": shards if role == "shard" else 1,
            "shard": shard,
            "checkpoint_dir": self.settings.learner.checkpoint_dir / name,
        }
        return {variable_of("learner", key): str(value) for key, value in values.items()}

    def start_gateway(self) -> subprocess.Popen:
        self.gateway = self._spawn("gateway", "gateway.log")
        return self.gateway

    def start_service(self, workers: int = 1, gateway: bool = False, wait_s: float = 180.0) -> None:
        """The learner, ``workers`` workers and, with ``gateway``, the gateway; back once every one is ready."""
        self.start_learner()
        for _ in range(workers):
            self.start_worker()
        if gateway:
            self.start_gateway()
        self.wait_ready(wait_s)

    def restart_crashed(self) -> list[str]:
        """Start a new process for each one that crashed, with exit codes. One that exited on SIGTERM or SIGINT (a
        stop asked of the whole process group, e.g. Ctrl-C or a service manager) is not restarted."""
        restarted = []

        def crashed(process: subprocess.Popen | None) -> TypeGuard[subprocess.Popen]:
            return process is not None and process.poll() is not None and process.returncode not in ASKED_TO_STOP

        if crashed(self.learner):
            restarted.append(f"learner (exit {self.learner.returncode})")
            if self.shards:
                self.start_trainer(*self.learner_args)
            else:
                self.start_learner(*self.learner_args)
        for shard, process in list(self.shards.items()):
            if crashed(process):
                restarted.append(f"learner shard {shard} (exit {process.returncode})")
                self.start_shard(shard, self.shard_count)
        if crashed(self.gateway):
            restarted.append(f"gateway (exit {self.gateway.returncode})")
            self.start_gateway()
        for i, process in enumerate(self.workers):
            if crashed(process):
                restarted.append(f"worker {i} (exit {process.returncode})")
                self.workers[i] = self._spawn("worker", f"worker-{i}.log")
        return restarted

    def wait_ready(self, timeout_s: float = 60.0, progress: Callable[[list[str], float], None] | None = None) -> None:
        """Wait until every running service process has marked itself ready in Redis (its groups joined);
        ``progress`` hears the roles still waited for and the seconds waited, every 0.1 s."""
        import socket
        import time

        from rlens.redis_clients import sync_redis
        from rlens.service.common.windows import ready_index_key

        redis = sync_redis(self.settings.redis.url.get_secret_value())
        host = socket.gethostname()
        start = time.monotonic()
        deadline = start + timeout_s
        try:
            while True:
                dead = [p for p in self.processes() if p.poll() is not None]
                if dead:
                    raise RuntimeError(
                        f"service process `rlens {cast(list[str], dead[0].args)[3]}` exited with {dead[0].returncode}; see its log in {self.workdir}"
                    )
                prefix = ready_index_key(self.settings.redis.prefix)
                waiting = [
                    p
                    for p in self.processes()
                    if not redis.exists(
                        *(f"{prefix}:{role}:{host}-{p.pid}" for role in ("worker", "learner", "gateway"))
                    )
                ]
                if not waiting:
                    return
                if progress is not None:
                    progress([cast(list[str], p.args)[3] for p in waiting], time.monotonic() - start)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{len(waiting)} service processes not ready after {timeout_s:g} s; see {self.workdir}"
                    )
                time.sleep(0.1)
        finally:
            redis.close()

    def http_urls(self) -> dict[str, str]:
        """Each ready process's HTTP side (/metrics, /healthz, /readyz), by its readiness mark's name (role:host-pid)."""
        from rlens.redis_clients import sync_redis
        from rlens.service.common.windows import ready_urls

        redis = sync_redis(self.settings.redis.url.get_secret_value())
        try:
            return ready_urls(redis, self.settings.redis.prefix)
        finally:
            redis.close()

    def kill(self, process: subprocess.Popen) -> None:
        """SIGKILL one service process, as a crash would, and forget it."""
        process.kill()
        process.wait()
        if process is self.learner:
            self.learner = None
        elif process in self.shards.values():
            self.shards = {i: p for i, p in self.shards.items() if p is not process}
        elif process is self.gateway:
            self.gateway = None
        else:
            self.workers.remove(process)

    def processes(self) -> list[subprocess.Popen]:
        return [p for p in [self.learner, *self.shards.values(), *self.workers, self.gateway] if p is not None]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every service process (they drain, commit and leave their groups), then stop broker and Redis."""
        for process in self.processes():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes():
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for infra in (self.broker, self.redis):
            if infra is not None:
                infra.stop()
        locks.release(self._workdir_lock)
