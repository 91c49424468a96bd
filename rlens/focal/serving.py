"""RL-Focal's serving policy for a batch, in the two halves a driver runs around the model calls: :func:`decide_batch`
(the coins, each query's pool, and a candidate's pools in shadow), then, once the models answered,
:func:`answer_batch` (the answering part of each pool fused, and what off-policy evaluation needs of each answer).
The engine holds the state the driver handed in (:meth:`FocalEngine.load_state`); the driver turns what these
return into messages."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Hashable

import numpy as np

from rlens.focal.engine import Answer, Decision, FocalEngine
from rlens.focal.evidence import Candidate, evidence, shadow_pools
from rlens.messages import Behaviour, Shadow


@dataclass
class Decided:
    """A batch's decisions, in order: each query's probe coin, its decision (``called``: the models to call), the
    candidate's greedy pools in shadow with the model calls they added (None, 0: no candidate), and how many queries
    call every model for being among their stream's first."""

    decisions: list[Decision]
    probes: list[bool]
    candidate_pools: list[np.ndarray] | None = None
    shadow_calls: int = 0
    first_probes: int = 0


@dataclass
class Served:
    """Per query of the batch: the models whose answers were fused, the answer (None: no model answered), and what
    off-policy evaluation needs of it with the candidate's action in shadow (None: not logged, or no answer);
    ``seconds``: the fusion's and the evidence's."""

    fused_pools: list[np.ndarray]
    answers: list[Answer | None]
    evidence: list[tuple[Behaviour, Shadow | None] | None]
    seconds: dict[str, float] = field(default_factory=dict)


def decide_batch(
    engine: FocalEngine, queries: list[tuple[Hashable, int, float | None]], candidate: Candidate | None = None
) -> Decided:
    """The pools for a batch of (stream key, choice count (0: open-ended), the query's own budget or None): the
    engine draws each query's coins (a query with a budget neither probes nor explores), then decides; a stream's
    first queries call every model too (:meth:`FocalEngine.first_queries`), though only the coin's probes, a random
    sample of the queries, are logged as probes; a ``candidate`` gets its greedy pools on the same states
    (:func:`shadow_pools`)."""
    caps = [cap for _, _, cap in queries]
    probes, explored = engine.coins(caps)
    first = engine.first_queries([key for key, _, _ in queries], caps)
    decisions = engine.decide_batch(
        [(key, n_choices, p or f, not e) for (key, n_choices, _), p, f, e in zip(queries, probes, first, explored)],
        caps if any(cap is not None for cap in caps) else None,
    )
    if candidate is None:
        return Decided(decisions, probes, first_probes=sum(first))
    candidate_pools, added = shadow_pools(engine, candidate, decisions)
    return Decided(decisions, probes, candidate_pools, added, sum(first))


def fused_pool(pool: np.ndarray, answered: np.ndarray) -> np.ndarray:
    """The models whose answers the Fusion agent uses: the pool's that answered; if none, any that answered."""
    fused = pool & answered
    return fused if fused.any() else answered.copy()


def answer_batch(
    engine: FocalEngine,
    decided: Decided,
    probs: list[np.ndarray],
    answered: list[np.ndarray],
    log: bool = True,
    candidate: Candidate | None = None,
) -> Served:
    """The answers of a decided batch from what its calls got (per query: the models' distributions [M, C], and
    which models answered): every answering part of a pool fused in one pass, each query's calibrations computed
    once (the served vote, the greedy and shadow votes and the log read them), and with ``log`` what off-policy
    evaluation needs of each answer (:func:`rlens.focal.evidence.evidence`, ``candidate`` in shadow)."""
    started = time.perf_counter()
    decisions = decided.decisions
    fused_pools = [fused_pool(d.pool, a) for d, a in zip(decisions, answered)]
    answerable = [i for i, pool in enumerate(fused_pools) if pool.any()]
    chosen, chosen_probs = [decisions[i] for i in answerable], [probs[i] for i in answerable]
    chosen_answered = [answered[i] for i in answerable]
    # the log's rows cover every answering model; without it the greedy votes compute their own (FocalEngine._votes)
    calibrated = engine.calibrated_rows(chosen, chosen_probs, chosen_answered) if log else None
    fused = (
        engine.fuse_batch(
            [replace(d, pool=fused_pools[i]) for d, i in zip(chosen, answerable)], chosen_probs, calibrated
        )
        if answerable
        else []
    )
    fused_at = time.perf_counter()
    candidate_pools = decided.candidate_pools
    found = (
        evidence(
            engine,
            chosen,
            chosen_probs,
            chosen_answered,
            fused,
            [fused_pools[i] for i in answerable],
            [decided.probes[i] for i in answerable],
            calibrated,
            candidate,
            None if candidate_pools is None else [candidate_pools[i] for i in answerable],
        )
        if calibrated is not None  # with the log
        else []
    )
    answers: list[Answer | None] = [None] * len(decisions)
    logged: list[tuple[Behaviour, Shadow | None] | None] = [None] * len(decisions)
    for j, i in enumerate(answerable):
        answers[i] = fused[j]
        logged[i] = found[j] if found else None
    seconds = {"fuse": fused_at - started, "evidence": time.perf_counter() - fused_at}
    return Served(fused_pools, answers, logged, seconds)
