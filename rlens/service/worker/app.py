"""The worker process's app: FastStream subscribers on ``queries`` (each batch to :class:`QueryBatches`) and
``policy`` around a :class:`Worker`, and its HTTP side (``/metrics``, ``/healthz``, ``/readyz``)."""

from __future__ import annotations

import logging
from typing import Any, cast

from faststream import AckPolicy
from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaBroker
from prometheus_client import CollectorRegistry

from rlens.messages import EXPERIENCE, Answer, DeadLetter, Policy
from rlens.service.common.health import Readiness, admin_token, http_routes, settings_url
from rlens.service.common.kafka import (
    RawMessage,
    group_options,
    Topics,
    app_logger,
    dead_letter,
    SUBSCRIBER,
    woken_by_records,
    make_broker,
    parse_or_dead_letter,
    policy_reader,
    publish_dead_letters,
    typed_publisher,
)
from rlens.service.common.metrics import StreamLabels, WorkerMetrics, dead_letter_kind
from rlens.service.worker.batches import QueryBatches
from rlens.service.worker.base import Worker
from rlens.settings import Settings

log = logging.getLogger("rlens.worker")


def declare_publishers(broker: KafkaBroker, topics: Topics, strategy: str) -> Any:
    """The worker's publishers as the AsyncAPI document shows them (answers and experience go out through
    :func:`rlens.service.common.kafka.publish_batch`); returns the dead letters' one."""
    role = f"worker ({strategy})"
    typed_publisher(
        broker, topics.answers, Answer, role, "one answer per query (at least once; idempotent by query id)"
    )
    typed_publisher(
        broker, topics.experience, EXPERIENCE[strategy], role, "what the learner needs to train on an answered query"
    )
    return typed_publisher(
        broker,
        topics.dead_letter,
        DeadLetter,
        role,
        "queries and policies that could not be used, byte for byte, with the reason",
    )


def create_worker_app(
    settings: Settings, core: Worker | None, call_attributes: dict[str, dict] | None = None
) -> AsgiFastStream:
    """The worker's app: a batch subscriber on ``queries`` (consumer group) and one on ``policy``, and its HTTP side.
    ``call_attributes``: each model's attributes on its call spans (:func:`model_span_attributes`).

    ``core`` None builds the app of ``settings.strategy`` only to generate the AsyncAPI document (no handler runs then).
    """
    live = cast(Worker, core)  # what the handlers use: they run only in a real worker
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, StreamLabels(settings.metrics.streams))
    topics = Topics.from_settings(settings)
    broker = make_broker(settings)
    consumer = f"worker {core.name}" if core else "worker"
    dead_letters = declare_publishers(broker, topics, settings.service.strategy)
    batches = QueryBatches(settings, live, broker, dead_letters, metrics, consumer, call_attributes or {})
    if core is not None and core.cache is not None and settings.metrics.enabled:
        core.cache.count = lambda model, result: metrics.model_cache.labels(model, result).inc()

    queries = broker.subscriber(
        topics.queries,
        group_id=settings.group("workers"),
        batch=True,
        max_records=settings.worker.batch,
        auto_offset_reset="earliest",
        ack_policy=AckPolicy.NACK_ON_ERROR,
        **SUBSCRIBER,
        description="JSON Query messages (schemas/messages/query.schema.json); anything else is dead-lettered",
        **group_options(settings),
    )

    @woken_by_records(queries, on_lag=metrics.queries_lag.set if settings.metrics.enabled else None)
    async def on_queries(bodies: list[bytes], message: RawMessage) -> None:
        await batches.handle(message.raw_message)  # returning acks the batch: its offsets are committed only now

    @broker.subscriber(
        topics.policy,
        **SUBSCRIBER,
        **policy_reader(settings, "workers"),
        description="JSON Policy messages (schemas/messages/policy.schema.json), read whole by every worker",
    )
    async def on_policy(body: bytes, message: RawMessage) -> None:
        parsed = parse_or_dead_letter(Policy, message.raw_message, consumer)
        if not isinstance(parsed, DeadLetter) and (reason := live.receive_policy(parsed)):
            parsed = dead_letter(message.raw_message, reason, consumer)
            metrics.policies_rejected.inc()
        if isinstance(parsed, DeadLetter):
            metrics.dead_letters.labels(dead_letter_kind(parsed.reason)).inc()
            await publish_dead_letters(dead_letters, [parsed])

    readiness = Readiness("worker", core.name if core else "", settings_url(settings))
    app = AsgiFastStream(
        broker, asgi_routes=http_routes(registry, readiness.not_ready, admin_token(settings)), logger=app_logger()
    )

    @app.after_startup
    async def ready() -> None:
        readiness.start(
            live.windows, live.windows.keep_pool_costs(settings.service.strategy, live.models, live.costs.tolist())
        )
        log.info(
            "worker %s ready (%s): consumer group %s joined; metrics and health on %s",
            live.name,
            settings.service.strategy,
            settings.group("workers"),
            readiness.url,
        )

    app.on_shutdown(readiness.stop)
    return app
