"""The ensemble worker: ``queries`` → a strategy's answers → ``answers`` + ``experience``.

:class:`Worker` is what every strategy's worker shares (the policy slot, counters, which queries it takes);
:class:`FocalWorker` is the ``rl_focal`` strategy: windows from Redis → Decider → only the chosen backends →
Fusion (the ``rlae`` one is :class:`rlens.service.rlae_worker.RLAEWorker`). A multiple-choice query has each chosen
model score its choices; an open-ended one has each sample ``n`` texts, and the Fusion agent picks one of the
answers extracted from them (the answer's ``candidates``). Both are the whole logic without a
transport (tests drive them directly); :func:`create_worker_app` wires one to Kafka with FastStream.

A batch of queries is parsed (what does not parse, or is of the other strategy's kind, goes to the dead-letter
topic with the reason). For ``rl_focal``, the windows of its streams are read from Redis in one round trip (if
Redis is down, the windows are cold and the worker keeps answering), the pools are chosen, every query's pool is
called concurrently (:class:`rlens.models.ensemble.PoolCaller`: failures become records), and the answers are fused.
Outputs are published before the batch's offsets are committed (at-least-once; answers are keyed and idempotent
by query id), so a worker killed mid-batch leaves its batch to be answered again by the group. A query that names
a gateway replica's reply topic (``reply_to``, under ``<prefix>replies.``; any other is dead-lettered) has its
answer published there too, signed (:meth:`FeedbackTokens.sign`), and on the shared ``answers`` topic without its
feedback token. A batch that
raises is split in halves until the query that raises is alone; that one is dead-lettered with the reason and the
others are answered, so no message can make the worker retry a batch forever. Each answer carries the query's
feedback token (:class:`rlens.service.security.FeedbackTokens`).

Policy weights arrive on the ``policy`` topic. A policy newer by (epoch, version) is verified
(:func:`decode_policy`: the learner's signature, pool, shapes, dtypes, finite values) when it arrives and swapped
in between batches, never during one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import torch
from faststream import AckPolicy
from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaMessage
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from rlens.backends.base import Backend, ChoiceQuery, GenerationRequest
from rlens.models.answers import Extractor
from rlens.models.ensemble import PoolCaller, PoolQuery
from rlens.focal.engine import FocalEngine
from rlens.messages import (
    EXPERIENCE,
    MAX_CHOICES,
    TENANT_MARK,
    Answer,
    DeadLetter,
    Experience,
    Message,
    ModelFailureRecord,
    Policy,
    Query,
)
from rlens.service.kafka import (
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
from rlens.service.metrics import (
    admin_token,
    StreamLabels,
    WorkerMetrics,
    dead_letter_kind,
    failure_kind,
    http_routes,
    not_ready,
    settings_url,
)
from rlens.service.policy import PolicyError, decode_policy
from rlens.service.security import FeedbackTokens, PolicyVerifier
from rlens.service.windows import RedisWindows
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


@dataclass
class BatchOutput:
    answers: list[Answer] = field(default_factory=list)
    experience: list[Message] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # query id -> why it could not be answered (dead-lettered)
    # seconds spent in each stage (window_read, decide, pool_call, fuse, decode)
    stages: dict[str, float] = field(default_factory=dict)

    def extend(self, other: "BatchOutput") -> None:
        self.answers += other.answers
        self.experience += other.experience
        self.failed.update(other.failed)
        for stage, seconds in other.stages.items():
            self.stages[stage] = self.stages.get(stage, 0.0) + seconds


@dataclass
class WorkerStats:
    answered: int = 0
    dead_lettered: int = 0
    no_model_answered: int = 0  # answered with an empty answer and the failures
    cold_window_batches: int = 0  # batches answered with cold windows because Redis was unreachable
    policies_loaded: int = 0
    policies_rejected: int = 0


class Worker(ABC):
    """One strategy's worker: answers batches of queries; verified policy versions are swapped in between batches."""

    strategy: str

    def __init__(
        self,
        models: list[str],
        windows: RedisWindows,
        verifier: PolicyVerifier,
        tokens: FeedbackTokens,
        name: str | None = None,
    ):
        self.models, self.windows, self.verifier, self.tokens = models, windows, verifier, tokens
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.policy_epoch, self.policy_version = 0, 0
        self._next_policy: tuple[tuple[int, int], dict] | None = None
        self.stats = WorkerStats()

    @abstractmethod
    def rejects(self, query: Query) -> str | None:
        """Why this worker cannot answer ``query`` (it goes to the dead-letter topic), or None."""

    @abstractmethod
    async def handle(self, queries: list[Query]) -> BatchOutput:
        """Answer a batch of queries this worker accepts."""

    async def answer(self, queries: list[Query]) -> BatchOutput:
        """:meth:`handle`, isolating failures: a batch that raises is split until each query that raises is alone,
        and that one is in ``failed`` with the reason."""
        try:
            return await self.handle(queries)
        except Exception as exc:  # any bug or poison input: never let it stop the batch's other queries
            if len(queries) == 1:
                log.exception("query %s failed", queries[0].query_id)
                return BatchOutput(failed={queries[0].query_id: f"answering failed: {type(exc).__name__}: {exc}"})
        out = BatchOutput()
        half = len(queries) // 2
        for part in (queries[:half], queries[half:]):
            out.extend(await self.answer(part))
        return out

    def windows_read(self) -> dict:
        """The outcome windows the last batch read, by stream (none for strategies that keep no windows)."""
        return {}

    @abstractmethod
    def policy_tensors(self) -> dict[str, torch.Tensor]:
        """The weights a policy message replaces."""

    @abstractmethod
    def load_policy(self, tensors: dict[str, torch.Tensor]) -> None: ...

    # --- policy -----------------------------------------------------------------------------------------------
    def receive_policy(self, policy: Policy) -> str | None:
        """Verify a policy now; it is loaded before the next batch. A genuine one not newer by (epoch, version)
        than the newest verified one is ignored (a replay of the topic); a forged one is rejected whatever its order.
        Why it was rejected, or None."""
        order = (policy.epoch, policy.version)
        try:
            if order > max(
                (self.policy_epoch, self.policy_version), self._next_policy[0] if self._next_policy else (0, 0)
            ):
                self._next_policy = (
                    order,
                    decode_policy(policy, self.policy_tensors(), self.models, self.strategy, self.verifier),
                )
            elif not self.verifier.verify(policy.signed_bytes(), policy.signature):
                raise PolicyError(
                    f"policy v{policy.version} (epoch {policy.epoch}): bad signature (not signed by this deployment's learner)"
                )
        except PolicyError as exc:
            self.stats.policies_rejected += 1
            log.error("rejected %s", exc)
            return str(exc)
        return None

    def swap_policy(self) -> None:
        """Load the newest verified policy, if one arrived since the last batch."""
        if self._next_policy is not None:
            (epoch, version), tensors = self._next_policy
            self.load_policy(tensors)
            self.policy_epoch, self.policy_version, self._next_policy = epoch, version, None
            self.stats.policies_loaded += 1


class FocalWorker(Worker):
    """The ``rl_focal`` strategy: the Decider's pool, the Fusion agent's answer among the query's choices (or, open-ended,
    among the answers the pool's samples hold; ``sampling`` says how the models sample, ``extractor`` how an answer is
    read from a sample)."""

    strategy = "rl_focal"

    def __init__(
        self,
        engine: FocalEngine,
        models: list[str],
        backends: dict[str, Backend],
        windows: RedisWindows,
        verifier: PolicyVerifier,
        tokens: FeedbackTokens,
        deadline_s: float = 60.0,
        model_concurrency: int = 8,
        circuit_failures: int = 5,
        circuit_cooldown_s: float = 30.0,
        name: str | None = None,
        sampling: GenerationRequest | None = None,
        extractor: Extractor = "line",
    ):
        if list(backends) != models:
            raise ValueError(f"backends {list(backends)} are not the pool's models {models}")
        super().__init__(models, windows, verifier, tokens, name)
        self.engine = engine
        self.names = np.array(models)
        self.sampling = sampling or Settings.model_construct().focal_sampling()  # None: the settings' defaults
        # at most MAX_CHOICES - 1 candidates: "none of them" (n_choices) must stay a valid window label
        self.caller = PoolCaller(
            backends, deadline_s, model_concurrency, circuit_failures, circuit_cooldown_s, extractor, MAX_CHOICES - 1
        )

    def windows_read(self) -> dict:
        return self.engine.windows

    def rejects(self, query: Query) -> str | None:
        return None

    def policy_tensors(self) -> dict[str, torch.Tensor]:
        return self.engine.policy_state()

    def load_policy(self, tensors: dict[str, torch.Tensor]) -> None:
        self.engine.load_policy_state(tensors)

    # --- queries ----------------------------------------------------------------------------------------------
    async def handle(self, queries: list[Query]) -> BatchOutput:
        self.swap_policy()
        out = BatchOutput()
        started = lap = time.perf_counter()

        def stage(name: str) -> None:
            nonlocal lap
            now = time.perf_counter()
            out.stages[name] = now - lap
            lap = now

        streams = sorted({q.stream for q in queries})
        try:
            windows, last_pools = await self.windows.load_with_pools(streams)
            self.engine.windows = {}  # this batch's streams only
            self.engine.windows.update(windows)
            for stream, pool in last_pools.items():  # shared by the workers (Redis); without one, this worker's own
                self.engine.remember_pool(stream, pool)
        except (RedisError, OSError) as exc:
            self.stats.cold_window_batches += 1
            log.warning("Redis unreachable (%s): answering with cold windows", exc)
            self.engine.reset_windows()
        stage("window_read")
        cfg = self.engine.cfg
        rng = self.engine.rng
        probes = [cfg.probe_rate > 0 and rng.random() < cfg.probe_rate for _ in queries]
        greedy = [not (cfg.explore_rate > 0 and rng.random() < cfg.explore_rate) for _ in queries]
        decisions = self.engine.decide_batch(
            [(q.stream, len(q.choices) if q.choices else 0, p, g) for q, p, g in zip(queries, probes, greedy)]
        )
        try:
            await self.windows.save_pools(
                {stream: self.engine.previous_pool[stream] for stream in streams if stream in self.engine.previous_pool}
            )
        except (RedisError, OSError) as exc:
            log.warning("Redis unreachable (%s): the streams' last pools stay in this worker", exc)
        stage("decide")
        pool_queries, called = [self._pool_query(q) for q in queries], [d.called for d in decisions]
        calls = (
            await asyncio.to_thread(self.caller.ask_batch, pool_queries, called)
            if self.caller.blocking
            else self.caller.ask_batch(pool_queries, called)
        )
        stage("pool_call")
        fused_pools = [self._fused_pool(d, c) for d, c in zip(decisions, calls)]
        answerable = [i for i, pool in enumerate(fused_pools) if pool.any()]
        fused = (
            self.engine.fuse_batch(
                [replace(decisions[i], pool=fused_pools[i]) for i in answerable], [calls[i].probs for i in answerable]
            )
            if answerable
            else []
        )
        stage("fuse")
        answers = dict(zip(answerable, fused))
        latency = 1000 * (time.perf_counter() - started)
        for i, q in enumerate(queries):
            self._outputs(q, decisions[i], calls[i], fused_pools[i], answers.get(i), latency, out)
        return out

    def _pool_query(self, q: Query) -> PoolQuery:
        if q.choices is None:
            return self.sampling.model_copy(update={"id": q.reference_id or q.query_id, "prompt": q.prompt})
        return ChoiceQuery(id=q.reference_id or q.query_id, prompt=q.prompt, choices=q.choices)

    @staticmethod
    def _fused_pool(decision, answers) -> np.ndarray:
        """The models whose answers the Fusion agent uses: the pool's that answered; if none, any that answered."""
        pool = decision.pool & answers.answered
        return pool if pool.any() else answers.answered.copy()

    def _outputs(
        self, q: Query, decision, answers, fused_pool: np.ndarray, answer, latency: float, out: BatchOutput
    ) -> None:
        names = self.names
        common = {
            "query_id": q.query_id,
            "stream": q.stream,
            "chosen_models": names[decision.pool].tolist(),
            "answered_models": names[fused_pool].tolist(),
            "called_models": names[decision.called].tolist(),
            "failures": [ModelFailureRecord(model=f.model, reason=f.reason) for f in answers.failures],
            "policy_version": self.policy_version,
            "worker": self.name,
            "latency_ms": latency,
        }
        if answer is None:
            self.stats.no_model_answered += 1
            out.answers.append(Answer(answer="", answer_index=-1, distribution=[], **common))
            return
        choices = q.choices if q.choices is not None else answers.candidates
        out.answers.append(
            Answer(
                answer=choices[answer.answer],
                answer_index=answer.answer,
                distribution=answer.distribution.tolist(),
                feedback_token=self.tokens.token(q.query_id),
                candidates=answers.candidates or [],
                **common,
            )
        )
        out.experience.append(
            Experience(
                query_id=q.query_id,
                stream=q.stream,
                policy_version=self.policy_version,
                n_choices=len(choices),
                candidates=answers.candidates,
                decider_state=decision.state.tolist(),
                critic_state=answer.critic_state.tolist(),
                pool=decision.pool.tolist(),
                pool_logp=decision.pool_logp,
                predictions=np.where(answers.answered, answers.probs.argmax(1), -1).tolist(),
                fusion_features=answer.features.tolist(),
                answer_index=answer.answer,
                answer_logp=answer.answer_logp,
                explored=decision.explored,
            )
        )
        self.stats.answered += 1


def create_worker_app(settings: Settings, core: Worker | None) -> AsgiFastStream:
    """The worker's app: a batch subscriber on ``queries`` (consumer group) and one on ``policy``, and its HTTP side
    (``/metrics``, ``/healthz``, ``/readyz``: :mod:`rlens.service.metrics`).

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
