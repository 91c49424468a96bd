"""Calling the pool: the models a Decider chose answer one query concurrently; failures become records, not hangs.

:class:`PoolCaller` runs each chosen backend in a thread pool and waits at most ``deadline_s`` for all of them.
A backend that raises, answers with the wrong number of choices, or misses the deadline is recorded as a
:class:`ModelFailure` for that query, and counted per model; the others' distributions are used, so the ensemble
answers with the remaining models (the Fusion agent gets ``decision.pool & answered``). A thread stuck in a hung backend is left behind, never
waited for.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from rlens.backends.base import Backend, ChoiceQuery


@dataclass(frozen=True)
class ModelFailure:
    model: str
    reason: str


@dataclass
class PoolAnswers:
    """The called models' distributions over one query's choices."""

    probs: np.ndarray  # float [M, C]; zero rows for models not called or failed
    answered: np.ndarray  # bool [M]
    failures: list[ModelFailure] = field(default_factory=list)


class PoolCaller:
    def __init__(self, backends: dict[str, Backend], deadline_s: float = 60.0, max_workers: int = 16):
        """``backends`` in the pool's model order (name -> backend)."""
        self.names = list(backends)
        self.backends = list(backends.values())
        self.deadline_s = deadline_s
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rlens-pool")
        self.failure_counts: Counter[str] = Counter()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def score(self, query: ChoiceQuery, called: np.ndarray) -> PoolAnswers:
        """Ask every model with ``called[m]`` to score ``query``; at most ``deadline_s`` seconds."""
        n_choices = len(query.choices)
        result = PoolAnswers(np.zeros((len(self.names), n_choices)), np.zeros(len(self.names), dtype=bool))
        futures = {m: self.executor.submit(self.backends[m].score_choices, query) for m in np.flatnonzero(called)}
        wait(futures.values(), timeout=self.deadline_s)
        for m, future in futures.items():
            if not future.done():
                future.cancel()
                reason = f"no answer within the {self.deadline_s:g} s deadline"
            elif future.exception() is not None:
                exc = future.exception()
                reason = f"{exc.__class__.__name__}: {exc}"
            elif len(future.result().loglikelihoods) != n_choices:
                reason = f"scored {len(future.result().loglikelihoods)} choices, the query has {n_choices}"
            else:
                result.probs[m] = future.result().probabilities()
                result.answered[m] = True
                continue
            result.failures.append(ModelFailure(self.names[m], reason))
            self.failure_counts[self.names[m]] += 1
        return result

