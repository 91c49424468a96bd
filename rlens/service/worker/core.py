"""The ``rl_focal`` worker: ``queries`` → windows from Redis → Decider → only the chosen backends → Fusion →
``answers`` + ``experience``.

:class:`FocalWorker` hands its batch's windows to the engine (:meth:`FocalEngine.load_state`; if Redis is down the
windows are cold and the worker keeps answering), and :mod:`rlens.focal.serving` runs the policy in two halves:
``decide_batch`` (the coins, the pools, a candidate's pools in shadow), then, once every query's pool was called
concurrently (:class:`rlens.models.ensemble.PoolCaller`: failures become records), ``answer_batch`` (the answers
fused, and what off-policy evaluation needs of them); the worker turns them into messages.
A multiple-choice query has each chosen model score its choices; an open-ended one has each sample ``n`` texts, and
the Fusion agent picks one of the answers extracted from them (the answer's ``candidates``). What every strategy's
worker shares (the policy slot, the bisection of a batch that raises, counters) is
:class:`rlens.service.worker.base.Worker`; the transport (:func:`create_worker_app`, FastStream) and the Kafka
contract (:mod:`rlens.service.worker.batches`: outputs published before the batch's offsets are committed, reply
topics, dead letters) are apart, so tests drive the worker directly. Each answer carries the query's feedback token
(:class:`rlens.service.common.security.FeedbackTokens`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import torch
from redis.exceptions import RedisError

from rlens.backends.base import Backend, ChoiceQuery, GenerationRequest
from rlens.records.answers import Extractor
from rlens.models.ensemble import PoolCaller, PoolQuery
from rlens.models.pool import Price
from rlens.focal.engine import FocalEngine
from rlens.focal.evidence import Candidate
from rlens.focal.serving import answer_batch, decide_batch
from rlens.messages import (
    Behaviour,
    Shadow,
    MAX_CHOICES,
    Answer,
    Experience,
    ModelFailureRecord,
    Query,
)
from rlens.service.common.security import FeedbackTokens, PolicyVerifier
from rlens.service.common.windows import RedisWindows
from rlens.service.worker.base import BatchOutput, Worker
from rlens.service.worker.cache import OutputCache
from rlens.settings import FocalSettings
from rlens.service.common.logs import log_unanswered

log = logging.getLogger("rlens.worker")


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
        self._asked_read: dict[str, int] = {}  # the batch's streams' query counts as read (FocalEngine.asked)
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

    def _candidate(self) -> Candidate | None:
        """The candidate scored in shadow on this batch (None: none, or no evidence is logged)."""
        if self.shadow is None or self.candidate is None or not self.ope_logging:
            return None
        return Candidate(self.shadow, *self.candidate, self.candidate_calls)

    # --- queries ----------------------------------------------------------------------------------------------
    async def handle(self, queries: list[Query]) -> BatchOutput:
        """The batch stage by stage (each stage's seconds in ``out.stages``): the streams' state from Redis, the
        engine's pools, the models called, the answers fused, their evidence, the messages."""
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
        await self._load_state(streams)
        stage("window_read")
        candidate = self._candidate()
        decided = decide_batch(
            self.engine, [(q.stream, len(q.choices) if q.choices else 0, q.budget) for q in queries], candidate
        )
        out.shadow_calls, out.first_probes = decided.shadow_calls, decided.first_probes
        # the pools saved while the models answer (in threads; inline backends answer first): ``pool_call`` holds
        # whichever of the two ends last
        saving = asyncio.create_task(self._save_pools(streams))
        stage("decide")
        pool_queries, called = [self._pool_query(q) for q in queries], [d.called for d in decided.decisions]
        try:
            calls = (
                await asyncio.to_thread(self.caller.ask_batch, pool_queries, called)
                if self.caller.blocking
                else self.caller.ask_batch(pool_queries, called)
            )
        finally:
            await saving
        stage("pool_call")
        served = answer_batch(
            self.engine, decided, [c.probs for c in calls], [c.answered for c in calls], self.ope_logging, candidate
        )
        stage("fuse")
        out.stages.update(served.seconds)  # the fusion's and the evidence's seconds, as answer_batch measured them
        timing = (1000 * (time.perf_counter() - started), 1000 * out.stages["pool_call"], started_ns)
        for i, q in enumerate(queries):
            behaviour, shadow = served.evidence[i] or (None, None)
            self._outputs(
                q,
                decided.decisions[i],
                calls[i],
                served.fused_pools[i],
                served.answers[i],
                timing,
                out,
                behaviour,
                shadow,
            )
        stage("messages")
        return out

    async def _load_state(self, streams: list[str]) -> None:
        """The streams' windows, last pools and calibration fits from Redis into the engine (cold windows, and the
        worker answering on, while Redis is unreachable)."""
        first = self.engine.cfg.first_probes
        try:
            state = await self.windows.load_with_pools(streams, fits=self.engine.calibrations is not None, asked=first)
        except (RedisError, OSError) as exc:
            self.stats.cold_window_batches += 1
            log.warning("Redis unreachable (%s): answering with cold windows", exc)
            self.engine.reset_windows(known=False)
            self._asked_read = {}
            return
        self.engine.load_state(state.windows, state.pools, state.fits, state.asked)
        self._asked_read = state.asked

    async def _save_pools(self, streams: list[str]) -> None:
        """The streams' last pools saved for the next batch, whichever worker takes it, and the queries they were
        asked added to their counts while these are under ``first_probes`` (before this batch is acknowledged; while
        Redis is unreachable the pools stay in this worker)."""
        previous, asked, read = self.engine.previous_pool, self.engine.asked or {}, self._asked_read
        try:
            await self.windows.save_pools(
                {stream: previous[stream] for stream in streams if stream in previous},
                {stream: asked.get(stream, 0) - read.get(stream, 0) for stream in streams},
            )
        except (RedisError, OSError) as exc:
            log.warning("Redis unreachable (%s): the streams' last pools stay in this worker", exc)

    def _pool_query(self, q: Query) -> PoolQuery:
        if q.choices is None:
            return self.sampling.model_copy(update={"id": q.reference_id or q.query_id, "prompt": q.prompt})
        return ChoiceQuery(id=q.reference_id or q.query_id, prompt=q.prompt, choices=q.choices)

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
