"""What the service benchmarks share: a fresh local stack serving the bundled stream on `replay` backends, and
traffic that cycles through a stream with fresh query ids."""

from __future__ import annotations

import shutil
import urllib.request
import uuid
from pathlib import Path

import numpy as np

from rlens.focal.engine import FocalEngine
from rlens.messages import Behaviour, Experience, Query
from rlens.local.kafka import LocalKafka
from rlens.local.load import Outcome
from rlens.local.stack import LocalStack, write_replay_pool
from rlens.settings import settings


def replay_stack(
    workdir: Path,
    partitions: int = 4,
    kafka: str | None = None,
    *,
    redis_url: str | None = None,
    fast_failover: bool = True,
    **overrides,
) -> LocalStack:
    """A local stack (its own tansu broker, or the Apache Kafka at ``kafka`` on topics and groups of its own, its
    clients' fetch waits those `rlens up` gives its own Apache Kafka; and its own redis-server, or the Redis at
    ``redis_url``) in an emptied ``workdir`` (a cold start: no checkpoint of an earlier run), its pool the bundled
    stream's models as `replay` backends; ``fast_failover``: group sessions of 2 s with a heartbeat every 0.5 s (a
    killed worker's partitions move at once), else the service's defaults (the latency benchmarks: a stack as it is
    run); ``partitions`` for the per-query topics; ``overrides``: other settings."""
    shutil.rmtree(workdir, ignore_errors=True)
    pool = write_replay_pool(settings().service.demo_data, workdir / "pool.json")
    update: dict = {"pool_file": pool.resolve()}
    if fast_failover:
        update |= {"kafka_session_timeout_ms": 2000, "kafka_heartbeat_ms": 500}
    if kafka:
        update |= {
            "topic_prefix": f"b{uuid.uuid4().hex[:8]}.",
            "kafka_fetch_max_wait_ms": LocalKafka.FETCH_MAX_WAIT_MS,
            "kafka_background_fetch_max_wait_ms": LocalKafka.BACKGROUND_FETCH_MAX_WAIT_MS,
        }
    update |= overrides
    return LocalStack(settings().updated(update), workdir, partitions, kafka_bootstrap=kafka, redis_url=redis_url)


def cycled(stream: list[tuple[Query, Outcome]], prefix: str, n: int) -> list[tuple[Query, Outcome]]:
    """``n`` queries cycling through ``stream``, with the query ids ``prefix-0``, ``prefix-1``, ..."""
    return [
        (stream[i % len(stream)][0].model_copy(update={"query_id": f"{prefix}-{i}"}), stream[i % len(stream)][1])
        for i in range(n)
    ]


def uniform_experience(
    query_id: str = "q", stream: str = "s", explored: bool = False, behaviour: bool = False
) -> Experience:
    """A valid 5-model, 4-choice experience record: a fresh engine's decision over uniform answers, the models all
    voting choice 1 (the learner benchmarks' and the fuzzer's template); with ``behaviour``, the called models'
    distributions logged as a worker logs them (what the learner writes calibration rows and the OPE log from)."""
    engine = FocalEngine(5, seed=0)
    decision = engine.decide(stream, 4, greedy=not explored)[0]
    fused = engine.fuse(decision, np.full((5, 4), 0.25))
    logged = (
        Behaviour(
            explore_rate=0.05,
            probe=False,
            greedy_pool=decision.pool.tolist(),
            greedy_answer=1,
            propensity=0.5,
            model_probs=[[0.1, 0.6, 0.2, 0.1] if called else [] for called in decision.pool.tolist()],
            reliability=[0.7] * 5,
            label_prior=[0.25] * 4,
        )
        if behaviour
        else None
    )
    return Experience(
        query_id=query_id,
        stream=stream,
        policy_version=0,
        n_choices=4,
        decider_state=decision.state.tolist(),
        critic_state=fused.critic_state.tolist(),
        pool=decision.pool.tolist(),
        pool_logp=decision.pool_logp,
        predictions=[1] * 5,
        fusion_features=fused.features.tolist(),
        answer_index=1,
        answer_logp=fused.answer_logp,
        explored=explored,
        behaviour=logged,
    )


def learner_joined(url: str) -> float:
    """Transitions the learner at ``url`` joined so far, all streams (its /metrics)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("rlens_learner_joined_total")
    )
