"""The worker process's app: FastStream subscribers on ``queries`` and ``policy`` around a :class:`Worker`, and its
HTTP side (``/metrics``, ``/healthz``, ``/readyz``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, cast

from faststream import AckPolicy
from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaMessage
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from rlens.messages import (
    EXPERIENCE,
    TENANT_MARK,
    Answer,
    DeadLetter,
    Policy,
    Query,
)
from rlens.service.common.kafka import (
    Topics,
    app_logger,
    dead_letter,
    keep_bytes,
    make_broker,
    parse_or_dead_letter,
    publish_batch,
    publish_dead_letters,
    TopicRestorer,
    typed_publisher,
)
from rlens.service.common.metrics import (
    admin_token,
    StreamLabels,
    WorkerMetrics,
    dead_letter_kind,
    failure_kind,
    http_routes,
    not_ready,
    settings_url,
)
from rlens.service.worker.core import BatchOutput, Worker
from rlens.settings import Settings

log = logging.getLogger("rlens.worker")
REPLY_TIMEOUT_S = 5.0  # a gateway's reply topic must take an answer within this
REPLY_TOPIC_KNOWN_S = 60.0  # a reply topic found registered is trusted this long without asking Redis again
PUBLISH_TRIES = 5  # a batch whose outputs the broker refuses this many times is dead-lettered
RETRY_PAUSE_S = 0.5  # between two tries of a batch whose outputs the broker refused


class Retries:
    """How often each record was read again after its batch's outputs failed to publish (bounded by the records
    in flight: a record is forgotten once its batch went through or was given up)."""

    def __init__(self, tries: int):
        self.tries = tries
        self._counts: Counter[tuple[str, int, int]] = Counter()

    @staticmethod
    def _keys(records) -> list[tuple[str, int, int]]:
        return [(r.topic, r.partition, r.offset) for r in records]

    def spent(self, records) -> bool:
        """Count one more failed try of these records; True once some record has had ``tries``."""
        keys = self._keys(records)
        self._counts.update(keys)
        return max((self._counts[k] for k in keys), default=0) >= self.tries

    def forget(self, records) -> None:
        for key in self._keys(records):
            self._counts.pop(key, None)


def create_worker_app(settings: Settings, core: Worker | None) -> AsgiFastStream:
    """The worker's app: a batch subscriber on ``queries`` (consumer group) and one on ``policy``, and its HTTP side
    (``/metrics``, ``/healthz``, ``/readyz``: :mod:`rlens.service.common.metrics`).

    ``core`` None builds the app of ``settings.strategy`` only to generate the AsyncAPI document (no handler runs then).
    """
    live = cast(Worker, core)  # what the handlers use: they run only in a real worker
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, StreamLabels(settings.metrics_streams))
    topics = Topics.from_settings(settings)
    broker = make_broker(settings)
    consumer = f"worker {core.name}" if core else "worker"
    role = f"worker ({settings.strategy})"
    answers = typed_publisher(
        broker, topics.answers, Answer, role, "one answer per query (at least once; idempotent by query id)"
    )
    experience = typed_publisher(
        broker,
        topics.experience,
        EXPERIENCE[settings.strategy],
        role,
        "what the learner needs to train on an answered query",
    )
    dead_letters = typed_publisher(
        broker,
        topics.dead_letter,
        DeadLetter,
        role,
        "queries and policies that could not be used, byte for byte, with the reason",
    )
    group: dict[str, Any] = {
        "session_timeout_ms": settings.kafka_session_timeout_ms,
        "heartbeat_interval_ms": settings.kafka_heartbeat_ms,
        "fetch_max_wait_ms": settings.kafka_fetch_max_wait_ms,
    }

    @broker.subscriber(
        topics.queries,
        group_id=settings.group("workers"),
        batch=True,
        max_records=settings.worker_batch,
        batch_timeout_ms=20,
        auto_offset_reset="earliest",
        ack_policy=AckPolicy.NACK_ON_ERROR,
        decoder=keep_bytes,
        description="JSON Query messages (schemas/messages/query.schema.json); anything else is dead-lettered",
        **group,
    )
    async def on_queries(bodies: list[bytes], message: KafkaMessage) -> None:
        queries, records, dead = [], {}, []
        for record in message.raw_message:
            parsed = parse_or_dead_letter(Query, record, consumer)
            if isinstance(parsed, DeadLetter):
                dead.append(parsed)
            elif reason := live.rejects(parsed):
                dead.append(dead_letter(record, reason, consumer))
            elif parsed.reply_to is not None and not parsed.reply_to.startswith(topics.reply_prefix):
                dead.append(
                    dead_letter(
                        record,
                        f"reply_to {parsed.reply_to!r} is not a reply topic (they start with {topics.reply_prefix!r})",
                        consumer,
                    )
                )
            elif parsed.stream.startswith(TENANT_MARK) and not live.tokens.query_signed(parsed):
                reason = f"stream {parsed.stream!r} is a gateway tenant's, and no gateway signed this query"
                dead.append(dead_letter(record, reason, consumer))
            elif parsed.query_id in records:
                dead.append(dead_letter(record, f"query id {parsed.query_id} appears twice in one batch", consumer))
            else:
                queries.append(parsed)
                records[parsed.query_id] = record
        if unknown := await unregistered({q.reply_to for q in queries if q.reply_to}):
            for q in [q for q in queries if q.reply_to in unknown]:
                reason = f"reply_to {q.reply_to!r} is no live gateway's reply topic (none registered it in Redis)"
                dead.append(dead_letter(records.pop(q.query_id), reason, consumer))
            queries = [q for q in queries if q.query_id in records]
        out = await live.answer(queries) if queries else BatchOutput()
        dead += [dead_letter(records[qid], reason, consumer) for qid, reason in out.failed.items()]
        started = time.perf_counter()
        try:
            await deliver(queries, out)
        except Exception as exc:  # the broker refused: try again (the batch is read again), within a budget
            await restorer.restore()
            if not retries.spent(message.raw_message):
                await asyncio.sleep(RETRY_PAUSE_S)  # no hot loop against a broker that refuses
                raise
            log.error("gave up publishing a batch of %d queries after %d tries: %r", len(queries), PUBLISH_TRIES, exc)
            reason = f"its outputs could not be published in {PUBLISH_TRIES} tries: {type(exc).__name__}: {exc}"
            dead += [dead_letter(records[q.query_id], reason, consumer) for q in queries]
            queries, out = [], BatchOutput()
        retries.forget(message.raw_message)
        live.stats.dead_lettered += len(dead)
        await publish_dead_letters(dead_letters, dead)
        out.stages["publish"] = time.perf_counter() - started
        if settings.metrics_enabled:
            count(queries, out, dead)
        # returning acks the batch: its offsets are committed only now, after every output was confirmed

    async def deliver(queries: list[Query], out: BatchOutput) -> None:
        """The experience first, then the answers: a retry after a failure in between repeats only experience
        (which the learner joins once), never an answer a client already got."""
        reply_to = {q.query_id: q.reply_to for q in queries if q.reply_to}
        await publish_batch(broker, experience.topic, out.experience)
        # a gateway's query: its feedback token goes to the gateway's reply topic alone, not to the shared topic
        shared = [a.model_copy(update={"feedback_token": ""}) if a.query_id in reply_to else a for a in out.answers]
        await publish_batch(broker, answers.topic, shared)
        await reply(out.answers, reply_to)

    restorer = TopicRestorer(settings)
    retries = Retries(PUBLISH_TRIES)
    known_reply_topics: dict[str, float] = {}  # topic -> when it was last found registered

    async def unregistered(topics: set[str]) -> set[str]:
        """The reply topics no live gateway registered: replying there would make a topic per forged name. Topics
        found registered in the last REPLY_TOPIC_KNOWN_S are not asked again (nor lost while Redis is down)."""
        now = time.monotonic()
        ask = {t for t in topics if now - known_reply_topics.get(t, -REPLY_TOPIC_KNOWN_S) >= REPLY_TOPIC_KNOWN_S}
        if not ask:
            return set()
        try:
            found = await live.windows.registered_reply_topics(ask)
        except (RedisError, OSError) as exc:
            log.warning("Redis unreachable (%s): reply topics %s not confirmed", exc, ", ".join(sorted(ask)))
            found = set()
        known_reply_topics.update({t: now for t in found})
        return ask - found

    async def reply(answers: list[Answer], reply_to: dict[str, str]) -> None:
        """Each answer also to its gateway's reply topic; one that fails within REPLY_TIMEOUT_S is logged and counted
        (the answer is on ``answers`` anyway), so no reply topic can hold the batch."""
        sent = [(live.tokens.sign(a), reply_to[a.query_id]) for a in answers if a.query_id in reply_to]
        results = await asyncio.gather(
            *(
                asyncio.wait_for(
                    broker.publish(a.model_dump_json().encode(), topic, key=a.query_id.encode()), REPLY_TIMEOUT_S
                )
                for a, topic in sent
            ),
            return_exceptions=True,
        )
        for (a, topic), result in zip(sent, results):
            if isinstance(result, BaseException):
                metrics.reply_failures.inc()
                log.error("could not reply to %s for query %s: %r", topic, a.query_id, result)

    def count(queries: list[Query], out: BatchOutput, dead: list[DeadLetter]) -> None:
        """The batch's metrics, summed per label first (one update per label value, not per query)."""
        metrics.batch_size.observe(len(queries) + len(dead))
        for stream, n in Counter(metrics.stream(q.stream) for q in queries).items():
            metrics.queries.labels(stream).inc(n)
        for stage, seconds in out.stages.items():
            metrics.stage_seconds.labels(stage).observe(seconds)
        for stream, n in Counter(metrics.stream(a.stream) for a in out.answers).items():
            metrics.answers.labels(stream).inc(n)
        for model, n in Counter(model for a in out.answers for model in a.chosen_models).items():
            metrics.model_selected.labels(model).inc(n)
        for (model, kind), n in Counter(
            (f.model, failure_kind(f.reason)) for a in out.answers for f in a.failures
        ).items():
            metrics.model_failures.labels(model, kind).inc(n)
        for a in out.answers:
            metrics.models_called.observe(len(a.called_models))
        if unanswered := sum(not a.answered_models for a in out.answers):
            metrics.no_model_answered.inc(unanswered)
        for kind, n in Counter(dead_letter_kind(letter.reason) for letter in dead).items():
            metrics.dead_letters.labels(kind).inc(n)
        metrics.policy_version.set(live.policy_version)
        metrics.policy_epoch.set(live.policy_epoch)
        for stream, window in live.windows_read().items():
            label = metrics.stream(stream)
            for model, reliability in zip(live.models, window.reliability().tolist()):
                metrics.window_reliability.labels(label, model).set(reliability)

    @broker.subscriber(
        topics.policy,
        auto_offset_reset="earliest",
        decoder=keep_bytes,
        fetch_max_wait_ms=settings.kafka_fetch_max_wait_ms,
        description="JSON Policy messages (schemas/messages/policy.schema.json), read by every worker",
    )
    async def on_policy(body: bytes, message: KafkaMessage) -> None:
        parsed = parse_or_dead_letter(Policy, message.raw_message, consumer)
        if not isinstance(parsed, DeadLetter) and (reason := live.receive_policy(parsed)):
            parsed = dead_letter(message.raw_message, reason, consumer)
            metrics.policies_rejected.inc()
        if isinstance(parsed, DeadLetter):
            metrics.dead_letters.labels(dead_letter_kind(parsed.reason)).inc()
            await publish_dead_letters(dead_letters, [parsed])

    joined: list[bool] = []
    app = AsgiFastStream(
        broker,
        asgi_routes=http_routes(registry, lambda: not_ready(core, joined), admin_token(settings)),
        logger=app_logger(),
    )
    background: list[asyncio.Task] = []

    @app.after_startup
    async def ready() -> None:
        joined.append(True)
        log.info(
            "worker %s ready (%s): consumer group %s joined; metrics and health on %s",
            live.name,
            settings.strategy,
            settings.group("workers"),
            settings_url(settings),
        )
        background.append(asyncio.create_task(live.windows.keep_ready("worker", live.name, settings_url(settings))))

    @app.on_shutdown
    async def leaving() -> None:
        for task in background:  # the mark's renewal first, or it would set the mark again
            task.cancel()
        await live.windows.mark_ready("worker", live.name, ready=False)

    return app
