"""The ``rlae`` strategy's worker: open-ended queries → the span-weighted token ensemble, its weights set every span
by the RLAE agent → ``answers`` (the generated text, each span's weights) + ``experience`` (the agent's decisions).

Under gated and holdback promotion a candidate serves a random share of the queries itself (the share its policy
message names, set by the learner; ``split`` without one; an A/B split, each such query's experience and answer
carrying the candidate's version), the champion the rest: the learner compares the two on their rewards
(:class:`rlens.service.learner.gate.SplitEvidence`).

A batch is decoded together (:class:`rlens.rlae.decode.SpanWeightedDecoder`: in-process models or model servers'
top-k) in a thread, so the consumer keeps its group membership while models run. If the batch fails (a server
down, a prompt longer than a model's window), each query is decoded alone, and a query that still fails is
answered with an empty text and the reason, without experience; the others are answered normally.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from rlens.backends.base import BackendError, estimate_tokens
from rlens.messages import Answer, ModelFailureRecord, Query, RLAEExperience, SpanDecision, Split
from rlens.models.pool import Price
from rlens.rlae.agent import Span
from rlens.rlae.decode import EnsembleOutput, SpanWeightedDecoder
from rlens.rlae.train import RLAEAgent
from rlens.service.common.logs import log_unanswered
from rlens.service.common.security import FeedbackTokens, PolicyVerifier
from rlens.service.common.windows import RedisWindows
from rlens.service.worker.base import BatchOutput, Worker

log = logging.getLogger("rlens.worker")


@dataclass(frozen=True)
class Arm:
    """Who answers a group of the batch's queries: the champion, or the candidate of an A/B split."""

    agent: RLAEAgent
    version: int
    split: Split | None


class RLAEWorker(Worker):
    """Answers open-ended queries with the token ensemble; ``explore`` samples the weights (on-policy experience)."""

    strategy = "rlae"

    def __init__(
        self,
        decoder: SpanWeightedDecoder,
        agent: RLAEAgent,
        models: list[str],
        windows: RedisWindows,
        verifier: PolicyVerifier,
        tokens: FeedbackTokens,
        stop: list[str],
        explore: bool = True,
        seed: int = 0,
        name: str | None = None,
        costs: list[float] | None = None,
        split: float = 0.2,
        prices: dict[str, Price] | None = None,
    ):
        if decoder.n_models != len(models) or agent.n_models != len(models):
            raise ValueError(
                f"the decoder has {decoder.n_models} models and the agent {agent.n_models}, the pool {len(models)}"
            )
        super().__init__(models, windows, verifier, tokens, name, costs, prices)
        if not 0 < split < 1:
            raise ValueError(f"split must be in (0, 1), got {split}")
        self.decoder, self.agent, self.stop, self.explore, self.split = decoder, agent, stop, explore, split
        self.generator = torch.Generator().manual_seed(seed)
        self.draws = np.random.default_rng(seed)  # which queries the candidate serves
        self.candidate_agent: RLAEAgent | None = None

    def rejects(self, query: Query) -> str | None:
        if query.choices is not None:
            return "multiple-choice query: the rlae worker answers open-ended queries (no choices) only"
        if query.budget is not None:
            return "a budget: the rlae worker merges every model of the pool (a query's budget is rl_focal's)"
        return None

    def policy_tensors(self) -> dict[str, torch.Tensor]:
        return self.agent.policy.state_dict()

    def load_policy(self, tensors: dict[str, torch.Tensor]) -> None:
        self.agent.policy.load_state_dict(tensors)

    def load_candidate(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """The candidate's own agent (the same encoder), which serves ``split`` of the queries from the next batch."""
        if tensors is None:
            self.candidate_agent = None
            return
        if self.candidate_agent is None:
            policy = copy.deepcopy(self.agent.policy)
            self.candidate_agent = RLAEAgent(policy, self.agent.encoder, self.agent.cfg, self.agent.n_models)
        self.candidate_agent.policy.load_state_dict(tensors)

    def _arms(self, n: int) -> list[tuple[Arm, list[int]]]:
        """The batch's queries by who answers them (indices in the batch); every query the champion's without a
        candidate."""
        champion = Arm(self.agent, self.policy_version, None)
        if self.candidate_agent is None or self.candidate is None:
            return [(champion, list(range(n)))]
        epoch, version = self.candidate
        drawn = self.draws.random(n) < (self.split if self.candidate_share is None else self.candidate_share)
        candidate = Arm(self.candidate_agent, version, Split(epoch=epoch, version=version, candidate=True))
        champion = Arm(self.agent, self.policy_version, Split(epoch=epoch, version=version, candidate=False))
        arms = [(champion, np.flatnonzero(~drawn).tolist()), (candidate, np.flatnonzero(drawn).tolist())]
        return [(arm, rows) for arm, rows in arms if rows]

    def _decode_each(self, agent: RLAEAgent, prompts: list[str]) -> list[tuple[EnsembleOutput, list[Span]] | str]:
        """Every prompt's (output, spans), decoded as one batch or, if the batch fails, one by one; a failure's reason."""
        try:
            return list(zip(*agent.decode(self.decoder, prompts, not self.explore, self.generator, self.stop)))
        except (BackendError, ValueError) as exc:
            if len(prompts) == 1:
                return [f"{type(exc).__name__}: {exc}"]
            log.warning("a batch of %d failed (%s); decoding its queries one by one", len(prompts), exc)
        return [result for prompt in prompts for result in self._decode_each(agent, [prompt])]

    def _decode_arms(self, queries: list[Query]) -> list[tuple[Arm, tuple[EnsembleOutput, list[Span]] | str]]:
        """Each query's arm and result, in the batch's order."""
        results: list = [None] * len(queries)
        for arm, rows in self._arms(len(queries)):
            for i, result in zip(rows, self._decode_each(arm.agent, [queries[i].prompt for i in rows])):
                results[i] = (arm, result)
        return results

    async def handle(self, queries: list[Query]) -> BatchOutput:
        self.swap_policy()
        started = time.perf_counter()
        results = await asyncio.to_thread(self._decode_arms, queries)
        latency = 1000 * (time.perf_counter() - started)
        out = BatchOutput(stages={"decode": latency / 1000})
        common = {
            "called_models": self.models,
            "worker": self.name,
            "latency_ms": latency,
            "model_ms": latency,  # the models run in this process, span by span with the agent
            "cost": float(self.costs.sum()),
            "strategy": "rlae",
        }
        for q, (arm, result) in zip(queries, results):
            if isinstance(result, str):
                self.stats.no_model_answered += 1
                log_unanswered(q.query_id, q.stream, arm.version, [ModelFailureRecord(model="ensemble", reason=result)])
                out.answers.append(
                    Answer(
                        query_id=q.query_id,
                        stream=q.stream,
                        answer="",
                        answer_index=-1,
                        distribution=[],
                        chosen_models=[],
                        answered_models=[],
                        failures=[ModelFailureRecord(model="ensemble", reason=result)],
                        policy_version=arm.version,
                        **common,
                    )
                )
                continue
            output, spans = result
            calls = [  # the models decode together, span by span; each wrote its own tokens (where known)
                self.call_record(
                    model, 0.0, latency, estimate_tokens(q.prompt), len(read) or len(output.union_tokens), True
                )
                for model, read in zip(self.models, output.appended)
            ]
            out.answers.append(
                Answer(
                    model_calls=calls,
                    query_id=q.query_id,
                    stream=q.stream,
                    answer=output.text,
                    answer_index=-1,
                    distribution=[],
                    chosen_models=self.models,
                    answered_models=self.models,
                    span_weights=[w.tolist() for w in output.span_weights],
                    finish_reason=output.finish_reason,
                    feedback_token=self.tokens.token(q.query_id, q.stream),
                    policy_version=arm.version,
                    **common,
                )
            )
            out.experience.append(
                RLAEExperience(
                    query_id=q.query_id,
                    stream=q.stream,
                    policy_version=arm.version,
                    text=output.text,
                    spans=[
                        SpanDecision(obs=s.obs.tolist(), action=s.action.tolist(), logp=s.logp, value=s.value)
                        for s in spans
                    ],
                    sampled=self.explore,
                    split=arm.split,
                )
            )
            self.stats.answered += 1
        return out
