"""Where the tests' Kafka is: their own tansu (the default), or the cluster at ``RLENS_TEST_KAFKA_BOOTSTRAP`` (a real
Apache Kafka, e.g. `infra/kafka/kafka.sh start`), shared by every test, each stack on topics, consumer groups and
Redis keys of its own (a fresh prefix), so the same suite runs on both."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlens.local.servers import LocalBroker
from rlens.local.stack import LocalStack
from rlens.settings import Settings

EXTERNAL = os.environ.get("RLENS_TEST_KAFKA_BOOTSTRAP") or None

# a test that stops or restarts the broker it runs on: only on the tests' own tansu (memory storage)
own_broker_only = pytest.mark.skipif(
    EXTERNAL is not None, reason="stops or restarts the tests' own tansu broker (memory storage)"
)


@dataclass
class ExternalBroker:
    """A broker the tests do not run: stopping it is a no-op."""

    bootstrap: str

    def stop(self) -> None:
        pass


def broker_for_tests() -> LocalBroker | ExternalBroker:
    return ExternalBroker(EXTERNAL) if EXTERNAL else LocalBroker()


def own_prefixes(config: Settings) -> Settings:
    """``config`` on topics, groups and Redis keys of its own when the broker is shared."""
    if EXTERNAL is None:
        return config
    run = uuid.uuid4().hex[:10]
    return config.updated({"topic_prefix": f"t{run}.", "redis_prefix": f"t{run}"})


def stack_for_tests(config: Settings, workdir: Path, **options) -> LocalStack:
    """A :class:`LocalStack` on the tests' broker (and its own prefixes there)."""
    if EXTERNAL is not None:
        options.setdefault("kafka_bootstrap", EXTERNAL)
    return LocalStack(own_prefixes(config), workdir, **options)


def replay_stack_for_tests(workdir: Path, overrides: dict | None = None, **options) -> LocalStack:
    """:func:`stack_for_tests` in ``workdir/stack`` with the bundled stream's models as replay backends (their pool in
    ``workdir/pool.json``), short group timeouts and a free gateway port; ``overrides``: other settings; ``options``:
    LocalStack's (e.g. ``redis_url``)."""
    from rlens.local.stack import write_replay_pool
    from rlens.settings import settings

    pool = write_replay_pool(settings().service.demo_data, workdir / "pool.json")
    update = {"pool_file": pool, "kafka_session_timeout_ms": 2000, "kafka_heartbeat_ms": 500, "gateway_port": 0}
    return stack_for_tests(settings().updated(update | (overrides or {})), workdir / "stack", **options)
