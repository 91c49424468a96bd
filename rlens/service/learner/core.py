"""The learner: joins ``experience`` with ``feedback`` by query id, updates the Redis windows, runs a strategy's
update every so many joined transitions, checkpoints, and publishes each new ``policy`` version.

:class:`LearnerCore` is the logic without a transport; what is trained (RL-Focal's engine or the RLAE agent) is its
:class:`rlens.service.learner.online.OnlineTrainer`. Its parts: :mod:`.offsets` (what the state reflects),
:mod:`.window_writer` (the Redis windows and their backlog), :mod:`.drift_watch` (detections and the reaction),
:mod:`.pending` (unmatched halves). :mod:`.batches` hands it record batches; :mod:`.app` wires it to Kafka.

- **Trust.** Feedback whose token was not issued for its query id
  (:class:`rlens.service.common.security.FeedbackTokens`), or for another stream than the one it names, is
  dead-lettered on arrival, before it is held or counted, so a forged feedback can neither train nor block the true
  one; when it meets its query, a token issued for another stream is dead-lettered without taking the query's join.
  An experience that does not fit the pool (:meth:`OnlineTrainer.check`) is dead-lettered before it is held. Any
  other failure while handling one record dead-letters that record only.
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
  after each batch of records (or every 256 outcomes), in one pipelined round trip, once per query
  id. While Redis is unreachable the learner retries with backoff for at most ``redis_wait_s``, then keeps the outcome
  in a backlog (checkpointed, bounded) that is applied, in order, once Redis answers again; learning goes on.
- **Updates.** An update whose weights are not finite (or that raises) is undone: the weights and the optimizer
  return to their state before it, its transitions are dropped, and no policy is published.
- **Drift.** Each stream's signals (the outcome, each called model's correctness, and the answer's label-free
  confidence) feed a :class:`rlens.drift.DriftMonitor`; its detections go out as ``DriftEvent`` on ``drift`` and
  are counted. With ``drift_keep`` set (``RLENS_DRIFT_REACTION=trim``), a detection on a labelled signal trims the
  stream's Redis window to its last ``drift_keep`` outcomes. The detectors' state is in the checkpoint, and
  :class:`rlens.service.learner.dashboard.Dashboard` keeps what ``/dashboard`` shows.
- **Policies** are signed (:class:`rlens.service.common.security.PolicySigner`) and ordered by (epoch, version)
  (:class:`rlens.service.learner.numbers.PolicyNumbers` gives them); the epoch is the learner's start time in
  milliseconds, so a restarted learner's policies supersede its predecessor's. The
  learner reads the policy topic too (:meth:`LearnerCore.on_policy`): a policy an operator set live (``rlens
  policy promote`` / ``rollback``) is trained on from then on (gated: the champion it replaced goes on probation,
  and comes back if the operator's is worse), and a restarted gated learner learns there of a verdict it published
  after its checkpoint. Reward and accuracy are kept per served version
  (:class:`rlens.service.learner.versions.VersionStats`).
- **Exactly-once effect across crashes.** A checkpoint holds the trainer (weights, optimizer, RNGs, buffer), the
  pending joins and the recent query ids (as marks in their journals, :mod:`rlens.service.learner.journal`, so
  its cost does not grow with what is held), the gate (:meth:`rlens.service.learner.gate.Gate.checkpoint`: the candidate
  judged and its evidence) and, per partition, the offset after the last record it reflects. Kafka
  offsets are committed only up to a checkpoint's offsets. After a crash the learner restores the newest
  checkpoint, skips re-delivered records below its offsets, and so neither loses nor re-applies a transition.
  Checkpoints are taken at most every ``checkpoint_every_s`` seconds (after an update or a batch, and by a timer
  while the learner is idle) and on shutdown, so their cost does not grow with the update rate. A policy may be
  published before the checkpoint that holds it; after a crash the learner re-learns from that checkpoint's
  offsets under a new epoch, whose versions supersede what it published before.
- **Shards.** ``role`` shard: the join's stages up to the windows, the OPE log, the metrics and drift, for the
  partitions the shard is assigned; each joined query is handed on (``handed``, a :class:`Transition`) and
  published before any checkpoint covers it, so a crash re-joins it and hands it on again. ``role`` trainer:
  :meth:`on_transition` trains on each query id once (``done``), feeds the gate and the version tallies, and
  updates. A shard detects drift on its share of each stream's outcomes.
- **Fencing.** One learner per checkpoint directory (:class:`rlens.checkpoint.CheckpointStore` locks it) and per
  consumer group (a lease in Redis, renewed every ``LEASE_TTL_S`` / 3 s); a second one refuses to start. A learner
  restarted on the directory of one that died takes its lease over at once (holding the directory's lock proves the
  other is gone); elsewhere the lease of a dead learner lapses after ``LEASE_TTL_S``. While Redis is down at start
  the group cannot be checked (a warning says so).
- **A new log.** A broker that lost its data (tansu's memory storage restarted, a topic recreated, ``rlens up``
  reusing a checkpoint with a fresh broker) serves offsets below the checkpoint's. A partition is a new log when its
  end, both as the last fetch saw it (the high watermark) and as the broker lists it, is below the offset the state
  reflects (each alone can mislead: tansu lists the start of a log's last producer batch, a new Kafka leader's high
  watermark may lag). Then the learner warns, forgets that partition's offset and reads the new log from its start.
  It looks where a batch holds records below that offset (a redelivery otherwise) and on every assigned partition
  every 0.5 s, batches or not, since a consumer whose position is past a new log's records never brings one below
  (tansu answers a fetch past a log's end with nothing). The join's duplicate check and the windows' once-per-query
  markers keep a misjudged redelivery harmless. A new log that has already grown past the old offset when it is
  first seen cannot be told apart: recreate topics only with the learner stopped, or give the learner a fresh
  checkpoint directory.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import asdict, dataclass

from redis.exceptions import RedisError

from rlens.checkpoint import CheckpointStore
from rlens.drift import DriftMonitor, signals_of_outcome
from rlens.messages import (
    TRANSITION,
    AnyExperience,
    DeadLetter,
    DriftEvent,
    Experience,
    Feedback,
    Message,
    Policy,
    RLAEExperience,
    Transition,
)
from rlens.service.learner.dashboard import Dashboard
from rlens.service.common.kafka import (
    dead_letter,
)
from rlens.service.learner.online import FeedbackError, OnlineTrainer
from rlens.service.common.metrics import (
    LearnerMetrics,
)
from rlens.service.learner.drift_watch import DriftWatch
from rlens.service.learner.gate import Gate
from rlens.focal.checkpoint import Groups
from rlens.service.learner.promotion import Promotion
from rlens.service.learner.numbers import PolicyNumbers
from rlens.service.learner.offsets import Offsets
from rlens.service.learner.ope_log import OpeLog
from rlens.service.learner.journal import Journal, Journaled
from rlens.service.learner.pending import Pending, PendingHalves, RecentIds
from rlens.service.learner.versions import VersionStats
from rlens.service.common.tracing import context_of_traceparent, tracer, tracing
from rlens.service.learner.window_writer import WindowWriter
from rlens.service.common.policy import PolicyError, decode_policy, encode_policy, non_finite
from rlens.service.common.security import FeedbackTokens, PolicySigner
from rlens.service.common.windows import RedisWindows

log = logging.getLogger("rlens.learner")


def event_time(record) -> float:
    """A consumer record's timestamp in seconds (now, for a record without one)."""
    timestamp = getattr(record, "timestamp", None)
    return timestamp / 1000 if isinstance(timestamp, (int, float)) and timestamp > 0 else time.time()


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
    # streams whose calibrations were fitted and published (RLENS_FOCAL_CALIBRATION_ROWS)
    calibrations_published: int = 0
    new_logs: int = 0  # partitions found restarted from offset 0 (a broker that lost its data)
    drift_reactions: int = 0  # drifted streams whose window was trimmed
    promotions: int = 0  # candidates promoted by the gate (gated promotion)
    dropped_candidates: int = 0  # candidates the gate dropped
    resumed: int = 0  # holdback: challengers after which the learner's updates served at once again
    rollbacks: int = 0  # promoted champions rolled back to the one they replaced
    last_update: dict | None = None

    def count_verdict(self, verdict: str) -> None:
        """One of the gate's verdicts (an inconclusive look counts nowhere)."""
        counter = {"promote": "promotions", "roll back": "rollbacks", "drop": "dropped_candidates", "resume": "resumed"}
        if verdict in counter:
            setattr(self, counter[verdict], getattr(self, counter[verdict]) + 1)


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
        refit_interval_s: float = 0.0,
        checkpoint_every_s: float = 5.0,
        drift: DriftMonitor | None = None,
        drift_keep: int | None = None,
        ope_log: OpeLog | None = None,
        gate: Gate | None = None,
        role: str = "all",
        shard: int = 0,
    ):
        """``role``: all (joins and trains), shard (joins; each joined query handed to the trainer: ``handed``) or
        trainer (trains on the shards' transitions, :meth:`on_transition`); ``shard``: a shard's index."""
        self.role, self.shard = role, shard
        self.handed: list[Transition] = []  # a shard's joined queries, until the app publishes them
        self.trainer, self.models, self.windows, self.checkpoints = trainer, models, windows, checkpoints
        self.signer, self.tokens, self.verifier = signer, tokens, signer.verifier()
        self.pending_limit, self.pending_ttl_s = pending_limit, pending_ttl_s
        self.numbers = PolicyNumbers()
        self.operator_seen = (0, 0)  # (epoch, version) of the newest operator's policy adopted (signed, never a clock)
        self.offsets = Offsets()
        self.experience: PendingHalves[AnyExperience] = PendingHalves(pending_limit, pending_bytes, pending_per_stream)
        self.feedback: PendingHalves[Feedback] = PendingHalves(pending_limit, pending_bytes, pending_per_stream)
        self.clock = 0.0  # the newest event time (record timestamp, seconds) read
        self.dropped: list[DeadLetter] = []  # dead letters of expired or evicted halves, until the app publishes them
        self.metrics: LearnerMetrics | None = None  # set by the app
        self.done = RecentIds(done_limit)
        journals = checkpoints.directory / "journal"
        self.journals = {
            name: Journal(journals, name, keep=checkpoints.keep) for name in ("experience", "feedback", "done")
        }
        self.stats = LearnerStats()
        self.writer = WindowWriter(windows, redis_wait_s, backlog_limit, refit_interval_s=refit_interval_s)
        self.name = f"{socket.gethostname()}-{os.getpid()}"
        self.checkpoint_every_s = checkpoint_every_s
        self.last_checkpoint = float("-inf")  # monotonic time of the newest checkpoint
        self.checkpointed_version = 0
        self.versions = VersionStats()
        self.dashboard = Dashboard(trainer.strategy, models, self.versions)
        # drift_keep: trim a drifted stream's window to this many outcomes (None: no reaction)
        self.drift = DriftWatch(drift, drift_keep, self.dashboard)
        self.ope_log = ope_log
        # None: every update goes live (RLENS_PROMOTION=direct)
        self.promotion = Promotion(gate, self) if gate is not None else None
        restored = trainer.load(checkpoints)
        if restored is not None:
            self._restore(*restored)

    # --- state ------------------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.numbers.epoch

    @property
    def version(self) -> int:
        """The newest version given (:class:`PolicyNumbers` gives them)."""
        return self.numbers.version

    def _restore(self, state: dict, tensors: Groups) -> None:
        self.numbers.at_least(state["version"])
        self.offsets = Offsets(state["offsets"])
        if "journals" in state:
            marks = state["journals"]
            self.experience.replay(self.journals["experience"].restore(marks["experience"]), self.trainer.experience)
            self.feedback.replay(self.journals["feedback"].restore(marks["feedback"]), Feedback)
            self.done.replay(self.journals["done"].restore(marks["done"]))
        else:  # a checkpoint of before the journals (every half and id in state.json)
            self.experience.load_json(state["experience"], self.trainer.experience)
            self.feedback.load_json(state["feedback"], Feedback)
            self.done.replay(["+", q, at] for q, at in state["done"])
        self.clock = state["clock"]
        self.stats = LearnerStats(**state["stats"])
        self.writer.backlog.extend(state["window_backlog"])
        self.drift.load_json(state.get("drift", []))
        self.versions.load_json(state.get("versions", []))
        seen = state.get("operator_seen")
        self.operator_seen = (int(seen[0]), int(seen[1])) if isinstance(seen, list) else (0, 0)
        if self.promotion is not None:
            self.promotion.restored(state.get("gate"), tensors.get("gate", {}))
        log.info("resumed from checkpoint v%d (%d joined)", self.version, self.stats.joined)

    def checkpoint(self) -> None:
        if self.ope_log is not None:  # before the checkpoint covers the joins it logged
            self.ope_log.flush()
        state = {
            "offsets": self.offsets.read,
            "journals": self._write_journals(),
            "clock": self.clock,
            "window_backlog": list(self.writer.backlog),
            "stats": asdict(self.stats),
            "drift": self.drift.to_json(),
            "versions": self.versions.to_json(),
            "operator_seen": list(self.operator_seen),
        }
        extra = {}
        if self.promotion is not None:
            state["gate"], extra["gate"] = self.promotion.gate.checkpoint()
        self.trainer.save(self.checkpoints, self.version, state, extra)
        self.offsets.checkpointed_now()
        self.checkpointed_version = self.version
        self.last_checkpoint = time.monotonic()

    def _write_journals(self) -> dict:
        """What the held halves and the recent ids changed since the last checkpoint, on disk; each journal's mark."""
        held: dict[str, Journaled] = {"experience": self.experience, "feedback": self.feedback, "done": self.done}
        return {name: self.journals[name].write(collection) for name, collection in held.items()}

    def checkpoint_due(self) -> bool:
        """Whether the state moved on since the newest checkpoint and that one is ``checkpoint_every_s`` old."""
        moved = self.offsets.moved() or self.version != self.checkpointed_version
        # a shard's checkpoint never covers a join not yet handed on: a crash re-joins it (the trainer drops repeats)
        return moved and not self.handed and time.monotonic() - self.last_checkpoint >= self.checkpoint_every_s

    @property
    def window_backlog(self):
        """The outcomes not yet in Redis, oldest first."""
        return self.writer.backlog

    def already_seen(self, record) -> bool:
        return self.offsets.already_seen(record)

    def new_logs(self, ends: dict[str, int]) -> None:
        self.offsets.new_logs(ends)
        self.stats.new_logs += len(ends)

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
        return self.drift.take_events()

    def take_dead_letters(self) -> list[DeadLetter]:
        """The dead letters of the halves dropped since the last call."""
        taken, self.dropped = self.dropped, []
        return taken

    # --- records ----------------------------------------------------------------------------------------------
    def warm_start(self, source) -> None:
        """Start the trainer from offline training when there is no checkpoint yet (a later start resumes instead);
        gated, the warm-started policy is the first champion (:meth:`Promotion.warm_started`)."""
        if self.version == 0:
            self.trainer.warm_start(source)
            self.numbers.next()
            self.checkpoint()
            if self.promotion is not None:
                self.promotion.warm_started()

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
        self.drift.observe(experience.stream, {"confidence": confidence}, qid, self.metrics)
        if qid in self.feedback and not self.tokens.valid(
            qid, experience.stream, self.feedback.items[qid].message.token
        ):
            self.stats.forged_feedback += 1
            self._drop(self.feedback.pop(qid), self._other_stream(qid, experience.stream))
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
        if not self.tokens.issued(qid, feedback.token) or (
            feedback.stream is not None and not self.tokens.valid(qid, feedback.stream, feedback.token)
        ):
            self.stats.forged_feedback += 1
            return None, dead_letter(
                record, f"feedback token does not match query {qid} (not from its answer)", "learner"
            )
        if qid in self.done or qid in self.feedback:
            self.stats.duplicates += 1
            return None, None
        coordinates = dead_letter(record, "", "learner").model_dump()
        if qid in self.experience and not self.tokens.valid(
            qid, self.experience.items[qid].message.stream, feedback.token
        ):
            self.stats.forged_feedback += 1
            return None, dead_letter(
                record, self._other_stream(qid, self.experience.items[qid].message.stream), "learner"
            )
        if qid in self.experience:
            held = self.experience.pop(qid)
            return await self._join(held.message, feedback, coordinates, event_time(record) - held.at)
        self._hold(self.feedback, qid, feedback, record, coordinates)
        return None, None

    @staticmethod
    def _other_stream(query_id: str, stream: str) -> str:
        return f"feedback token of query {query_id} was issued for another stream than its query's ({stream!r})"

    async def _join(
        self, experience: AnyExperience, feedback: Feedback, record: dict, delay_s: float
    ) -> tuple[Policy | None, DeadLetter | None]:
        """Train on the pair, stage by stage; ``delay_s``: how long after the experience its feedback was written
        (event time). A feedback that does not fit its experience is a dead letter and goes no further."""
        self._remember_done(experience.query_id)
        try:
            reward = self._reward(experience, feedback)
        except FeedbackError as exc:
            self.stats.invalid_feedback += 1
            return None, DeadLetter.model_validate({**record, "reason": str(exc), "at": time.time()})
        row = self.trainer.window_row(experience, feedback)
        label = int(row[1]) if row is not None else None
        await self._window(experience, row, reward)
        if self.role == "shard":
            self.handed.append(
                TRANSITION[self.trainer.strategy].model_validate(
                    {
                        "query_id": experience.query_id,
                        "experience": experience,
                        "feedback": feedback,
                        "reward": reward,
                        "label": label,
                        "shard": self.shard,
                    }
                )
            )
        else:
            self.trainer.remember(experience, feedback, reward)
        self._evidence(experience, label, reward)
        signals = self._observe(experience, feedback, row, reward, delay_s)
        if self.role == "all":
            self._tally(experience.policy_version, reward, signals, label, feedback)
        await self._drift(experience, signals, row)
        self.stats.joined += 1
        if tracing():
            self._trace_join(experience, reward, delay_s)
        return (self.update(), None) if self.role == "all" and self.trainer.update_due() else (None, None)

    async def on_transition(self, transition: Transition, record) -> tuple[Policy | None, DeadLetter | None]:
        """(The trainer) One query a shard joined: trained on once (a shard that re-joins after a crash hands it
        on again), its evidence to the gate, counted for its policy version; an update when one is due."""
        experience = transition.experience
        if experience.query_id in self.done:
            self.stats.duplicates += 1
            return None, None
        if reason := self.trainer.check(experience):
            self.stats.invalid_experience += 1
            return None, dead_letter(record, f"experience does not fit the pool: {reason}", "learner")
        self._remember_done(experience.query_id)
        self.clock = max(self.clock, event_time(record))
        self.trainer.remember(experience, transition.feedback, transition.reward)
        self._evidence(experience, transition.label, transition.reward)
        signals = signals_of_outcome(
            getattr(experience, "answer_index", None),
            self._label_of(transition.label, transition.feedback),
            transition.reward,
            getattr(experience, "predictions", None),
            self.models,
        )
        self._tally(experience.policy_version, transition.reward, signals, transition.label, transition.feedback)
        self.stats.joined += 1
        if self.metrics is not None:
            self.metrics.joined.labels(self.metrics.stream(experience.stream)).inc()
        return (self.update(), None) if self.trainer.update_due() else (None, None)

    def take_handed(self) -> list[Transition]:
        """(A shard) The joined queries to hand to the trainer since the last call."""
        taken, self.handed = self.handed, []
        return taken

    def _reward(self, experience: AnyExperience, feedback: Feedback) -> float:
        """The pair's reward (FeedbackError: feedback for another stream, or one the trainer cannot score)."""
        if feedback.stream is not None and feedback.stream != experience.stream:
            raise FeedbackError(
                f"feedback for stream {feedback.stream!r}, query {experience.query_id} is on stream {experience.stream!r}"
            )
        return self.trainer.reward(experience, feedback)

    async def _window(self, experience: AnyExperience, row: tuple[list[int], int] | None, reward: float) -> None:
        """The outcome's row (and calibration rows) queued for its stream's Redis window, written when due."""
        calibration = self.trainer.calibration_rows(experience, row[1]) if row is not None else None
        if row is not None and self.writer.queue(experience.stream, experience.query_id, row, reward, calibration):
            await self.apply_windows()

    def _evidence(self, experience: AnyExperience, label: int | None, reward: float) -> None:
        """What off-policy evaluation and the gate learn from the outcome (``label``: its window row's): the OPE log,
        the shadow or split evidence."""
        if isinstance(experience, Experience) and label is not None:
            if self.ope_log is not None:
                self.ope_log.append(experience, label)
            if self.promotion is not None:
                self.promotion.observe(experience, label)
        if isinstance(experience, RLAEExperience) and self.promotion is not None:
            self.promotion.observe_split(experience, reward)

    def _observe(
        self,
        experience: AnyExperience,
        feedback: Feedback,
        row: tuple[list[int], int] | None,
        reward: float,
        delay_s: float,
    ) -> dict:
        """The outcome counted where operators look (metrics, the dashboard); its signals (the ensemble and each
        called model right or wrong, the confidence), which drift detection reads next."""
        if self.metrics is not None:
            self.metrics.observe_join(experience.stream, reward, delay_s)
        signals = signals_of_outcome(
            getattr(experience, "answer_index", None),
            self._label_of(row[1] if row is not None else None, feedback),
            reward,
            getattr(experience, "predictions", None),
            self.models,
        )
        self.dashboard.observe_join(experience.stream, signals, reward, delay_s)
        return signals

    @staticmethod
    def _label_of(row_label: int | None, feedback: Feedback) -> int | None:
        """The outcome's label: its window row's (open-ended rl_focal: the reference's candidate, None when no model
        gave it), else the feedback's."""
        return (row_label if row_label >= 0 else None) if row_label is not None else feedback.label

    def _tally(self, version: int, reward: float, signals: dict, row_label: int | None, feedback: Feedback) -> None:
        """The outcome in its policy version's tallies (where the trainer is: the versions are its)."""
        labelled = self._label_of(row_label, feedback) is not None
        let_go = self.versions.observe(version, reward, bool(signals["outcome"]) if labelled else None)
        if self.metrics is not None and version in self.versions.tallies:
            self.metrics.observe_version(self.versions.tallies[version].row(version), let_go)

    async def _drift(self, experience: AnyExperience, signals: dict, row: tuple[list[int], int] | None) -> None:
        """Drift detection on the outcome's signals: a drift restarts the candidate's evidence (``drift_reset``)
        and, with the trim reaction, cuts the stream's window."""
        drifted = self.drift.observe(experience.stream, signals, experience.query_id, self.metrics)
        if drifted and self.promotion is not None and self.promotion.gate.drifted():
            log.info("drift on stream %s: the candidate's evidence starts again", experience.stream)
        if drifted and self.drift.keep is not None and row is not None:
            await self.apply_windows()  # the queued outcomes first, then the trim
            self.stats.drift_reactions += await self.drift.react(experience.stream, self.windows)

    @staticmethod
    def _trace_join(experience: AnyExperience, reward: float, delay_s: float) -> None:
        """The join as a span of its query's trace (the worker's answer span is its parent)."""
        attributes: dict[str, str | float | int] = {
            "rlens.query_id": experience.query_id,
            "rlens.stream": experience.stream,
            "rlens.reward": reward,
            "rlens.feedback_delay_s": delay_s,
            "rlens.policy_version": experience.policy_version,
        }
        span = tracer().start_span(
            "rlens.learner join", context=context_of_traceparent(experience.trace), attributes=attributes
        )
        span.end()

    def _remember_done(self, query_id: str) -> None:
        self.done.add(query_id, time.time())

    async def apply_windows(self) -> None:
        """The queued outcomes to Redis (:meth:`WindowWriter.apply`)."""
        done = await self.writer.apply()
        self.stats.windows_applied += done.windows_applied
        self.stats.redis_retries += done.redis_retries
        self.stats.window_backlog_dropped += done.window_backlog_dropped
        if self.writer.new_rows:
            try:
                self.stats.calibrations_published += await self.writer.refit()
            except (RedisError, OSError) as exc:
                log.warning("Redis unreachable (%s): the streams' calibrations are fitted later", exc)

    def update(self) -> Policy | None:
        """One update on the buffered transitions, a checkpoint, and the new policy version to publish; None
        (and the update undone, its transitions dropped) when it raised or left non-finite weights."""
        before, started = self.trainer.snapshot(), time.perf_counter()
        span = tracer().start_span("rlens.learner update", attributes={"rlens.joined": self.stats.joined})
        try:
            stats = self.trainer.update()
            problem = f"non-finite weights in {bad[:3]}" if (bad := non_finite(self.trainer.policy_tensors())) else None
        except Exception as exc:  # a numerical failure must not stop learning: undo it and go on
            log.exception("update failed")
            problem = f"{type(exc).__name__}: {exc}"
        span.set_attribute("rlens.update", "undone" if problem else "applied")
        span.end()
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
        self.numbers.next()
        self.dashboard.observe_policy(self.version)
        if self.promotion is not None:
            self.promotion.updated()
        if self.checkpoint_due():
            self.checkpoint()
        log.info(
            "update %d: policy v%d (epoch %d), %d transitions joined",
            self.stats.updates,
            self.version,
            self.epoch,
            self.stats.joined,
        )
        return None if self.promotion is not None else self.current_policy()

    def on_policy(self, policy: Policy) -> list[Policy]:
        """A record of the policy topic (its history first). A live policy an operator published after the last one
        this learner adopted is trained on from here (gated: the champion it replaced goes on probation; direct:
        republished under this learner's newest version if the workers would not take it); any other live policy
        tells a gated learner what the workers serve. Operators' policies are ordered by their signed (epoch,
        version), so a replayed older one is never adopted again. Returns what to publish."""
        if policy.stage != "live" or policy.strategy != self.trainer.strategy or policy.models != self.models:
            return []
        if policy.origin == "learner" and policy.epoch == self.epoch:
            return []  # its own
        try:
            tensors = decode_policy(policy, self.trainer.policy_tensors(), self.models, policy.strategy, self.verifier)
        except PolicyError as exc:
            log.warning("policy topic: %s (ignored)", exc)
            return []
        operator = policy.origin == "operator" and (policy.epoch, policy.version) > self.operator_seen
        if operator:
            self.operator_seen = (policy.epoch, policy.version)
            self.trainer.load_policy(tensors)
            if policy.epoch == self.epoch:
                self.numbers.at_least(policy.version)
        if self.promotion is not None:
            self.promotion.served((policy.epoch, policy.version), tensors, operator)
        if not operator:
            return []
        log.warning(
            "an operator set policy v%d (epoch %d) live (%s); training goes on from it",
            policy.version,
            policy.epoch,
            policy.note or "no note",
        )
        self.dashboard.observe_policy(policy.version, policy.note or "set live by an operator")
        published = []
        if self.promotion is None and (self.epoch, self.version) > (policy.epoch, policy.version):
            self.numbers.next()  # the workers serve this learner's newer versions: the operator's, renumbered
            published.append(self.current_policy(f"v{policy.version} of epoch {policy.epoch}, set live by an operator"))
        self.checkpoint()
        return published

    def take_policies(self) -> list[Policy]:
        """The candidates, promotions and roll-backs since the last call (gated promotion)."""
        return self.promotion.take() if self.promotion is not None else []

    def announcement(self) -> Policy | None:
        """What a (re)started learner announces: its policy (direct), or the champion it promoted (gated; none
        before its first promotion: the workers read the policy topic's history)."""
        if self.promotion is not None:
            return self.promotion.announcement()
        return self.current_policy() if self.version > 0 else None

    def first_policy(self) -> Policy | None:
        """Gated and fresh (no checkpoint, no warm start): the seeded policy as the first live one, v1, for a policy
        topic that holds nothing yet (:meth:`Promotion.first_policy`); None otherwise."""
        if self.promotion is None or self.version != 0:
            return None
        return self.promotion.first_policy()

    def current_policy(self, note: str = "") -> Policy:
        return encode_policy(
            self.trainer.policy_tensors(),
            self.version,
            self.epoch,
            self.models,
            self.trainer.strategy,
            self.signer,
            note=note,
        )
