"""Calling the pool: the models a Decider chose answer one query concurrently; failures become records, not hangs.

:class:`PoolCaller` runs each chosen backend in a thread pool and waits at most ``deadline_s`` for all of them.
A backend that raises, answers with the wrong number of choices, or misses the deadline is recorded as a
:class:`ModelFailure` for that query, and counted per model; the others' distributions are used, so the ensemble
answers with the remaining models (the Fusion agent gets ``decision.pool & answered``). A thread stuck in a hung backend is left behind, never
waited for.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from rlens.backends.base import Backend, ChoiceQuery, ChoiceScores


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


@dataclass
class _Done:
    """The outcome of an inline call, read like a finished Future (without its locks: this is the hot path)."""

    value: ChoiceScores | None = None
    error: Exception | None = None

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False

    def exception(self) -> Exception | None:
        return self.error

    def result(self) -> ChoiceScores | None:
        return self.value


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
        return self.score_batch([query], [called])[0]

    @property
    def blocking(self) -> bool:
        """Whether some model of the pool blocks (then callers should run :meth:`score_batch` off their event loop)."""
        return any(b.blocking for b in self.backends)

    def score_batch(self, queries: list[ChoiceQuery], called: list[np.ndarray]) -> list[PoolAnswers]:
        """:meth:`score` for several queries at once: every (query, model) call runs concurrently, one deadline.

        Non-blocking backends (``Backend.blocking`` False) are called inline, the others in the thread pool.
        """
        futures = [{m: self._start(self.backends[m], q) for m in np.flatnonzero(c)} for q, c in zip(queries, called)]
        wait([f for calls in futures for f in calls.values() if isinstance(f, Future)], timeout=self.deadline_s)
        return [self._collect(q, calls) for q, calls in zip(queries, futures)]

    def _start(self, backend: Backend, query: ChoiceQuery) -> "Future | _Done":
        if backend.blocking:
            return self.executor.submit(backend.score_choices, query)
        try:
            return _Done(backend.score_choices(query))
        except Exception as exc:  # recorded as this model's failure, like an exception in a thread
            return _Done(error=exc)

    def _collect(self, query: ChoiceQuery, futures: dict) -> PoolAnswers:
        n_choices = len(query.choices)
        result = PoolAnswers(np.zeros((len(self.names), n_choices)), np.zeros(len(self.names), dtype=bool))
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
