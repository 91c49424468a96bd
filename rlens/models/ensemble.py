"""Calling the pool: the models a Decider chose answer one query concurrently; failures become records, not hangs.

A query is multiple choice (:class:`ChoiceQuery`: each model scores the choices) or open-ended
(:class:`GenerationRequest`: each model samples ``n`` texts, and :func:`rlens.records.answers.pool_choices` turns the
samples into distributions over the union of their extracted answers, the query's candidates; a model none of whose
samples holds an answer is a failure). Either way the caller gets the models' distributions over the choices.

:class:`PoolCaller` runs each chosen backend in that model's own bounded thread pool (``model_concurrency``
threads) and waits at most ``deadline_s`` for all of them. A backend that raises, answers with the wrong number of
choices, or misses the deadline is recorded as a :class:`ModelFailure` for that query, and counted per model; the
others' distributions are used, so the ensemble answers with the remaining models (the Fusion agent gets
``decision.pool & answered``). A thread stuck in a hung backend is left behind, never waited for, and it holds only
its own model's threads: a hung model can never delay or get blamed on a healthy one. A call to a model whose
threads have all been in one call for longer than the deadline fails at once ("busy"), and each model has a
:class:`CircuitBreaker`: after ``circuit_failures`` missed deadlines in a row its calls fail at once for
``circuit_cooldown_s``, then calls are let through again to probe it. Errors answered in time never open it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from rlens.backends.base import Backend, ChoiceQuery, ChoiceScores, GenerationRequest, Generations, estimated_usage
from rlens.backends.openai_protocol import Usage
from rlens.records.answers import Extractor, extract_answer, pool_choices

PoolQuery = ChoiceQuery | GenerationRequest


@dataclass(frozen=True)
class ModelFailure:
    model: str
    reason: str


@dataclass
class PoolAnswers:
    """The called models' distributions over one query's choices (an open-ended query's: its candidates)."""

    probs: np.ndarray  # float [M, C]; zero rows for models not called or failed
    answered: np.ndarray  # bool [M]
    failures: list[ModelFailure] = field(default_factory=list)
    candidates: list[str] | None = None  # open-ended: the extracted answers the columns stand for
    calls: list[ModelCall] = field(default_factory=list)  # every model asked, in the pool's order


@dataclass
class ModelCall:
    """One model's call for one query: when it started (wall clock, ns), how long it took, and the tokens it used
    (as the backend reports them, or ``estimated`` from the texts where it cannot tell)."""

    model: str
    started_ns: int
    duration_s: float
    usage: Usage | None = None
    estimated: bool = False


@dataclass
class _Outcome:
    """A call's value or error and when it ran (what a call in a thread returns; an inline call is one at once)."""

    value: ChoiceScores | Generations | None = None
    error: Exception | None = None
    started_ns: int = 0  # wall clock (where the call sits in a trace)
    duration_s: float = 0.0  # by the monotonic clock (a wall clock set back never makes it negative)


class CircuitBreaker:
    """Closed until ``failures`` calls in a row fail; then open (calls refused) for ``cooldown_s``; then half-open:
    calls are let through, and one success closes it, one failure opens it again.

    :class:`PoolCaller` counts only missed deadlines as failures: a model that answers, even with an error (a prompt
    it cannot take, a question it does not know), is responsive, and errors caused by bad queries must never cut a
    model off from the good ones."""

    def __init__(self, failures: int = 5, cooldown_s: float = 30.0, clock=time.monotonic):
        self.failures, self.cooldown_s, self.clock = failures, cooldown_s, clock
        self.in_a_row = 0
        self.open_until = 0.0

    def allow(self) -> bool:
        return self.clock() >= self.open_until

    def record(self, ok: bool) -> None:
        if ok:
            self.in_a_row, self.open_until = 0, 0.0
            return
        self.in_a_row += 1
        if self.in_a_row >= self.failures:
            self.open_until = self.clock() + self.cooldown_s


class _Model:
    """One model's threads, the calls running in them (since when), and its circuit breaker."""

    def __init__(self, name: str, backend: Backend, concurrency: int, deadline_s: float, breaker: CircuitBreaker):
        self.name, self.backend, self.concurrency, self.deadline_s, self.breaker = (
            name,
            backend,
            concurrency,
            deadline_s,
            breaker,
        )
        self.executor = (
            ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"rlens-{name}"[:30])
            if backend.blocking
            else None
        )
        self.running: dict[int, float] = {}  # call id -> when it started (monotonic)
        self.lock = threading.Lock()

    def ask(self, query: PoolQuery) -> _Outcome:
        """The backend's answer to ``query`` or its error, timed (never raises)."""
        started, clock = time.time_ns(), time.perf_counter()
        try:
            value = (
                self.backend.score_choices(query) if isinstance(query, ChoiceQuery) else self.backend.generate(query)
            )
        except Exception as exc:  # recorded as this model's failure
            return _Outcome(error=exc, started_ns=started, duration_s=time.perf_counter() - clock)
        return _Outcome(value, started_ns=started, duration_s=time.perf_counter() - clock)

    def submit(self, query: PoolQuery) -> "Future[_Outcome] | _Outcome":
        if not self.breaker.allow():
            return _refused(
                f"circuit open after {self.breaker.in_a_row} missed deadlines in a row; next try in {self.breaker.open_until - self.breaker.clock():.0f} s"
            )
        if self.executor is None:
            return self.ask(query)
        now = time.monotonic()
        with self.lock:
            stuck = sum(now - started > self.deadline_s for started in self.running.values())
        if stuck >= self.concurrency:  # a queued call would never start in time
            return _refused(
                f"busy: all {stuck} of its threads have been in one call for over {self.deadline_s:g} s (hung?)"
            )
        return self.executor.submit(self._call, query)

    def _call(self, query: PoolQuery) -> _Outcome:
        call = threading.get_ident()
        with self.lock:
            self.running[call] = time.monotonic()
        try:
            return self.ask(query)
        finally:
            with self.lock:
                del self.running[call]


class ModelUnavailable(Exception):
    """A call not made: the model's circuit is open, or all its threads are stuck past the deadline."""


def _refused(reason: str) -> _Outcome:
    return _Outcome(error=ModelUnavailable(reason), started_ns=time.time_ns())


class PoolCaller:
    def __init__(
        self,
        backends: dict[str, Backend],
        deadline_s: float = 60.0,
        model_concurrency: int = 8,
        circuit_failures: int = 5,
        circuit_cooldown_s: float = 30.0,
        extractor: Extractor = "line",
        max_choices: int = 64,
    ):
        """``backends`` in the pool's model order (name -> backend); ``extractor`` and ``max_choices``: how open-ended
        samples become candidates (:func:`rlens.records.answers.pool_choices`)."""
        self.extractor, self.max_choices = extractor, max_choices
        self.names = list(backends)
        self.backends = list(backends.values())
        self.deadline_s = deadline_s
        self.models = [
            _Model(n, b, model_concurrency, deadline_s, CircuitBreaker(circuit_failures, circuit_cooldown_s))
            for n, b in backends.items()
        ]
        self.failure_counts: Counter[str] = Counter()

    def close(self) -> None:
        for model in self.models:
            if model.executor is not None:
                model.executor.shutdown(wait=False, cancel_futures=True)

    def ask(self, query: PoolQuery, called: np.ndarray) -> PoolAnswers:
        """Ask every model with ``called[m]`` to answer ``query``; at most ``deadline_s`` seconds."""
        return self.ask_batch([query], [called])[0]

    @property
    def blocking(self) -> bool:
        """Whether some model of the pool blocks (then callers should run :meth:`ask_batch` off their event loop)."""
        return any(b.blocking for b in self.backends)

    def ask_batch(self, queries: list[PoolQuery], called: list[np.ndarray]) -> list[PoolAnswers]:
        """:meth:`ask` for several queries at once (either kind, mixed): every (query, model) call runs
        concurrently, one deadline.

        Non-blocking backends (``Backend.blocking`` False) are called inline, the others in the thread pool.
        """
        asked = (time.time_ns(), time.perf_counter())
        futures = [{m: self.models[m].submit(q) for m in np.flatnonzero(c)} for q, c in zip(queries, called)]
        wait([f for calls in futures for f in calls.values() if isinstance(f, Future)], timeout=self.deadline_s)
        return [self._collect(q, calls, asked) for q, calls in zip(queries, futures)]

    def _collect(self, query: PoolQuery, futures: dict, asked: tuple[int, float]) -> PoolAnswers:
        """One query's answers; ``asked``: when the batch was asked (wall clock ns, monotonic s), a hung call's start."""
        width = 0 if isinstance(query, GenerationRequest) else len(query.choices)
        result = PoolAnswers(np.zeros((len(self.names), width)), np.zeros(len(self.names), dtype=bool))
        samples: list[list[str] | None] = [None] * len(self.names)
        for m, future in futures.items():
            outcome = future if isinstance(future, _Outcome) else future.result() if future.done() else None
            if outcome is None:  # only a missed deadline counts against the model's circuit (see CircuitBreaker)
                future.cancel()
                reason = f"no answer within the {self.deadline_s:g} s deadline"
                result.calls.append(ModelCall(self.names[m], asked[0], time.perf_counter() - asked[1]))
            else:
                call = ModelCall(self.names[m], outcome.started_ns, outcome.duration_s)
                result.calls.append(call)
                answer = outcome.value
                if answer is None:  # the call raised
                    reason = f"{outcome.error.__class__.__name__}: {outcome.error}"
                elif (problem := self._unusable(query, answer)) is not None:
                    reason = problem
                else:
                    call.usage = answer.usage or estimated_usage(query, answer)
                    call.estimated = answer.usage is None
                    if isinstance(answer, Generations):
                        samples[m] = answer.texts
                    else:
                        result.probs[m] = answer.probabilities()
                    result.answered[m] = True
                    self.models[m].breaker.record(ok=True)
                    continue
            if outcome is None or not isinstance(outcome.error, ModelUnavailable):
                self.models[m].breaker.record(ok=outcome is not None)  # an error answered in time: the model responds
            result.failures.append(ModelFailure(self.names[m], reason))
            self.failure_counts[self.names[m]] += 1
        if isinstance(query, GenerationRequest):
            result.candidates, result.probs = pool_choices(samples, self.extractor, self.max_choices)
        return result

    def _unusable(self, query: PoolQuery, answer: ChoiceScores | Generations) -> str | None:
        """Why a model's answer cannot be used (wrong number of choices; no sample holding an answer), or None."""
        if isinstance(answer, ChoiceScores):  # the answer of a ChoiceQuery (Model.ask)
            n, want = len(answer.loglikelihoods), len(query.choices) if isinstance(query, ChoiceQuery) else 0
            return None if n == want else f"scored {n} choices, the query has {want}"
        if not any(extract_answer(text, self.extractor) is not None for text in answer.texts):
            return f"none of its {len(answer.texts)} samples holds an answer ({self.extractor} extractor)"
        return None
