"""One batch of ``experience`` or ``feedback`` records, start to end: a new log detected, each record parsed and
handed to the :class:`LearnerCore` (one record's failure dead-letters that record only), what it produced published
(dead letters, drift events, policies), the windows written, a shard's joined queries handed to the trainer, a
checkpoint when due, and the offsets committed up to
the newest checkpoint's (:class:`Commits`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import cast

from aiokafka import AIOKafkaConsumer
from faststream.kafka import KafkaMessage

from rlens.messages import DeadLetter, Feedback, Transition
from rlens.service.common.kafka import (
    TopicRestorer,
    dead_letter,
    parse_or_dead_letter,
    publish,
    publish_dead_letters,
)
from rlens.service.common.metrics import LearnerMetrics, dead_letter_kind
from rlens.service.learner.core import LearnerCore
from rlens.service.learner.offsets import partition_key, partition_of

log = logging.getLogger("rlens.learner")
COMMIT_TIMEOUT_S = 5.0  # a commit not confirmed by then is given up (and tried again with a later batch)
COMMIT_PAUSE_S = 30.0  # ... COMMIT_PAUSE_S later
LOG_CHECK_S = 0.5  # how often every assigned partition's log end is compared with the offsets the state reflects
LOG_CHECK_TIMEOUT_S = 5.0  # a check the broker does not answer by then is given up


def consumer_of(message: KafkaMessage) -> AIOKafkaConsumer:
    """The aiokafka consumer a FastStream Kafka message came from (FastStream types it as a narrower protocol)."""
    return cast(AIOKafkaConsumer, message.consumer)


class Commits:
    """Offset commits up to the newest checkpoint's offsets, once per checkpoint and topic. A commit not confirmed
    within COMMIT_TIMEOUT_S is given up, and none is tried for COMMIT_PAUSE_S: aiokafka retries a commit the broker
    refuses (a broker that lost the topic, say) for as long as it is let, and a learner waiting on it would join
    nothing. The checkpoint holds the offsets a restart resumes from either way."""

    def __init__(self, core: LearnerCore, restorer: TopicRestorer):
        self.core, self.restorer = core, restorer
        self.committed: dict[str, int] = {}  # topic -> checkpoint count last committed for it
        self.paused_until = 0.0  # monotonic clock
        self.pending: asyncio.Future | None = None  # the last commit, which may still run after its wait ended

    async def after_batch(self, consumer: AIOKafkaConsumer, topic: str) -> None:
        if self.committed.get(topic) == self.core.checkpoints.count:
            return
        assigned = consumer.assignment()
        offsets = {tp: o for tp, o in self.core.offsets.to_commit(topic).items() if tp in assigned}
        if offsets and not await self.commit(consumer, offsets):
            return  # committed with a later batch: the checkpoint is what a restart resumes from
        self.committed[topic] = self.core.checkpoints.count

    async def commit(self, consumer: AIOKafkaConsumer, offsets) -> bool:
        """One commit, waited for at most COMMIT_TIMEOUT_S. A commit that takes longer is left to finish on its own,
        never cancelled (cancelling aiokafka's commit mid-way could leave its coordinator waiting), and none other
        is tried until it has ended and COMMIT_PAUSE_S have passed."""
        if time.monotonic() < self.paused_until or (self.pending is not None and not self.pending.done()):
            return False
        self.pending = asyncio.ensure_future(consumer.commit(offsets))
        try:
            await asyncio.wait_for(asyncio.shield(self.pending), COMMIT_TIMEOUT_S)
        except TimeoutError:
            log.warning("offsets not committed within %g s; none is tried for %g s", COMMIT_TIMEOUT_S, COMMIT_PAUSE_S)
            self.paused_until = time.monotonic() + COMMIT_PAUSE_S
            self.pending.add_done_callback(_quietly)
            await self.restorer.restore()
            return False
        return True


def _quietly(done: asyncio.Future) -> None:
    """A commit left to finish on its own: its failure is read (the checkpoint's offsets are what a restart uses)."""
    if not done.cancelled() and done.exception() is not None:
        log.debug("a late commit failed: %r", done.exception())


class RecordBatches:
    """The learner's handling of record batches from both topics (the two subscribers run as separate tasks; the
    core is not re-entrant: ``lock``)."""

    def __init__(self, core: LearnerCore, metrics: LearnerMetrics, publishers, restorer: TopicRestorer):
        """``publishers``: (policies, dead letters, drift events, transitions: a shard's, else None)."""
        self.core, self.metrics, self.restorer = core, metrics, restorer
        self.policies, self.dead_letters, self.drift_events, self.transitions = publishers
        self.commits = Commits(core, restorer)
        self.lock = asyncio.Lock()
        self.consumers: dict[str, AIOKafkaConsumer] = {}  # topic -> the consumer its batches came from

    async def handle(self, message: KafkaMessage, model: type, topic: str) -> None:
        try:
            await self._handle(message, model, topic)
        except Exception:  # a publish or a commit the broker refused: it may have lost the topics (restarted empty)
            await self.restorer.restore()
            raise

    async def _handle(self, message: KafkaMessage, model: type, topic: str) -> None:
        core = self.core
        kind = "feedback" if model is Feedback else "transitions" if issubclass(model, Transition) else "experience"
        self.metrics.batch_size.labels(kind).observe(len(message.raw_message))
        async with self.lock:
            await self.detect_new_logs(message, topic)
            await core.apply_windows()  # what a Redis outage left in the backlog
            for record in message.raw_message:
                if not core.already_seen(record):
                    self.metrics.records.labels(kind).inc()
                    await self.record(record, model)
            await core.apply_windows()  # the batch's outcomes, in one round trip
            await self.hand_on()
            self.show_state()
            if core.checkpoint_due():
                await asyncio.to_thread(core.checkpoint)  # off the event loop (the lock keeps the state still)
            await self.commits.after_batch(consumer_of(message), topic)

    async def record(self, record, model: type) -> None:
        """One record to the core, and what it produced out."""
        parsed = parse_or_dead_letter(model, record, "learner")
        if isinstance(parsed, DeadLetter):
            await self.dead_letter([parsed])  # before any checkpoint can mark this record as done
            return
        core = self.core
        try:
            if model is Feedback:
                policy, rejected = await core.on_feedback(parsed, record)
            elif issubclass(model, Transition):
                policy, rejected = await core.on_transition(parsed, record)
            else:
                policy, rejected = await core.on_experience(parsed, record)
        except Exception as exc:  # one record's failure must not stop the others
            log.exception("record %s:%d@%d failed", record.topic, record.partition, record.offset)
            core.stats.failed_records += 1
            policy = None
            rejected = dead_letter(record, f"learner failed on it: {type(exc).__name__}: {exc}", "learner")
        await self.dead_letter(([rejected] if rejected else []) + core.take_dead_letters())
        await publish(self.drift_events, core.take_drift_events())
        await publish(self.policies, ([policy] if policy else []) + core.take_policies())

    async def hand_on(self) -> None:
        """A shard's joined queries to the trainer, confirmed by the broker before any checkpoint covers them (a
        refused publish keeps them, and the checkpoint, for the next batch)."""
        if self.core.handed:
            await publish(self.transitions, self.core.handed)
            self.core.take_handed()

    async def dead_letter(self, letters: list[DeadLetter]) -> None:
        for letter in letters:
            self.metrics.dead_letters.labels(dead_letter_kind(letter.reason)).inc()
        await publish_dead_letters(self.dead_letters, letters)

    def watch(self, topic: str, consumer: AIOKafkaConsumer | None) -> None:
        """Have :meth:`watch_logs` look at ``topic``'s partitions that ``consumer`` is assigned."""
        if consumer is not None:
            self.consumers.setdefault(topic, consumer)

    async def detect_new_logs(self, message: KafkaMessage, topic: str) -> None:
        """A batch holding records below the offsets the state reflects: redeliveries, or a new log (a broker that
        lost its data), told apart by the partition's log end."""
        consumer = consumer_of(message)
        self.consumers[topic] = consumer
        keys = self.core.offsets.below(message.raw_message)
        if keys:
            await self.new_logs(consumer, keys, {partition_key(r) for r in message.raw_message})

    async def watch_logs(self) -> None:
        """Every LOG_CHECK_S, batches or not, every assigned partition's log end against the offset the state
        reflects: a consumer whose position is past a new log's records never brings one below that offset (tansu
        answers a fetch past a log's end with nothing), so the new log must be found before it grows past it."""
        while True:
            await asyncio.sleep(LOG_CHECK_S)
            for topic, consumer in list(self.consumers.items()):
                keys = {f"{tp.topic}:{tp.partition}" for tp in consumer.assignment() if tp.topic == topic}
                try:
                    async with self.lock:
                        await asyncio.wait_for(self.new_logs(consumer, keys, set()), LOG_CHECK_TIMEOUT_S)
                except Exception as exc:  # the broker is away: the next check tries again
                    log.debug("log ends of %s not checked: %s", topic, exc)

    async def new_logs(self, consumer: AIOKafkaConsumer, keys: set[str], in_batch: set[str]) -> None:
        """Those of partitions ``keys`` whose log now ends below the offset the state reflects are new logs: read
        from their start (sought there unless the batch in hand holds their records). A log's end as the last fetch
        saw it (its high watermark) and as the broker lists it must both be below: tansu lists the start of a log's
        last producer batch, plus one, and a new Kafka leader's high watermark may lag a moment. Before any fetch,
        a log the broker lists as empty is new (a broker that started empty: all its partitions are found at once)."""
        offsets = self.core.offsets
        partitions = {}
        for key in keys:
            tp, read = partition_of(key), offsets.read.get(key, 0)
            fetched_end = consumer.highwater(tp)
            if read and (fetched_end is None or fetched_end < read):
                partitions[key] = tp
        if not partitions:
            return
        ends = await consumer.end_offsets(list(partitions.values()))
        new = {
            key: ends[tp]
            for key, tp in partitions.items()
            if ends.get(tp, offsets.read[key]) < offsets.read[key]
            and (consumer.highwater(tp) is not None or ends[tp] == 0)  # not fetched yet: only an empty log is sure
        }
        if new:
            self.core.new_logs(new)
        for key in new.keys() - in_batch:
            consumer.seek(partitions[key], 0)

    def show_state(self) -> None:
        core, metrics = self.core, self.metrics
        metrics.pending.labels("experience").set(len(core.experience))
        metrics.pending.labels("feedback").set(len(core.feedback))
        metrics.window_backlog.set(len(core.window_backlog))
        metrics.policy_version.set(core.version)

    async def checkpoint_when_idle(self) -> None:
        """What the last batches did reaches a checkpoint, and the calibrations a refit held back reach the workers,
        even when no further record comes."""
        while True:
            await asyncio.sleep(self.core.checkpoint_every_s)
            async with self.lock:
                await self.core.apply_windows()
                if self.core.checkpoint_due():
                    await asyncio.to_thread(self.core.checkpoint)
