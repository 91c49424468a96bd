"""The learner: joins ``experience`` with ``feedback`` by query id, updates the Redis windows, runs a strategy's
update every so many joined transitions, checkpoints, and publishes each new ``policy`` version.

:class:`LearnerCore` is the logic without a transport; what is trained (RL-Focal's engine or the RLAE agent) is its
:class:`rlens.service.learner.online.OnlineTrainer`. :func:`create_learner_app` wires it to Kafka.

- **Trust.** Feedback whose token is not its query's (:class:`rlens.service.common.security.FeedbackTokens`) is
  dead-lettered on arrival, before it is held or counted, so a forged feedback can neither train nor block the true
  one. An experience that does not fit the pool (:meth:`OnlineTrainer.check`) is dead-lettered before it is held.
  Any other failure while handling one record dead-letters that record only.
- **Join.** Either half may come first. Unmatched halves wait in :class:`rlens.service.learner.pending.PendingHalves`,
  bounded by count (``pending_limit``), bytes (``pending_bytes``) and per stream (``pending_per_stream``: a flood on
  one stream key drops that stream's own halves), oldest dropped first, and expire
  ``pending_ttl_s`` after their record's timestamp, measured against the newest record the learner has read (event
  time: a learner that catches up after an outage expires nothing early). A dropped half is dead-lettered with the
  reason; an answer whose feedback never comes is not trained on (there is no default reward). A query id that was
  joined is remembered (bounded), so duplicated feedback or redelivered experience is ignored. Feedback that can
  never join (its label is not a choice of the query, a reference for a multiple-choice query, a label for an
  open-ended one, another stream than the query's) goes to the dead-letter topic.
- **Reward.** The feedback's ``reward`` if given, else the trainer's: RL-Focal's reward for the answer against
  ``label`` (open-ended: the candidate that the ``reference``'s answer is, none when no model gave it), RLAE's exact
  match of the generated text with ``reference``.
- **Windows.** (rl_focal) Each join queues the query's outcome for its stream's Redis window; the queue is applied
  after each batch of records (or every :data:`APPLY_BATCH` outcomes), in one pipelined round trip, once per query
  id. While Redis is unreachable the learner retries with backoff for at most ``redis_wait_s``, then keeps the outcome
  in a backlog (checkpointed, bounded) that is applied, in order, once Redis answers again; learning goes on.
- **Updates.** An update whose weights are not finite (or that raises) is undone: the weights and the optimizer
  return to their state before it, its transitions are dropped, and no policy is published.
- **Drift.** Each stream's signals (the outcome, each called model's correctness, and the answer's label-free
  confidence) feed a :class:`rlens.drift.DriftMonitor`; its detections go out as ``DriftEvent`` on ``drift`` and
  are counted. With ``drift_keep`` set (``RLENS_DRIFT_REACTION=trim``), a detection on a labelled signal trims the
  stream's Redis window to its last ``drift_keep`` outcomes. The detectors' state is in the checkpoint, and
  :class:`rlens.service.learner.dashboard.Dashboard` keeps what ``/dashboard`` shows.
- **Policies** are signed (:class:`rlens.service.common.security.PolicySigner`) and ordered by (epoch, version); the epoch
  is the learner's start time in milliseconds, so a restarted learner's policies supersede its predecessor's.
- **Exactly-once effect across crashes.** A checkpoint holds the trainer (weights, optimizer, RNGs, buffer), the
  pending joins, the recent query ids and, per partition, the offset after the last record it reflects. Kafka
  offsets are committed only up to a checkpoint's offsets. After a crash the learner restores the newest
  checkpoint, skips re-delivered records below its offsets, and so neither loses nor re-applies a transition.
  Checkpoints are taken at most every ``checkpoint_every_s`` seconds (after an update or a batch, and by a timer
  while the learner is idle) and on shutdown, so their cost does not grow with the update rate. A policy may be
  published before the checkpoint that holds it; after a crash the learner re-learns from that checkpoint's
  offsets under a new epoch, whose versions supersede what it published before.
- **Fencing.** One learner per checkpoint directory (:class:`rlens.checkpoint.CheckpointStore` locks it) and per
  consumer group (a lease in Redis, renewed every ``LEASE_TTL_S`` / 3 s); a second one refuses to start. A learner
  restarted on the directory of one that died takes its lease over at once (holding the directory's lock proves the
  other is gone); elsewhere the lease of a dead learner lapses after ``LEASE_TTL_S``. While Redis is down at start
  the group cannot be checked (a warning says so).
- **A new log.** A broker that lost its data (tansu's memory storage restarted, a topic recreated, ``rlens up``
  reusing a checkpoint with a fresh broker) serves offsets below the checkpoint's. A record below the stored offset
  is a redelivery while the partition's log end is at or above that offset, and a new log when the log end is below
  it: then the learner warns, forgets that partition's offset and reads the new log from its start (the join's
  duplicate check and the windows' once-per-query markers keep a misjudged redelivery harmless). A new log that has
  already grown past the old offset when it is first read cannot be told apart: recreate topics only with the
  learner stopped, or give the learner a fresh checkpoint directory.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import socket
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass

from aiokafka.structs import TopicPartition
from redis.exceptions import RedisError

from rlens.checkpoint import CheckpointStore
from rlens.drift import DriftMonitor, signals_of_outcome
from rlens.messages import AnyExperience, DeadLetter, DriftEvent, Feedback, Message, Policy
from rlens.service.learner.dashboard import Dashboard
from rlens.service.common.kafka import (
    dead_letter,
)
from rlens.service.learner.online import FeedbackError, OnlineTrainer
from rlens.service.common.metrics import (
    LearnerMetrics,
)
from rlens.service.learner.pending import Pending, PendingHalves
from rlens.service.common.policy import encode_policy, non_finite
from rlens.service.common.security import FeedbackTokens, PolicySigner
from rlens.service.common.windows import RedisWindows

APPLY_BATCH = 256  # outcomes sent to Redis in one round trip
log = logging.getLogger("rlens.learner")


def event_time(record) -> float:
    """A consumer record's timestamp in seconds (now, for a record without one)."""
    timestamp = getattr(record, "timestamp", None)
    return timestamp / 1000 if isinstance(timestamp, (int, float)) and timestamp > 0 else time.time()


def partition_of(key: str) -> TopicPartition:
    """``"topic:partition"`` → its TopicPartition."""
    topic, partition = key.rsplit(":", 1)
    return TopicPartition(topic, int(partition))


@dataclass
class LearnerStats:
    joined: int = 0  # transitions given to the trainer
    duplicates: int = 0  # experience or feedback for a query already joined
    expired: int = 0  # unmatched halves dropped pending_ttl_s after their event time
    evicted: int = 0  # unmatched halves dropped because pending_limit or pending_bytes was reached
    invalid_feedback: int = 0
    forged_feedback: int = 0  # feedback whose token is not its query's
    invalid_experience: int = 0  # experience that does not fit the pool
    failed_records: int = 0  # records whose handling raised (dead-lettered)
    updates: int = 0
    rejected_updates: int = 0  # updates undone (non-finite weights, or they raised)
    windows_applied: int = 0  # outcomes added to Redis windows (a replay after a crash adds none twice)
    redis_retries: int = 0
    window_backlog_dropped: int = 0  # outcomes dropped because the backlog was full during a long Redis outage
    new_logs: int = 0  # partitions found restarted from offset 0 (a broker that lost its data)
    drift_reactions: int = 0  # drifted streams whose window was trimmed
    last_update: dict | None = None


class LearnerCore:
    def __init__(
        self,
        trainer: OnlineTrainer,
        models: list[str],
        windows: RedisWindows,
        checkpoints: CheckpointStore,
        signer: PolicySigner,
        tokens: FeedbackTokens,
        pending_limit: int = 100_000,
        pending_ttl_s: float = 3600.0,
        pending_bytes: int = 256 * 2**20,
        pending_per_stream: int = 10_000,
        done_limit: int = 200_000,
        redis_wait_s: float = 10.0,
        backlog_limit: int = 100_000,
        checkpoint_every_s: float = 5.0,
        drift: DriftMonitor | None = None,
        drift_keep: int | None = None,
    ):
        self.trainer, self.models, self.windows, self.checkpoints = trainer, models, windows, checkpoints
        self.signer, self.tokens = signer, tokens
        self.pending_limit, self.pending_ttl_s, self.done_limit = pending_limit, pending_ttl_s, done_limit
        self.redis_wait_s, self.backlog_limit = redis_wait_s, backlog_limit
        # [stream, query id, predictions, label, reward] not yet in Redis, oldest first
        self.window_backlog: deque[list] = deque()
        self._redis_retry_at = 0.0  # after a bounded wait gave up: no new try before this (monotonic clock)
        self.epoch = time.time_ns() // 1_000_000
        self.version = 0
        self.offsets: dict[str, int] = {}  # "topic:partition" -> offset after the last record reflected in the state
        self.checkpointed_offsets: dict[str, int] = {}  # the same, as of the newest checkpoint (what Kafka may commit)
        self.experience: PendingHalves[AnyExperience] = PendingHalves(pending_limit, pending_bytes, pending_per_stream)
        self.feedback: PendingHalves[Feedback] = PendingHalves(pending_limit, pending_bytes, pending_per_stream)
        self.clock = 0.0  # the newest event time (record timestamp, seconds) read
        self.dropped: list[DeadLetter] = []  # dead letters of expired or evicted halves, until the app publishes them
        self.metrics: LearnerMetrics | None = None  # set by the app
        self.done: OrderedDict[str, float] = OrderedDict()
        self.stats = LearnerStats()
        self.name = f"{socket.gethostname()}-{os.getpid()}"
        self.checkpoint_every_s = checkpoint_every_s
        self.last_checkpoint = float("-inf")  # monotonic time of the newest checkpoint
        self.checkpointed_version = 0
        # drift_keep: trim a drifted stream's window to this many outcomes (None: no reaction)
        self.drift, self.drift_keep = (
            drift,
            drift_keep,
        )
        self.drift_events: list[DriftEvent] = []  # detections since the app last took them
        self.dashboard = Dashboard(trainer.strategy, models)
        restored = trainer.load(checkpoints)
        if restored is not None:
            self._restore(restored)

    # --- state ------------------------------------------------------------------------------------------------
    def _restore(self, state: dict) -> None:
        self.version = state["version"]
        self.offsets = dict(state["offsets"])
        self.checkpointed_offsets = dict(state["offsets"])
        self.experience.load_json(state["experience"], self.trainer.experience)
        self.feedback.load_json(state["feedback"], Feedback)
        self.clock = state["clock"]
        self.done = OrderedDict(state["done"])
        self.window_backlog = deque(state["window_backlog"])
        self.stats = LearnerStats(**state["stats"])
        if self.drift is not None:
            self.drift.load_json(state.get("drift", []))
        log.info("resumed from checkpoint v%d (%d joined)", self.version, self.stats.joined)

    def checkpoint(self) -> None:
        state = {
            "offsets": self.offsets,
            "experience": self.experience.to_json(),
            "feedback": self.feedback.to_json(),
            "clock": self.clock,
            "done": list(self.done.items()),
            "window_backlog": list(self.window_backlog),
            "stats": asdict(self.stats),
            "drift": self.drift.to_json() if self.drift is not None else [],
        }
        self.trainer.save(self.checkpoints, self.version, state)
        self.checkpointed_offsets = dict(self.offsets)
        self.checkpointed_version = self.version
        self.last_checkpoint = time.monotonic()

    def checkpoint_due(self) -> bool:
        """Whether the state moved on since the newest checkpoint and that one is ``checkpoint_every_s`` old."""
        moved = self.offsets != self.checkpointed_offsets or self.version != self.checkpointed_version
        return moved and time.monotonic() - self.last_checkpoint >= self.checkpoint_every_s

    def already_seen(self, record) -> bool:
        """True for a record the state already reflects (re-delivered after a restart); else mark it seen."""
        key = f"{record.topic}:{record.partition}"
        if record.offset < self.offsets.get(key, 0):
            return True
        self.offsets[key] = record.offset + 1
        return False

    def below_offsets(self, records) -> set[str]:
        """The "topic:partition" keys of records below the offsets the state reflects (redeliveries, or a new log)."""
        return {
            f"{r.topic}:{r.partition}" for r in records if r.offset < self.offsets.get(f"{r.topic}:{r.partition}", 0)
        }

    def new_log(self, key: str, log_end: int) -> None:
        """Partition ``key`` restarted from offset 0 (its log ends at ``log_end``, below our offset): read it anew."""
        log.warning(
            "%s ends at offset %d, below the %d this learner reached: a new log (broker data lost?); reading it from the start",
            key,
            log_end,
            self.offsets[key],
        )
        self.offsets[key] = 0
        self.checkpointed_offsets[key] = 0
        self.stats.new_logs += 1

    def commit_offsets(self, topic: str) -> dict[TopicPartition, int]:
        """How far Kafka may commit ``topic``: the newest checkpoint's offsets, never past them."""
        partitions = {partition_of(key): offset for key, offset in self.checkpointed_offsets.items()}
        return {tp: offset for tp, offset in partitions.items() if tp.topic == topic}

    def _hold(self, pending: PendingHalves, query_id: str, message: Message, record, coordinates: dict) -> None:
        """Hold an unmatched half; dead-letter what expires or no longer fits."""
        at = event_time(record)
        self.clock = max(self.clock, at)
        kind = "experience" if pending is self.experience else "feedback"
        for dropped, why in pending.add(query_id, Pending(at, len(record.value or b""), message, coordinates)):
            self.stats.evicted += 1
            self._drop(dropped, f"unmatched {kind} dropped: the learner's pending {kind} reached {why}")
        for halves, name, missing in (
            (self.experience, "experience", "feedback"),
            (self.feedback, "feedback", "experience"),
        ):
            for dropped in halves.expire(self.clock - self.pending_ttl_s):
                self.stats.expired += 1
                self._drop(
                    dropped,
                    f"{name} expired: no {missing} within {self.pending_ttl_s:g} s (event time); not trained on, there is no default reward",
                )

    def _drop(self, dropped: Pending, reason: str) -> None:
        self.dropped.append(DeadLetter.model_validate({**dropped.record, "reason": reason, "at": time.time()}))

    def take_drift_events(self) -> list[DriftEvent]:
        """The drift detections since the last call."""
        taken, self.drift_events = self.drift_events, []
        return taken

    def _observe_drift(self, stream: str, signals: dict[str, float], query_id: str) -> bool:
        """Feed each signal's value to its detector; a detection becomes a :class:`DriftEvent` (and is counted).
        Whether any was detected."""
        if self.metrics is not None:
            self.metrics.observe_signals(stream, signals)
        if self.drift is None:
            return False
        detected = False
        for signal, value in signals.items():
            found = self.drift.observe(stream, signal, value)
            if found is None:
                continue
            detected = True
            before = None if math.isnan(found.mean_before) else found.mean_before
            event = DriftEvent(
                stream=stream,
                signal=signal,
                detector=self.drift.config.detector,
                position=found.position,
                query_id=query_id,
                mean_before=before,
                mean_after=found.mean_after,
                window=found.window,
                at=time.time(),
            )
            self.drift_events.append(event)
            self.dashboard.observe_drift(event)
            log.info(
                "drift on stream %s, %s: %s -> %.2f (value %d)",
                stream,
                signal,
                "?" if before is None else f"{before:.2f}",
                found.mean_after,
                found.position,
            )
            if self.metrics is not None:
                self.metrics.drift_events.labels(self.metrics.stream(stream), signal).inc()
        return detected

    async def _react_to_drift(self, stream: str, keep: int) -> None:
        """Trim the drifted stream's window to its last ``keep`` outcomes, queued ones applied first
        (best-effort: Redis may be down)."""
        await self.apply_windows()
        try:
            await self.windows.keep_last(stream, keep)
            self.stats.drift_reactions += 1
        except (RedisError, OSError) as exc:
            log.warning("Redis unreachable (%s): the window of drifted stream %s was not trimmed", exc, stream)

    def take_dead_letters(self) -> list[DeadLetter]:
        """The dead letters of the halves dropped since the last call."""
        taken, self.dropped = self.dropped, []
        return taken

    # --- records ----------------------------------------------------------------------------------------------
    def warm_start(self, source) -> None:
        """Start the trainer from offline training when there is no checkpoint yet (a later start resumes instead)."""
        if self.version == 0:
            self.trainer.warm_start(source)
            self.version = 1
            self.checkpoint()

    async def on_experience(self, experience: AnyExperience, record) -> tuple[Policy | None, DeadLetter | None]:
        qid = experience.query_id
        if qid in self.done or qid in self.experience:
            self.stats.duplicates += 1
            return None, None
        if reason := self.trainer.check(experience):
            self.stats.invalid_experience += 1
            return None, dead_letter(record, f"experience does not fit the pool: {reason}", "learner")
        confidence = self.trainer.confidence(experience)
        self.dashboard.observe_answer(experience.stream, confidence, self.trainer.composition(experience))
        self._observe_drift(experience.stream, {"confidence": confidence}, qid)
        if qid in self.feedback:
            held = self.feedback.pop(qid)
            return await self._join(experience, held.message, held.record, held.at - event_time(record))
        # the experience itself is held apart
        coordinates = {
            **dead_letter(record, "", "learner").model_dump(),
            "value_b64": "",
        }
        self._hold(self.experience, qid, experience, record, coordinates)
        return None, None

    async def on_feedback(self, feedback: Feedback, record) -> tuple[Policy | None, DeadLetter | None]:
        qid = feedback.query_id
        if not self.tokens.valid(qid, feedback.token):
            self.stats.forged_feedback += 1
            return None, dead_letter(
                record, f"feedback token does not match query {qid} (not from its answer)", "learner"
            )
        if qid in self.done or qid in self.feedback:
            self.stats.duplicates += 1
            return None, None
        coordinates = dead_letter(record, "", "learner").model_dump()
        if qid in self.experience:
            held = self.experience.pop(qid)
            return await self._join(held.message, feedback, coordinates, event_time(record) - held.at)
        self._hold(self.feedback, qid, feedback, record, coordinates)
        return None, None

    async def _join(
        self, experience: AnyExperience, feedback: Feedback, record: dict, delay_s: float
    ) -> tuple[Policy | None, DeadLetter | None]:
        """Train on the pair; ``delay_s``: how long after the experience its feedback was written (event time)."""
        self._remember_done(experience.query_id)
        try:
            if feedback.stream is not None and feedback.stream != experience.stream:
                raise FeedbackError(
                    f"feedback for stream {feedback.stream!r}, query {experience.query_id} is on stream {experience.stream!r}"
                )
            reward = self.trainer.reward(experience, feedback)
        except FeedbackError as exc:
            self.stats.invalid_feedback += 1
            return None, DeadLetter.model_validate({**record, "reason": str(exc), "at": time.time()})
        row = self.trainer.window_row(experience, feedback)
        if row is not None:
            self.window_backlog.append([experience.stream, experience.query_id, *row, reward])
            if len(self.window_backlog) >= APPLY_BATCH:
                await self.apply_windows()
        self.trainer.remember(experience, feedback, reward)
        if self.metrics is not None:
            self.metrics.observe_join(experience.stream, reward, delay_s)
        # open-ended rl_focal: the reference's candidate
        label = (row[1] if row[1] >= 0 else None) if row is not None else feedback.label
        signals = signals_of_outcome(
            getattr(experience, "answer_index", None),
            label,
            reward,
            getattr(experience, "predictions", None),
            self.models,
        )
        self.dashboard.observe_join(experience.stream, signals, reward, delay_s)
        if (
            self._observe_drift(experience.stream, signals, experience.query_id)
            and self.drift_keep is not None
            and row is not None
        ):
            await self._react_to_drift(experience.stream, self.drift_keep)
        self.stats.joined += 1
        if self.trainer.update_due():
            return self.update(), None
        return None, None

    def _remember_done(self, query_id: str) -> None:
        self.done[query_id] = time.time()
        while len(self.done) > self.done_limit:
            self.done.popitem(last=False)

    async def apply_windows(self) -> None:
        """Apply the window backlog to Redis in order, retrying for at most ``redis_wait_s``; what Redis did not
        take stays in the backlog (bounded: the oldest outcomes go first) for the next call."""
        delay, waited = 0.05, 0.0
        while self.window_backlog and time.monotonic() >= self._redis_retry_at:
            batch = list(itertools.islice(self.window_backlog, APPLY_BATCH))
            # a row no window can hold is dropped, never blocks the others
            errors = [self.windows.row_error(*outcome[2:]) for outcome in batch]
            try:
                applied = await self.windows.apply_many([outcome for outcome, error in zip(batch, errors) if not error])
                for outcome, error in zip(batch, errors):
                    self.window_backlog.popleft()
                    if error:
                        log.error("outcome of query %s dropped: %s", outcome[1], error)
                self.stats.windows_applied += sum(applied)
            except (RedisError, OSError) as exc:
                self.stats.redis_retries += 1
                if waited >= self.redis_wait_s:
                    log.warning(
                        "Redis unreachable (%s): %d outcomes wait in the backlog; next try in 2 s",
                        exc,
                        len(self.window_backlog),
                    )
                    self._redis_retry_at = time.monotonic() + 2.0
                    break
                log.warning("Redis unreachable (%s); retrying in %.2f s", exc, delay)
                await asyncio.sleep(delay)
                waited += delay
                delay = min(2 * delay, 2.0)
        while len(self.window_backlog) > self.backlog_limit:
            self.window_backlog.popleft()
            self.stats.window_backlog_dropped += 1

    def update(self) -> Policy | None:
        """One update on the buffered transitions, a checkpoint, and the new policy version to publish; None
        (and the update undone, its transitions dropped) when it raised or left non-finite weights."""
        before, started = self.trainer.snapshot(), time.perf_counter()
        try:
            stats = self.trainer.update()
            problem = f"non-finite weights in {bad[:3]}" if (bad := non_finite(self.trainer.policy_tensors())) else None
        except Exception as exc:  # a numerical failure must not stop learning: undo it and go on
            log.exception("update failed")
            problem = f"{type(exc).__name__}: {exc}"
        if self.metrics is not None:
            self.metrics.updates.labels("undone" if problem else "applied").inc()
            self.metrics.update_seconds.observe(time.perf_counter() - started)
        if problem:
            self.trainer.restore(before)
            self.trainer.clear()
            self.stats.rejected_updates += 1
            log.error("update undone, its transitions dropped: %s", problem)
            return None
        self.stats.last_update = stats
        self.stats.updates += 1
        if self.metrics is not None:
            for name, value in stats.items():
                self.metrics.last_update.labels(name).set(value)
        self.version += 1
        self.dashboard.observe_policy(self.version)
        if self.checkpoint_due():
            self.checkpoint()
        log.info(
            "update %d: policy v%d (epoch %d), %d transitions joined",
            self.stats.updates,
            self.version,
            self.epoch,
            self.stats.joined,
        )
        return self.current_policy()

    def current_policy(self) -> Policy:
        return encode_policy(
            self.trainer.policy_tensors(), self.version, self.epoch, self.models, self.trainer.strategy, self.signer
        )
