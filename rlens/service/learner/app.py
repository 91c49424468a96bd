"""The learner process's app: FastStream subscribers on ``experience`` and ``feedback`` (a shard: its partitions of
them; the trainer: on ``transitions`` instead), each batch to :class:`RecordBatches`, around a :class:`LearnerCore`,
and the HTTP side (``/metrics``, ``/healthz``, ``/readyz``, the dashboard)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

from faststream import AckPolicy
from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaBroker, TopicPartition
from prometheus_client import CollectorRegistry

from rlens.messages import EXPERIENCE, TRANSITION, DeadLetter, DriftEvent, Feedback, Policy
from rlens.service.common.health import Readiness, admin_token, http_routes, settings_url
from rlens.service.common.kafka import (
    RawMessage,
    group_options,
    Topics,
    TopicRestorer,
    app_logger,
    SUBSCRIBER,
    holds_nothing,
    keep_topics,
    woken_by_records,
    make_broker,
    parse_or_dead_letter,
    policy_reader,
    publish,
    typed_publisher,
)
from rlens.service.common.metrics import LearnerMetrics, StreamLabels
from rlens.service.learner.batches import RecordBatches
from rlens.service.learner.core import LearnerCore
from rlens.service.learner.dashboard import dashboard_routes
from rlens.service.learner.lease import keep_lease, lease_holder
from rlens.settings import Settings

log = logging.getLogger("rlens.learner")


def publishers(broker: KafkaBroker, settings: Settings, topics: Topics) -> tuple[Any, Any, Any, Any]:
    """The learner's publishers: policies, dead letters, drift events, and a shard's transitions (else None)."""
    transitions = None
    if settings.learner.role == "shard":
        transitions = typed_publisher(
            broker,
            topics.transitions,
            TRANSITION[settings.service.strategy],
            "learner shard",
            "each query the shard joined, for the trainer",
        )
    return (
        typed_publisher(
            broker, topics.policy, Policy, "learner", "a new version of every agent's weights after each update"
        ),
        typed_publisher(
            broker,
            topics.dead_letter,
            DeadLetter,
            "learner",
            "feedback and experience that could not be used, with the reason",
        ),
        typed_publisher(
            broker, topics.drift, DriftEvent, "learner", "a change found in one signal of one stream (rlens.drift)"
        ),
        transitions,
    )


def shard_partitions(partitions: int, shards: int, shard: int) -> list[int]:
    """The partitions of ``experience`` and ``feedback`` a shard joins: p mod ``shards`` = ``shard``. Both topics
    are keyed by query id and have the same count, so a query's two halves are in the same partition number."""
    return [p for p in range(partitions) if p % shards == shard]


def record_options(settings: Settings) -> dict[str, Any]:
    """The learner's subscribers: its consumer group, batches of up to 256 records, offsets committed by hand (up to
    the checkpointed ones), fetches off the request path (:func:`group_options`)."""
    return {
        "group_id": settings.group("learner"),
        "batch": True,
        "max_records": 256,
        "auto_offset_reset": "earliest",
        "ack_policy": AckPolicy.MANUAL,
        **SUBSCRIBER,
        **group_options(settings, background=True),
        "fetch_min_bytes": settings.learner.fetch_min_bytes,
    }


def record_subscribers(
    broker: KafkaBroker, settings: Settings, topics: Topics, experience: str, partitions: int
) -> tuple[Any, Any]:
    """The subscribers on ``experience`` (whose messages are the model named ``experience``) and ``feedback``
    (:func:`record_options`); a shard's are assigned its partitions (:func:`shard_partitions` of ``partitions``)."""
    options = record_options(settings)

    def subscriber(topic: str, description: str) -> Any:
        if settings.learner.role == "shard":
            owned = shard_partitions(partitions, settings.learner.shards, settings.learner.shard)
            assigned = [TopicPartition(topic, p, declare=False) for p in owned]
            return woken_by_records(broker.subscriber(partitions=assigned, description=description, **options))
        return woken_by_records(broker.subscriber(topic, description=description, **options))

    return (
        subscriber(topics.experience, f"JSON {experience} messages from the {settings.service.strategy} workers"),
        subscriber(
            topics.feedback,
            "JSON Feedback messages: label, reference or reward per query id, any delay, duplicates allowed "
            "(schemas/messages/feedback.schema.json)",
        ),
    )


def policy_subscriber(
    broker: KafkaBroker, settings: Settings, topics: Topics, batches: RecordBatches, policies: Any
) -> Any:
    """The subscriber on the whole ``policy`` topic (:func:`policy_reader`): each policy to the core, under the
    batches' lock, and what it answers published."""
    policy_history = broker.subscriber(
        topics.policy,
        **SUBSCRIBER,
        **policy_reader(settings, "learner"),
        description="JSON Policy messages: an operator's (rlens policy promote / rollback) are adopted, and a "
        "restarted gated learner learns from the topic's history what the workers serve",
    )

    @policy_history
    async def adopt_policy(body: bytes, message: RawMessage) -> None:
        policy = parse_or_dead_letter(Policy, message.raw_message, "learner")
        if isinstance(policy, DeadLetter):
            return  # the workers dead-letter it
        async with batches.lock:
            replies = batches.core.on_policy(policy) + batches.core.take_policies()
        await publish(policies, replies)

    return policy_history


def record_handlers(
    broker: KafkaBroker,
    settings: Settings,
    topics: Topics,
    batches: RecordBatches,
    core: LearnerCore | None,
    partitions: int,
) -> dict[str, Any]:
    """The role's subscribers by topic, each handing its batches to ``batches``: the trainer's on ``transitions``,
    the others' on ``experience`` and ``feedback`` (a shard: its share of their ``partitions``)."""
    read: dict[str, Any] = {}
    if settings.learner.role == "trainer":
        transition_model = TRANSITION[settings.service.strategy]
        read[topics.transitions] = woken_by_records(
            broker.subscriber(
                topics.transitions,
                description=f"JSON {transition_model.__name__} messages: the queries the learner shards joined",
                **record_options(settings),
            )
        )

        @read[topics.transitions]
        async def on_transitions(bodies: list[bytes], message: RawMessage) -> None:
            await batches.handle(message, transition_model, topics.transitions)

    else:
        experience_model = core.trainer.experience if core else EXPERIENCE[settings.service.strategy]
        experience, feedback = record_subscribers(broker, settings, topics, experience_model.__name__, partitions)
        read |= {topics.experience: experience, topics.feedback: feedback}

        @experience
        async def on_experience(bodies: list[bytes], message: RawMessage) -> None:
            await batches.handle(message, experience_model, topics.experience)

        @feedback
        async def on_feedback(bodies: list[bytes], message: RawMessage) -> None:
            await batches.handle(message, Feedback, topics.feedback)

    return read


def create_learner_app(settings: Settings, core: LearnerCore | None, partitions: int = 0) -> AsgiFastStream:
    """Subscribers on ``experience`` and ``feedback`` (one group, manual commits up to the checkpointed offsets; a
    shard: its share of their ``partitions``), or the trainer's on ``transitions``, and the HTTP side.

    ``core`` None builds the app only to generate the AsyncAPI document (no handler runs then).
    """
    live = cast(LearnerCore, core)  # what the handlers use: they run only in a real learner
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry, StreamLabels(settings.metrics.streams))
    if core is not None and settings.metrics.enabled:
        core.metrics = metrics
        metrics.checkpoint_age.set_function(lambda: time.monotonic() - core.last_checkpoint)
    topics = Topics.from_settings(settings)
    broker = make_broker(settings)
    policies, dead_letters, drift_events, transitions = publishers(broker, settings, topics)
    batches = RecordBatches(live, metrics, (policies, dead_letters, drift_events, transitions), TopicRestorer(settings))
    role = settings.learner.role
    read = record_handlers(broker, settings, topics, batches, core, partitions)  # topic -> its subscriber
    background: list[asyncio.Task] = []  # the lease's renewal, idle checkpoints, the log-end watch, the topics
    # a shard trains nothing: the trainer (or the one learner) reads the policy topic and publishes policies
    policy_history = policy_subscriber(broker, settings, topics, batches, policies) if role != "shard" else None

    readiness = Readiness("learner", core.name if core else "", settings_url(settings))
    routes = http_routes(
        registry,
        readiness.not_ready,
        admin_token(settings),
        dashboard_routes(core.dashboard.snapshot) if core else [],
    )
    app = AsgiFastStream(broker, asgi_routes=routes, logger=app_logger())

    @app.on_startup
    async def leased() -> None:  # run_learner took the group's lease (claim_group) before the app started
        background.extend(
            [
                asyncio.create_task(keep_lease(settings, live)),
                asyncio.create_task(batches.checkpoint_when_idle()),
                asyncio.create_task(batches.watch_logs()),
                # a broker that lost its topics: made again, and named if a producer made them with its defaults
                asyncio.create_task(keep_topics(settings, (*read, topics.policy))),
            ]
        )

    @app.after_startup
    async def announce() -> None:  # workers that start after a learner restart get the current policy at once
        for topic, subscriber in read.items():
            batches.watch(topic, subscriber.consumer)  # new logs are looked for before the first batch too
        if policy_history is None:  # a shard
            readiness.start(live.windows)
            log.info(
                "learner shard %d of %d (%s) ready: partitions %s of %s and %s; metrics, health and the dashboard "
                "on %s",
                settings.learner.shard,
                settings.learner.shards,
                live.name,
                shard_partitions(partitions, settings.learner.shards, settings.learner.shard),
                topics.experience,
                topics.feedback,
                readiness.url,
            )
            return
        announced = live.announcement()
        if announced is None and await holds_nothing(policy_history.consumer, topics.policy):
            announced = live.first_policy()  # gated and fresh: the seeded policy, live, so there is one to roll back to
        await publish(policies, ([announced] if announced is not None else []) + live.take_policies())
        readiness.start(live.windows)
        log.info(
            "learner %s ready (%s): policy v%d, epoch %d; metrics, health and the dashboard on %s",
            live.name,
            settings.service.strategy,
            live.version,
            live.epoch,
            readiness.url,
        )

    @app.on_shutdown
    async def final_checkpoint() -> None:
        async with batches.lock:
            if not live.handed:  # a shard's joins not handed on: the checkpoint before them is where to resume
                live.checkpoint()
        await readiness.stop()
        await live.windows.release(settings.group("learner"), lease_holder(live))

    return app
