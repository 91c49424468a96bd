"""The learner: joins ``experience`` with ``feedback`` by query id, updates the Redis windows, runs a strategy's
update every so many joined transitions, checkpoints, and publishes each new ``policy`` version.

:class:`LearnerCore` is the logic without a transport; what is trained (RL-Focal's engine or the RLAE agent) is its
:class:`rlens.service.online.OnlineTrainer`. :func:`create_learner_app` wires it to Kafka.

- **Join.** Either half may come first. Unmatched halves wait in bounded maps (``pending_limit``, oldest evicted)
  and expire after ``pending_ttl_s``. A query id that was joined is remembered (bounded), so duplicated
  feedback or redelivered experience is ignored. Feedback that can never join (its label is not a choice of the
  query, a reference for a multiple-choice query, a label for an open-ended one) goes to the dead-letter topic.
- **Reward.** The feedback's ``reward`` if given, else the trainer's: RL-Focal's reward for the answer against
  ``label``, RLAE's exact match of the generated text with ``reference``.
- **Windows.** (rl_focal) Each join applies the query's outcome to its stream's Redis window, once per query id;
  while Redis is unreachable the learner retries with backoff and consumes nothing else, so no outcome is lost.
- **Exactly-once effect across crashes.** A checkpoint holds the trainer (weights, optimizer, RNGs, buffer), the
  pending joins, the recent query ids and, per partition, the offset after the last record it reflects. Kafka
  offsets are committed only up to a checkpoint's offsets. After a crash the learner restores the newest
  checkpoint, skips re-delivered records below its offsets, and so neither loses nor re-applies a transition.
  Checkpoints are taken after every update, every ``checkpoint_every_s`` seconds while records arrive, and on
  shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

from aiokafka.structs import TopicPartition
from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaMessage
from redis.exceptions import RedisError

from rlens.checkpoint import CheckpointStore
from rlens.messages import EXPERIENCE, DeadLetter, Feedback, Message, Policy
from rlens.service.kafka import Topics, dead_letter, keep_bytes, make_broker, parse_or_dead_letter, publish, typed_publisher
from rlens.service.online import FeedbackError, OnlineTrainer
from rlens.service.policy import encode_policy
from rlens.service.windows import RedisWindows
from rlens.settings import Settings

log = logging.getLogger("rlens.learner")


@dataclass
class LearnerStats:
    joined: int = 0  # transitions given to the trainer
    duplicates: int = 0  # experience or feedback for a query already joined
    expired: int = 0  # unmatched halves dropped after pending_ttl_s
    evicted: int = 0  # unmatched halves dropped because pending_limit was reached
    invalid_feedback: int = 0
    updates: int = 0
    windows_applied: int = 0  # outcomes added to Redis windows (a replay after a crash adds none twice)
    redis_retries: int = 0
    last_update: dict | None = None


class LearnerCore:
    def __init__(self, trainer: OnlineTrainer, models: list[str], windows: RedisWindows, checkpoints: CheckpointStore,
                 pending_limit: int = 100_000, pending_ttl_s: float = 3600.0, done_limit: int = 200_000):
        self.trainer, self.models, self.windows, self.checkpoints = trainer, models, windows, checkpoints
        self.pending_limit, self.pending_ttl_s, self.done_limit = pending_limit, pending_ttl_s, done_limit
        self.version = 0
        self.offsets: dict[str, int] = {}  # "topic:partition" -> offset after the last record reflected in the state
        self.checkpointed_offsets: dict[str, int] = {}  # the same, as of the newest checkpoint (what Kafka may commit)
        self.experience: OrderedDict[str, tuple[float, Message]] = OrderedDict()
        self.feedback: OrderedDict[str, tuple[float, Feedback, dict]] = OrderedDict()  # + its record, as a dead letter would hold it
        self.done: OrderedDict[str, float] = OrderedDict()
        self.stats = LearnerStats()
        self.name = f"{socket.gethostname()}-{os.getpid()}"
        self.last_checkpoint = time.monotonic()
        restored = trainer.load(checkpoints)
        if restored is not None:
            self._restore(restored)

    # --- state ------------------------------------------------------------------------------------------------
    def _restore(self, state: dict) -> None:
        self.version = state["version"]
        self.offsets = dict(state["offsets"])
        self.checkpointed_offsets = dict(state["offsets"])
        self.experience = OrderedDict((q, (t, self.trainer.experience.model_validate(e))) for q, t, e in state["experience"])
        self.feedback = OrderedDict((q, (t, Feedback.model_validate(f), r)) for q, t, f, r in state["feedback"])
        self.done = OrderedDict(state["done"])
        self.stats = LearnerStats(**state["stats"])
        log.info("resumed from checkpoint v%d (%d joined)", self.version, self.stats.joined)

    def checkpoint(self) -> None:
        state = {
            "offsets": self.offsets,
            "experience": [[q, t, e.model_dump()] for q, (t, e) in self.experience.items()],
            "feedback": [[q, t, f.model_dump(), r] for q, (t, f, r) in self.feedback.items()],
            "done": list(self.done.items()),
            "stats": asdict(self.stats),
        }
        self.trainer.save(self.checkpoints, self.version, state)
        self.checkpointed_offsets = dict(self.offsets)
        self.last_checkpoint = time.monotonic()

    def already_seen(self, record) -> bool:
        """True for a record the state already reflects (re-delivered after a restart); else mark it seen."""
        key = f"{record.topic}:{record.partition}"
        if record.offset < self.offsets.get(key, 0):
            return True
        self.offsets[key] = record.offset + 1
        return False

    def commit_offsets(self, topic: str) -> dict[TopicPartition, int]:
        """How far Kafka may commit ``topic``: the newest checkpoint's offsets, never past them."""
        split = (key.rsplit(":", 1) + [offset] for key, offset in self.checkpointed_offsets.items())
        return {TopicPartition(t, int(p)): o for t, p, o in split if t == topic}

    def _expire(self, now: float) -> None:
        for pending in (self.experience, self.feedback):
            while pending and now - next(iter(pending.values()))[0] > self.pending_ttl_s:
                pending.popitem(last=False)
                self.stats.expired += 1
            while len(pending) > self.pending_limit:
                pending.popitem(last=False)
                self.stats.evicted += 1

    # --- records ----------------------------------------------------------------------------------------------
    def warm_start(self, source) -> None:
        """Start the trainer from offline training when there is no checkpoint yet (a later start resumes instead)."""
        if self.version == 0:
            self.trainer.warm_start(source)
            self.version = 1
            self.checkpoint()

    async def on_experience(self, experience: Message) -> tuple[Policy | None, DeadLetter | None]:
        qid = experience.query_id
        if qid in self.done or qid in self.experience:
            self.stats.duplicates += 1
            return None, None
        if qid in self.feedback:
            _, feedback, record = self.feedback.pop(qid)
            return await self._join(experience, feedback, record)
        self.experience[qid] = (time.time(), experience)
        self._expire(time.time())
        return None, None

    async def on_feedback(self, feedback: Feedback, record) -> tuple[Policy | None, DeadLetter | None]:
        qid = feedback.query_id
        if qid in self.done or qid in self.feedback:
            self.stats.duplicates += 1
            return None, None
        coordinates = dead_letter(record, "", "learner").model_dump()
        if qid in self.experience:
            _, experience = self.experience.pop(qid)
            return await self._join(experience, feedback, coordinates)
        self.feedback[qid] = (time.time(), feedback, coordinates)
        self._expire(time.time())
        return None, None

    async def _join(self, experience: Message, feedback: Feedback, record: dict) -> tuple[Policy | None, DeadLetter | None]:
        self._remember_done(experience.query_id)
        try:
            reward = self.trainer.reward(experience, feedback)
        except FeedbackError as exc:
            self.stats.invalid_feedback += 1
            return None, DeadLetter.model_validate({**record, "reason": str(exc), "at": time.time()})
        row = self.trainer.window_row(experience, feedback)
        if row is not None:
            await self._apply_window(experience, *row, reward)
        self.trainer.remember(experience, reward)
        self.stats.joined += 1
        if self.trainer.update_due():
            return self.update(), None
        return None, None

    def _remember_done(self, query_id: str) -> None:
        self.done[query_id] = time.time()
        while len(self.done) > self.done_limit:
            self.done.popitem(last=False)

    async def _apply_window(self, experience: Message, predictions: list[int], label: int, reward: float) -> None:
        delay = 0.05
        while True:
            try:
                if await self.windows.apply(experience.stream, experience.query_id, predictions, label, reward):
                    self.stats.windows_applied += 1
                return
            except (RedisError, OSError) as exc:
                self.stats.redis_retries += 1
                log.warning("Redis unreachable (%s); retrying in %.2f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    def update(self) -> Policy:
        """One update on the buffered transitions, a checkpoint, and the new policy version to publish."""
        self.stats.last_update = self.trainer.update()
        self.stats.updates += 1
        self.version += 1
        self.checkpoint()
        return self.current_policy()

    def current_policy(self) -> Policy:
        return encode_policy(self.trainer.policy_tensors(), self.version, self.models, self.trainer.strategy)


def create_learner_app(settings: Settings, core: LearnerCore | None, checkpoint_every_s: float = 30.0) -> FastStream:
    """Subscribers on ``experience`` and ``feedback`` (one group, manual commits up to the checkpointed offsets).

    ``core`` None builds the app only to generate the AsyncAPI document.
    """
    topics = Topics.from_settings(settings)
    broker = make_broker(settings)
    policies_out = typed_publisher(broker, topics.policy, Policy, "learner", "a new version of every agent's weights after each update")
    dead_letters = typed_publisher(broker, topics.dead_letter, DeadLetter, "learner", "feedback and experience that could not be used, with the reason")
    options = {
        "group_id": settings.learner_group, "batch": True, "max_records": 256, "batch_timeout_ms": 20, "auto_offset_reset": "earliest",
        "ack_policy": AckPolicy.MANUAL, "decoder": keep_bytes,
        "session_timeout_ms": settings.kafka_session_timeout_ms, "heartbeat_interval_ms": settings.kafka_heartbeat_ms,
        "fetch_max_wait_ms": settings.kafka_fetch_max_wait_ms,
    }
    committed: dict[str, int] = {}  # topic -> version last committed for it
    lock = asyncio.Lock()  # the two subscribers run as separate tasks; the core is not re-entrant

    async def handle(message: KafkaMessage, model: type, topic: str) -> None:
        async with lock:
            for record in message.raw_message:
                if core.already_seen(record):
                    continue
                parsed = parse_or_dead_letter(model, record, "learner")
                if isinstance(parsed, DeadLetter):
                    await publish(dead_letters, [parsed])  # before any checkpoint can mark this record as done
                    continue
                policy, rejected = await (core.on_feedback(parsed, record) if model is Feedback else core.on_experience(parsed))
                await publish(dead_letters, [rejected] if rejected else [])
                await publish(policies_out, [policy] if policy else [])  # checkpointed already; announced again on restart
            if time.monotonic() - core.last_checkpoint > checkpoint_every_s:
                core.checkpoint()
            if committed.get(topic) != core.checkpoints.count:
                offsets = {tp: o for tp, o in core.commit_offsets(topic).items() if tp in message.consumer.assignment()}
                if offsets:
                    await message.consumer.commit(offsets)
                committed[topic] = core.checkpoints.count

    experience_model = core.trainer.experience if core else EXPERIENCE[settings.strategy]

    @broker.subscriber(topics.experience, description=f"JSON {experience_model.__name__} messages from the {settings.strategy} workers", **options)
    async def on_experience(bodies: list[bytes], message: KafkaMessage) -> None:
        await handle(message, experience_model, topics.experience)

    @broker.subscriber(topics.feedback, description="JSON Feedback messages: label, reference or reward per query id, any delay, duplicates allowed (schemas/messages/feedback.schema.json)", **options)
    async def on_feedback(bodies: list[bytes], message: KafkaMessage) -> None:
        await handle(message, Feedback, topics.feedback)

    app = FastStream(broker)

    @app.after_startup
    async def announce() -> None:  # workers that start after a learner restart get the current policy at once
        if core.version > 0:
            await publish(policies_out, [core.current_policy()])
        await core.windows.mark_ready("learner", core.name)

    @app.on_shutdown
    async def final_checkpoint() -> None:
        async with lock:
            core.checkpoint()
        await core.windows.mark_ready("learner", core.name, ready=False)

    return app
