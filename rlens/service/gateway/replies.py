"""The subscriber on a gateway replica's reply topic: answers handed to the waiting requests, the rest dead-lettered."""

from __future__ import annotations

from faststream import AckPolicy
from faststream.kafka import KafkaBroker

from rlens.messages import Answer, DeadLetter
from rlens.service.common.kafka import (
    RawMessage,
    group_options,
    dead_letter,
    SUBSCRIBER,
    woken_by_records,
    parse_or_dead_letter,
    publish_dead_letters,
)
from rlens.service.common.metrics import GatewayMetrics
from rlens.service.gateway.core import Gateway
from rlens.settings import Settings


def subscribe_replies(
    broker: KafkaBroker,
    settings: Settings,
    gateway: Gateway,
    metrics: GatewayMetrics,
    dead_letters,
    reply_topic: str,
    name: str,
) -> None:
    """Read ``reply_topic`` in batches (a group of this replica's own): unreadable records and answers without a
    valid worker signature go to the dead-letter topic; a batch whose Redis writes fail is read again."""
    consumer = f"gateway {name}"

    replies = broker.subscriber(
        reply_topic,
        group_id=settings.group("gateway", name),
        batch=True,
        max_records=256,
        auto_offset_reset="earliest",
        ack_policy=AckPolicy.NACK_ON_ERROR,
        **SUBSCRIBER,
        **group_options(settings),
        description="answers to this replica's queries (workers publish each answer here too)",
    )

    @woken_by_records(replies)
    async def on_replies(bodies: list[bytes], message: RawMessage) -> None:
        parsed = [(record, parse_or_dead_letter(Answer, record, consumer)) for record in message.raw_message]
        answers = [(record, p) for record, p in parsed if not isinstance(p, DeadLetter)]
        dead = [p for _, p in parsed if isinstance(p, DeadLetter)]
        outcomes = await gateway.on_replies([a for _, a in answers])  # Redis down: raises, the batch is read again
        for (record, answer), outcome in zip(answers, outcomes):
            metrics.replies.labels(outcome).inc()
            if outcome == "forged":
                dead.append(
                    dead_letter(record, f"answer for {answer.query_id} without a valid worker signature", consumer)
                )
        for _ in range(len(parsed) - len(answers)):
            metrics.replies.labels("unreadable").inc()
        await publish_dead_letters(dead_letters, dead)
