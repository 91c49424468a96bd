"""What every strategy's worker shares: :class:`Worker` (which queries it takes, ``answer``'s bisection of a batch
that raises, the live policy and the candidate verified when they arrive and swapped in between batches, counters),
and :class:`BatchOutput`, what a batch gives the transport. The strategies are
:class:`rlens.service.worker.core.FocalWorker` and :class:`rlens.service.worker.rlae.RLAEWorker`."""

from __future__ import annotations

import logging
import os
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from rlens.messages import Answer, Message, ModelCallRecord, Policy, Query
from rlens.models.pool import Price
from rlens.service.common.logs import query_fields
from rlens.service.common.policy import PolicyError, decode_policy
from rlens.service.common.security import FeedbackTokens, PolicyVerifier
from rlens.service.common.windows import RedisWindows
from rlens.service.worker.cache import OutputCache

log = logging.getLogger("rlens.worker")


@dataclass
class BatchOutput:
    answers: list[Answer] = field(default_factory=list)
    experience: list[Message] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # query id -> why it could not be answered (dead-lettered)
    # seconds spent in each stage (window_read, decide, pool_call, fuse, decode)
    stages: dict[str, float] = field(default_factory=dict)
    shadow_calls: int = 0  # model calls made only for the candidate on probation (its policy's shadow_calls)
    first_probes: int = 0  # queries that called every model for being among their stream's first (first_probes)

    def extend(self, other: "BatchOutput") -> None:
        self.answers += other.answers
        self.experience += other.experience
        self.failed.update(other.failed)
        self.shadow_calls += other.shadow_calls
        self.first_probes += other.first_probes
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
