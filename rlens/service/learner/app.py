"""The learner process's app: FastStream subscribers on ``experience`` and ``feedback`` around a
:class:`LearnerCore`, the group's lease, and the HTTP side (``/metrics``, ``/healthz``, ``/readyz``, the dashboard)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

from aiokafka import AIOKafkaConsumer
from faststream import AckPolicy
from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaMessage
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlens.messages import EXPERIENCE, DeadLetter, DriftEvent, Feedback, Policy
from rlens.service.learner.dashboard import dashboard_routes
from rlens.service.common.kafka import (
    Topics,
    app_logger,
    dead_letter,
    keep_bytes,
    make_broker,
    parse_or_dead_letter,
    publish,
    publish_dead_letters,
    TopicRestorer,
    typed_publisher,
)
from rlens.service.common.metrics import (
    LearnerMetrics,
    StreamLabels,
    admin_token,
    dead_letter_kind,
    http_routes,
    not_ready,
    settings_url,
)
from rlens.service.common.windows import LEASE_TTL_S, RedisWindows
from rlens.service.learner.core import LearnerCore, partition_of
from rlens.settings import Settings

log = logging.getLogger("rlens.learner")
COMMIT_TIMEOUT_S = 5.0  # a commit not confirmed by then is given up (and tried again with a later batch)
COMMIT_PAUSE_S = 30.0  # ... COMMIT_PAUSE_S later


def consumer_of(message: KafkaMessage) -> AIOKafkaConsumer:
    """The aiokafka consumer a FastStream Kafka message came from (FastStream types it as a narrower protocol)."""
    return cast(AIOKafkaConsumer, message.consumer)


def lease_holder(core: LearnerCore) -> str:
    """How a learner names itself in its group's lease: process | checkpoint directory."""
    return f"{core.name}|{core.checkpoints.directory.resolve()}"


async def claim_group(settings: Settings, core: LearnerCore) -> None:
    """One learner per consumer group: take the group's lease in Redis, or RuntimeError naming who holds it. A holder
    on our checkpoint directory is gone (we hold that directory's lock): a restart after a crash takes over."""
    windows = RedisWindows(
        Redis.from_url(settings.redis_url.get_secret_value(), socket_connect_timeout=2),
        core.windows.n_models,
        1,
        settings.redis_prefix,
    )
    me = lease_holder(core)
    try:
        holder = await windows.lease(settings.group("learner"), me)
        if holder is not None and holder.split("|", 1)[-1] == me.split("|", 1)[-1]:
            holder = await windows.lease(settings.group("learner"), me, take_over=True)
    except (RedisError, OSError) as exc:
        log.warning(
            "Redis unreachable (%s): cannot check that no other learner runs in group %s",
            exc,
            settings.group("learner"),
        )
        holder = None
    finally:
        await windows.redis.aclose()
    if holder is not None:
        raise RuntimeError(
            f"learner {holder.split('|')[0]} holds consumer group {settings.group('learner')!r}: one learner per group (stop it, or wait {LEASE_TTL_S} s after it died)"
        )


def create_learner_app(settings: Settings, core: LearnerCore | None) -> AsgiFastStream:
    """Subscribers on ``experience`` and ``feedback`` (one group, manual commits up to the checkpointed offsets), and
    the HTTP side (``/metrics``, ``/healthz``, ``/readyz``: :mod:`rlens.service.common.metrics`).

    ``core`` None builds the app only to generate the AsyncAPI document (no handler runs then).
    """
    live = cast(LearnerCore, core)  # what the handlers use: they run only in a real learner
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry, StreamLabels(settings.metrics_streams))
    if core is not None and settings.metrics_enabled:
        core.metrics = metrics
        metrics.checkpoint_age.set_function(lambda: time.monotonic() - core.last_checkpoint)
    topics = Topics.from_settings(settings)
    broker = make_broker(settings)
    policies_out = typed_publisher(
        broker, topics.policy, Policy, "learner", "a new version of every agent's weights after each update"
    )
    dead_letters = typed_publisher(
        broker,
        topics.dead_letter,
        DeadLetter,
        "learner",
        "feedback and experience that could not be used, with the reason",
    )
    drift_out = typed_publisher(
        broker, topics.drift, DriftEvent, "learner", "a change found in one signal of one stream (rlens.drift)"
    )
    options: dict[str, Any] = {
        "group_id": settings.group("learner"),
        "batch": True,
        "max_records": 256,
        "batch_timeout_ms": 20,
        "auto_offset_reset": "earliest",
        "ack_policy": AckPolicy.MANUAL,
        "decoder": keep_bytes,
        "session_timeout_ms": settings.kafka_session_timeout_ms,
        "heartbeat_interval_ms": settings.kafka_heartbeat_ms,
        "fetch_max_wait_ms": settings.kafka_fetch_max_wait_ms,
    }
    lease_name = lease_holder(core) if core else ""
    committed: dict[str, int] = {}  # topic -> version last committed for it
    background: list[asyncio.Task] = []
    marking: list[asyncio.Task] = []  # the readiness mark's renewal
    lock = asyncio.Lock()  # the two subscribers run as separate tasks; the core is not re-entrant
    restorer = TopicRestorer(settings)

    async def detect_new_logs(message: KafkaMessage) -> None:
        below = live.below_offsets(message.raw_message)
        if below:
            partitions = {key: partition_of(key) for key in below}
            ends = await consumer_of(message).end_offsets(list(partitions.values()))
            for key, tp in partitions.items():
                if ends.get(tp, live.offsets[key]) < live.offsets[key]:
                    live.new_log(key, ends[tp])

    async def dead_letter_out(letters: list[DeadLetter]) -> None:
        for letter in letters:
            metrics.dead_letters.labels(dead_letter_kind(letter.reason)).inc()
        await publish_dead_letters(dead_letters, letters)

    async def handle(message: KafkaMessage, model: type, topic: str) -> None:
        try:
            await handle_batch(message, model, topic)
        except Exception:  # a publish or a commit the broker refused: it may have lost the topics (restarted empty)
            await restorer.restore()
            raise

    async def handle_batch(message: KafkaMessage, model: type, topic: str) -> None:
        kind = "feedback" if model is Feedback else "experience"
        async with lock:
            await detect_new_logs(message)
            await live.apply_windows()  # what a Redis outage left in the backlog
            for record in message.raw_message:
                if live.already_seen(record):
                    continue
                metrics.records.labels(kind).inc()
                parsed = parse_or_dead_letter(model, record, "learner")
                if isinstance(parsed, DeadLetter):
                    await dead_letter_out([parsed])  # before any checkpoint can mark this record as done
                    continue
                try:
                    policy, rejected = await (
                        live.on_feedback(parsed, record) if model is Feedback else live.on_experience(parsed, record)
                    )
                except Exception as exc:  # one record's failure must not stop the others
                    log.exception("record %s:%d@%d failed", record.topic, record.partition, record.offset)
                    live.stats.failed_records += 1
                    policy, rejected = (
                        None,
                        dead_letter(record, f"learner failed on it: {type(exc).__name__}: {exc}", "learner"),
                    )
                await dead_letter_out(([rejected] if rejected else []) + live.take_dead_letters())
                await publish(drift_out, live.take_drift_events())
                # a restart re-announces its checkpoint's policy under a new epoch
                await publish(policies_out, [policy] if policy else [])
            await live.apply_windows()  # the batch's outcomes, in one round trip
            metrics.pending.labels("experience").set(len(live.experience))
            metrics.pending.labels("feedback").set(len(live.feedback))
            metrics.window_backlog.set(len(live.window_backlog))
            metrics.policy_version.set(live.version)
            if live.checkpoint_due():
                await asyncio.to_thread(live.checkpoint)  # off the event loop (the lock keeps the state still)
            if committed.get(topic) != live.checkpoints.count:
                offsets = {
                    tp: o for tp, o in live.commit_offsets(topic).items() if tp in consumer_of(message).assignment()
                }
                if offsets and not await commit(consumer_of(message), offsets):
                    return  # committed with a later batch: the checkpoint is what a restart resumes from
                committed[topic] = live.checkpoints.count

    commits_paused_until = [0.0]

    async def commit(consumer, offsets) -> bool:
        """Commit, or give up after COMMIT_TIMEOUT_S (and try no other for COMMIT_PAUSE_S): aiokafka retries a
        commit the broker refuses (a broker that lost the topic, say) for as long as it is let, and a learner
        waiting on it would join nothing. The checkpoint holds the offsets a restart resumes from either way."""
        if time.monotonic() < commits_paused_until[0]:
            return False
        try:
            await asyncio.wait_for(consumer.commit(offsets), COMMIT_TIMEOUT_S)
        except TimeoutError:
            log.warning("offsets not committed within %g s; none is tried for %g s", COMMIT_TIMEOUT_S, COMMIT_PAUSE_S)
            commits_paused_until[0] = time.monotonic() + COMMIT_PAUSE_S
            await restorer.restore()
            return False
        return True

    experience_model = core.trainer.experience if core else EXPERIENCE[settings.strategy]

    @broker.subscriber(
        topics.experience,
        description=f"JSON {experience_model.__name__} messages from the {settings.strategy} workers",
        **options,
    )
    async def on_experience(bodies: list[bytes], message: KafkaMessage) -> None:
        await handle(message, experience_model, topics.experience)

    @broker.subscriber(
        topics.feedback,
        description="JSON Feedback messages: label, reference or reward per query id, any delay, duplicates allowed (schemas/messages/feedback.schema.json)",
        **options,
    )
    async def on_feedback(bodies: list[bytes], message: KafkaMessage) -> None:
        await handle(message, Feedback, topics.feedback)

    joined: list[bool] = []
    routes = http_routes(
        registry,
        lambda: not_ready(core, joined),
        admin_token(settings),
        dashboard_routes(core.dashboard.snapshot) if core else [],
    )
    app = AsgiFastStream(broker, asgi_routes=routes, logger=app_logger())

    @app.on_startup
    async def leased() -> None:  # run_learner took the group's lease (claim_group) before the app started
        background.append(asyncio.create_task(keep_lease()))
        background.append(asyncio.create_task(checkpoint_when_idle()))

    async def checkpoint_when_idle() -> None:
        """What the last batches did reaches a checkpoint even when no further record comes."""
        while True:
            await asyncio.sleep(live.checkpoint_every_s)
            async with lock:
                if live.checkpoint_due():
                    await asyncio.to_thread(live.checkpoint)

    async def keep_lease() -> None:
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            try:
                if holder := await live.windows.lease(settings.group("learner"), lease_name):
                    log.error("learner %s took consumer group %s", holder, settings.group("learner"))
            except (RedisError, OSError) as exc:
                log.warning("Redis unreachable (%s): lease of group %s not renewed", exc, settings.group("learner"))

    @app.after_startup
    async def announce() -> None:  # workers that start after a learner restart get the current policy at once
        if live.version > 0:
            await publish(policies_out, [live.current_policy()])
        joined.append(True)
        marking.append(asyncio.create_task(live.windows.keep_ready("learner", live.name, settings_url(settings))))
        log.info(
            "learner %s ready (%s): policy v%d, epoch %d; metrics, health and the dashboard on %s",
            live.name,
            settings.strategy,
            live.version,
            live.epoch,
            settings_url(settings),
        )

    @app.on_shutdown
    async def final_checkpoint() -> None:
        async with lock:
            live.checkpoint()
        for task in marking:  # the mark's renewal first, or it would set the mark again
            task.cancel()
        await live.windows.mark_ready("learner", live.name, ready=False)
        await live.windows.release(settings.group("learner"), lease_name)

    return app
