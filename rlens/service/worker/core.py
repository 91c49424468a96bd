"""The ensemble worker: ``queries`` → a strategy's answers → ``answers`` + ``experience``.

:class:`Worker` is what every strategy's worker shares (the policy slot, counters, which queries it takes);
:class:`FocalWorker` is the ``rl_focal`` strategy: windows from Redis → Decider → only the chosen backends →
Fusion (the ``rlae`` one is :class:`rlens.service.worker.rlae.RLAEWorker`). A multiple-choice query has each chosen
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
feedback token (:class:`rlens.service.common.security.FeedbackTokens`).

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
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from redis.exceptions import RedisError

from rlens.backends.base import Backend, ChoiceQuery, GenerationRequest
from rlens.records.answers import Extractor
from rlens.models.ensemble import PoolCaller, PoolQuery
from rlens.models.pool import Price
from rlens.focal.calibration import significant
from rlens.focal.engine import FocalEngine
from rlens.messages import (
    Behaviour,
    JointVote,
    Shadow,
    MAX_CHOICES,
    Answer,
    Experience,
    Message,
    ModelCallRecord,
    ModelFailureRecord,
    Policy,
    Query,
)
from rlens.service.common.policy import PolicyError, decode_policy
from rlens.service.common.security import FeedbackTokens, PolicyVerifier
from rlens.service.common.windows import RedisWindows
from rlens.service.worker.cache import OutputCache
from rlens.settings import FocalSettings
from rlens.service.common.logs import log_unanswered, query_fields

log = logging.getLogger("rlens.worker")


@dataclass
class BatchOutput:
    answers: list[Answer] = field(default_factory=list)
    experience: list[Message] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # query id -> why it could not be answered (dead-lettered)
    # seconds spent in each stage (window_read, decide, pool_call, fuse, decode)
    stages: dict[str, float] = field(default_factory=dict)
    shadow_calls: int = 0  # model calls made only for the candidate on probation (its policy's shadow_calls)

    def extend(self, other: "BatchOutput") -> None:
        self.answers += other.answers
        self.experience += other.experience
        self.failed.update(other.failed)
        self.shadow_calls += other.shadow_calls
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
    cache: OutputCache | None = None  # the backends' model-output cache (rl_focal), counted in the worker's metrics

    def __init__(
        self,
        models: list[str],
        windows: RedisWindows,
        verifier: PolicyVerifier,
        tokens: FeedbackTokens,
        name: str | None = None,
        costs: list[float] | np.ndarray | None = None,
        prices: dict[str, Price] | None = None,
    ):
        """``costs``: each model's cost in the pool's units; ``prices``: what the priced models' tokens cost."""
        self.models, self.windows, self.verifier, self.tokens = models, windows, verifier, tokens
        self.prices = prices or {}
        self.costs = np.ones(len(models)) if costs is None else np.asarray(costs, dtype=np.float64)  # pool units
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.policy_epoch, self.policy_version = 0, 0
        self._next_policy: tuple[tuple[int, int], dict] | None = None
        self.candidate: tuple[int, int] | None = None  # (epoch, version) of the candidate scored in shadow
        self._next_candidate: tuple[tuple[int, int], dict, float | None, float | None] | None = None
        self.candidate_share: float | None = None  # rlae: the candidate's share of the queries, as its policy says
        self.candidate_calls: float | None = None  # rl_focal: the share of queries that call what it needs
        self.stats = WorkerStats()

    def call_record(
        self, model: str, offset_ms: float, duration_ms: float, prompt: int, completion: int, estimated: bool
    ) -> ModelCallRecord:
        """One model call as an answer reports it, priced when the pool gives the model a price. Built without
        validation (several per query, on the hot path): its values are the worker's own, each non-negative."""
        price = self.prices.get(model)
        return ModelCallRecord.model_construct(
            model=model,
            offset_ms=offset_ms,
            duration_ms=duration_ms,
            prompt_tokens=prompt,
            completion_tokens=completion,
            estimated=estimated,
            money=price.of(prompt, completion) if price is not None else None,
        )

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
                q = queries[0]
                log.exception(
                    "query %s failed", q.query_id, extra=query_fields(q.query_id, q.stream, self.policy_version)
                )
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
    def load_candidate(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Score these weights in shadow from the next batch on (None: score none). Strategies that score no
        candidate ignore candidates."""

    def receive_policy(self, policy: Policy) -> str | None:
        """Verify a policy now; it is loaded before the next batch (a live one served, a candidate scored in
        shadow). A genuine one not newer by (epoch, version) than the newest verified one of its stage is ignored (a
        replay of the topic); a forged one is rejected whatever its order. Why it was rejected, or None."""
        order = (policy.epoch, policy.version)
        live = max((self.policy_epoch, self.policy_version), self._next_policy[0] if self._next_policy else (0, 0))
        newest = (
            max(live, self.candidate or (0, 0), self._next_candidate[0] if self._next_candidate else (0, 0))
            if policy.stage == "candidate"
            else live
        )
        try:
            if order > newest:
                tensors = decode_policy(policy, self.policy_tensors(), self.models, self.strategy, self.verifier)
                if policy.stage == "candidate":
                    self._next_candidate = (order, tensors, policy.share, policy.shadow_calls)
                else:
                    self._next_policy = (order, tensors)
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
        """Load the newest verified policy and candidate, if any arrived since the last batch; a candidate that the
        live policy caught up with (promoted, or superseded) is no longer scored."""
        if self._next_policy is not None:
            (epoch, version), tensors = self._next_policy
            self.load_policy(tensors)
            self.policy_epoch, self.policy_version, self._next_policy = epoch, version, None
            self.stats.policies_loaded += 1
            log.info("serving policy v%d (epoch %d)", version, epoch)
        if self._next_candidate is not None:
            self.candidate, tensors, self.candidate_share, self.candidate_calls = self._next_candidate
            self._next_candidate = None
            self.load_candidate(tensors)
            log.info("candidate v%d (epoch %d) loaded, judged beside the policy served", *self.candidate[::-1])
        if self.candidate is not None and self.candidate <= (self.policy_epoch, self.policy_version):
            log.info("candidate v%d (epoch %d) no longer judged: the policy served is as new", *self.candidate[::-1])
            self.candidate = None
            self.load_candidate(None)


class FocalWorker(Worker):
    """The ``rl_focal`` strategy: the Decider's pool, the Fusion agent's answer among the query's choices (or, open-ended,
    among the answers the pool's samples hold; ``sampling`` says how the models sample, ``extractor`` how an answer is
    read from a sample). ``ope_logging`` False: its experience carries no behaviour and no shadow action."""

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
        ope_logging: bool = True,
        cache: OutputCache | None = None,
        prices: dict[str, Price] | None = None,
    ):
        if list(backends) != models:
            raise ValueError(f"backends {list(backends)} are not the pool's models {models}")
        super().__init__(models, windows, verifier, tokens, name, engine.model_costs, prices)
        self.engine = engine
        self.cache = cache
        self.shadow: FocalEngine | None = None  # the candidate's agents (greedy only), scored beside the engine's
        self.ope_logging = ope_logging  # False: no behaviour and no shadow in the experience (RLENS_OPE_LOGGING)
        self.names = np.array(models)
        self.sampling = sampling or FocalSettings().sampling()  # None: the settings' defaults
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

    def load_candidate(self, tensors: dict[str, torch.Tensor] | None) -> None:
        if tensors is None:
            self.shadow = None
            return
        if self.shadow is None:
            self.shadow = FocalEngine(self.engine.n_models, self.engine.model_costs, self.engine.cfg)
        self.shadow.load_policy_state(tensors)

    def _shadow_pools(self, decisions: list, out: BatchOutput) -> list[np.ndarray] | None:
        """The candidate's greedy pool on each query, from the same state and windows (one Decider forward for the
        batch); None when no candidate is scored. Where its policy names ``shadow_calls`` (a policy the learner
        would roll back to), that share of the queries also call the models its pool needs and the served pool
        lacks, so that its answer there is exact: those decisions' ``called`` grows, in the list (not a query
        with its own budget, which caps what it calls), and ``out`` counts the calls added."""
        if self.shadow is None or self.candidate is None or not self.ope_logging:
            return None
        self.shadow.windows = self.engine.windows  # the same windows the champion read
        self.shadow.calibrations = self.engine.calibrations  # and the same calibrations
        pools = self.shadow.greedy_pools(decisions, every=True)
        share = self.candidate_calls
        if share:
            for i, (d, pool) in enumerate(zip(decisions, pools)):
                added = int((pool & ~d.called).sum())
                if d.cap is None and added and (share >= 1 or self.engine.rng.random() < share):
                    decisions[i] = replace(d, called=d.called | pool)
                    out.shadow_calls += added
        return pools

    def _shadows(
        self, decisions: list, pools: list | None, calls: list, served: list, calibrated: list
    ) -> list[Shadow | None]:
        """The candidate's greedy action on each query, on its ``pools`` (:meth:`_shadow_pools`), from the answers
        the query's calls got (one Fusion forward for the batch); ``served``: each query's fused pool and its Fusion
        observation, reused where the candidate fuses the same models; ``calibrated``: the answers' calibrated rows
        (the same calibrations)."""
        if self.shadow is None or self.candidate is None or pools is None:
            return [None] * len(decisions)
        actions = self.shadow.greedy_actions(
            decisions,
            [c.probs for c in calls],
            [d.called for d in decisions],
            [c.answered for c in calls],
            pools,
            served,
            calibrated,
        )
        epoch, version = self.candidate
        owns = [own for _, own in actions if own is not None]
        flat = significant(np.concatenate(owns), 4) if owns else np.empty(0)  # rounded in one pass for the batch
        shadows: list[Shadow | None] = []
        at = 0
        for p, (a, own) in zip(pools, actions):
            explored = [] if own is None else flat[at : at + len(own)].tolist()
            at += 0 if own is None else len(own)
            shadows.append(Shadow(epoch=epoch, version=version, pool=p.tolist(), answer=a, explored=explored))
        return shadows

    # --- queries ----------------------------------------------------------------------------------------------
    async def handle(self, queries: list[Query]) -> BatchOutput:
        self.swap_policy()
        out = BatchOutput()
        started = lap = time.perf_counter()
        started_ns = time.time_ns()  # what the model calls' offsets count from

        def stage(name: str) -> None:
            nonlocal lap
            now = time.perf_counter()
            out.stages[name] = now - lap
            lap = now

        streams = sorted({q.stream for q in queries})
        try:
            voting = self.engine.calibrations is not None
            windows, last_pools, fits = await self.windows.load_with_pools(streams, fits=voting)
            self.engine.windows = {}  # this batch's streams only
            self.engine.windows.update(windows)
            if self.engine.calibrations is not None:  # as the learner last published them (none: no vote yet)
                self.engine.calibrations.streams = {}
                self.engine.calibrations.streams.update(fits)
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
        caps = [q.budget for q in queries] if any(q.budget is not None for q in queries) else None
        if caps is not None:  # a query with its own budget: greedy, no probe
            probes = [p and cap is None for p, cap in zip(probes, caps)]
        decisions = self.engine.decide_batch(
            [(q.stream, len(q.choices) if q.choices else 0, p, g) for q, p, g in zip(queries, probes, greedy)], caps
        )
        try:
            await self.windows.save_pools(
                {stream: self.engine.previous_pool[stream] for stream in streams if stream in self.engine.previous_pool}
            )
        except (RedisError, OSError) as exc:
            log.warning("Redis unreachable (%s): the streams' last pools stay in this worker", exc)
        shadow_pools = self._shadow_pools(decisions, out)
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
        # every answer's calibrations, once: the served vote, the greedy and shadow votes and the log read them
        calibrated = self.engine.calibrated_rows(
            [decisions[i] for i in answerable],
            [calls[i].probs for i in answerable],
            [calls[i].answered if self.ope_logging else fused_pools[i] for i in answerable],
        )
        fused = (
            self.engine.fuse_batch(
                [replace(decisions[i], pool=fused_pools[i]) for i in answerable],
                [calls[i].probs for i in answerable],
                calibrated,
            )
            if answerable
            else []
        )
        stage("fuse")
        answers = dict(zip(answerable, fused))
        evidence = self._evidence(answerable, decisions, calls, fused, probes, fused_pools, calibrated, shadow_pools)
        stage("evidence")
        latency = 1000 * (time.perf_counter() - started)
        timing = (latency, 1000 * out.stages["pool_call"], started_ns)
        for i, q in enumerate(queries):
            behaviour, shadow = evidence.get(i, (None, None))
            self._outputs(q, decisions[i], calls[i], fused_pools[i], answers.get(i), timing, out, behaviour, shadow)
        stage("messages")
        return out

    def _evidence(
        self,
        answerable: list[int],
        decisions: list,
        calls: list,
        fused: list,
        probes: list[bool],
        fused_pools: list,
        calibrated: list,
        shadow_pools: list | None,
    ) -> dict:
        """Per answered query (by its index in the batch): what off-policy evaluation needs of it
        (:class:`Behaviour`), and the candidate's greedy action in shadow; one forward per agent for the batch (the
        Fusion observations of the served answers reused where a greedy answer fuses the same models, and the
        answers' ``calibrated`` rows, one per answered query, wherever a vote or the log needs them)."""
        if not answerable or not self.ope_logging:
            return {}
        engine = self.engine
        chosen, called = [decisions[i] for i in answerable], [calls[i] for i in answerable]
        served = [(fused_pools[i], answer.features) for i, answer in zip(answerable, fused)]
        greedy_pools = engine.greedy_pools(chosen)
        greedy_answers = [answer.answer for answer in fused]  # a greedy query's answer is the greedy one
        explored = [j for j, d in enumerate(chosen) if d.explored]
        if explored:
            found = engine.greedy_actions(
                [chosen[j] for j in explored],
                [called[j].probs for j in explored],
                [chosen[j].called for j in explored],
                [called[j].answered for j in explored],
                [greedy_pools[j] for j in explored],
                [served[j] for j in explored],
                [calibrated[j] for j in explored],
            )
            for j, (answer, _) in zip(explored, found):
                greedy_answers[j] = answer
        pools = None if shadow_pools is None else [shadow_pools[i] for i in answerable]
        shadows = self._shadows(chosen, pools, called, served, calibrated)
        windows: dict = {}  # each stream's window statistics, once per batch
        logged = logged_distributions([c.probs for c in called])
        calibration_logs = self._calibration_logs(chosen, calibrated)
        return {
            i: (
                self._behaviour(
                    chosen[j],
                    called[j],
                    logged[j],
                    fused[j],
                    probes[i],
                    greedy_pools[j],
                    greedy_answers[j],
                    windows,
                    calibration_logs[j],
                ),
                shadows[j],
            )
            for j, i in enumerate(answerable)
        }

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
        self,
        q: Query,
        decision,
        answers,
        fused_pool: np.ndarray,
        answer,
        timing: tuple[float, float, int],
        out: BatchOutput,
        behaviour: Behaviour | None = None,
        shadow: Shadow | None = None,
    ) -> None:
        names = self.names
        common = {
            "query_id": q.query_id,
            "stream": q.stream,
            "chosen_models": names[decision.pool].tolist(),
            "answered_models": names[fused_pool].tolist(),
            "called_models": names[decision.called].tolist(),
            "failures": [ModelFailureRecord(model=f.model, reason=f.reason) for f in answers.failures],
            "model_calls": [
                self.call_record(
                    c.model,
                    max(c.started_ns - timing[2], 0) / 1e6,
                    1000 * c.duration_s,
                    c.usage.prompt_tokens if c.usage else 0,
                    c.usage.completion_tokens if c.usage else 0,
                    c.estimated,
                )
                for c in answers.calls
            ],
            "policy_version": self.policy_version,
            "worker": self.name,
            "latency_ms": timing[0],
            "model_ms": timing[1],
            "cost": float(self.costs[decision.called].sum()),
        }
        if answer is None:
            self.stats.no_model_answered += 1
            log_unanswered(q.query_id, q.stream, self.policy_version, common["failures"])
            out.answers.append(Answer(answer="", answer_index=-1, distribution=[], **common))
            return
        choices = q.choices if q.choices is not None else answers.candidates
        out.answers.append(
            Answer(
                answer=choices[answer.answer],
                answer_index=answer.answer,
                distribution=answer.distribution.tolist(),
                feedback_token=self.tokens.token(q.query_id, q.stream),
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
                behaviour=behaviour,
                shadow=shadow,
            )
        )
        self.stats.answered += 1

    def _behaviour(
        self,
        decision,
        answers,
        probs: list,
        answer,
        probe: bool,
        greedy_pool: np.ndarray,
        greedy: int,
        windows: dict,
        calibration_log: dict,
    ) -> Behaviour:
        """What off-policy evaluation needs of this query (:mod:`rlens.focal.propensity`), given its models'
        distributions as logged, its greedy pool and answer, and its calibrations as logged
        (:meth:`_calibration_logs`); ``windows`` caches each stream's window statistics for the batch."""
        engine, n_choices = self.engine, answers.probs.shape[1]
        propensity = engine.propensity(decision, answer, greedy_pool)
        if (decision.key, n_choices) not in windows:
            window = engine.window(decision.key)
            windows[decision.key, n_choices] = (
                np.round(window.reliability(), 6).tolist(),
                np.round(window.label_prior(n_choices), 6).tolist(),
            )
        reliability, label_prior = windows[decision.key, n_choices]
        return Behaviour(
            explore_rate=engine.cfg.explore_rate if decision.cap is None else 0.0,
            probe=probe,
            greedy_pool=greedy_pool.tolist(),
            greedy_answer=greedy,
            propensity=min(propensity, 1.0),
            budget=decision.cap,
            model_probs=[row if ok else [] for row, ok in zip(probs, answers.answered.tolist())],
            reliability=reliability,
            label_prior=label_prior,
            joint=self._joint_votes(decision, answers, greedy_pool) if calibration_log else [],
            **calibration_log,
        )

    def _joint_votes(self, decision, answers, greedy_pool: np.ndarray) -> list[JointVote]:
        """The served and the greedy pool's joint log-probabilities where the stream has a joint fit for them and
        every member answered (what replaced their votes: off-policy evaluation gives such a pool the same)."""
        calibrations, found = self.engine.calibrations, list[JointVote]()
        if calibrations is None:
            return found
        calibration = calibrations(decision.key)
        for pool in (decision.pool, greedy_pool):
            if any(np.array_equal(pool, j.pool) for j in found) or not answers.answered[pool].all():
                continue
            joint = calibration.joint(answers.probs, pool)
            if joint is not None:
                found.append(JointVote(pool=pool.tolist(), log_probs=np.minimum(significant(joint), 0.0).tolist()))
        return found

    def _calibration_logs(self, decisions: list, calibrated: list) -> list[dict]:
        """With calibrations, per query: each answering model's calibrated log-probabilities (its ``calibrated``
        rows) and the stream's label prior, what off-policy evaluation needs to give a candidate pool its calibrated
        vote (nothing without calibrations, or for an open-ended query); rounded in one pass for the batch."""
        calibrations = self.engine.calibrations
        if calibrations is None:
            return [{} for _ in decisions]
        priors = [
            None if found is None else calibrations(d.key).prior(found.shape[1])
            for d, found in zip(decisions, calibrated)
        ]
        blocks = [found.ravel() for found in calibrated if found is not None]  # NaN rows: no answer
        parts = [np.minimum(np.concatenate(blocks), 0.0)] if blocks else []  # log-probabilities at most 0
        parts += [p for p in priors if p is not None]  # then the priors, above 0
        flat = significant(np.concatenate(parts)).tolist() if parts else []
        at, logs = 0, list[dict]()
        for found in calibrated:
            if found is None:  # open-ended
                logs.append({})
                continue
            models, width = found.shape
            rows = [flat[at + m * width : at + (m + 1) * width] for m in range(models)]
            at += found.size
            logs.append({"calibrated": [[] if row[0] != row[0] else row for row in rows]})  # NaN: []
        for log_, prior in zip(logs, priors):
            if prior is not None:
                log_["calibration_prior"] = flat[at : at + len(prior)]
                at += len(prior)
        return logs


def logged_distributions(probs: list[np.ndarray]) -> list:
    """Each query's model distributions [M, C] as the log keeps them (:func:`significant`), rounded in one pass for
    the batch."""
    flat = significant(np.concatenate([p.ravel() for p in probs])) if probs else np.empty(0)
    ends = np.cumsum([p.size for p in probs])
    return [flat[end - p.size : end].reshape(p.shape).tolist() for p, end in zip(probs, ends)]
