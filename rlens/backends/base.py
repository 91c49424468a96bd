"""The model-backend interface (one small ABC, like RouteLLM's routers) and its registry.

A backend answers multiple-choice queries with the summed log-likelihood of each choice's continuation,
exactly as lm-evaluation-harness scores them, and (where it can) generates text: ``n`` samples of one prompt,
which :mod:`rlens.records.answers` turns into an answer distribution for open-ended questions. Implementations register
themselves by name with :func:`register_backend`; :func:`create_backend` builds one from its name and options.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Callable, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from rlens.backends.openai_protocol import Usage


class ChoiceQuery(BaseModel):
    """One multiple-choice question: the prompt (context) and the continuations to score."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="query id; the replay backend looks recorded outputs up by it")
    prompt: str
    choices: list[str] = Field(min_length=2)


class ChoiceScores(BaseModel):
    """A backend's answer: per choice the summed log-likelihood of its tokens and whether greedy decoding yields it."""

    loglikelihoods: list[float]
    is_greedy: list[bool]
    usage: Usage | None = Field(None, description="the tokens the model read (None: the backend cannot tell)")

    def probabilities(self) -> list[float]:
        """The softmax of the log-likelihoods: the model's distribution over the choices."""
        top = max(self.loglikelihoods)
        weights = [math.exp(x - top) for x in self.loglikelihoods]
        return [w / sum(weights) for w in weights]


class GenerationRequest(BaseModel):
    """Sample ``n`` continuations of a prompt (``temperature`` 0: greedy, and ``n`` must be 1)."""

    model_config = ConfigDict(frozen=True)

    id: str
    prompt: str
    n: int = Field(1, ge=1, le=64)
    max_tokens: int = Field(32, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    stop: list[str] = Field(default_factory=list, max_length=8)
    seed: int | None = None


class Generations(BaseModel):
    texts: list[str]
    usage: Usage | None = Field(None, description="the tokens the model read and wrote (None: the backend cannot tell)")


def estimate_tokens(text: str) -> int:
    """A text's tokens by the usual rule of thumb (four characters a token), where no tokenizer is at hand."""
    return max(1, -(-len(text) // 4))


def estimated_usage(query: "ChoiceQuery | GenerationRequest", answer: "ChoiceScores | Generations") -> Usage:
    """What answering ``query`` costs in tokens, estimated from the texts: a choice query reads its prompt with each
    choice (as an echo-scoring server does); a generation reads its prompt once and writes the texts."""
    if isinstance(query, ChoiceQuery):
        prompt, completion = sum(estimate_tokens(query.prompt + c) for c in query.choices), 0
    else:
        texts = answer.texts if isinstance(answer, Generations) else []
        prompt, completion = estimate_tokens(query.prompt), sum(estimate_tokens(t) for t in texts if t)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class BackendError(RuntimeError):
    """A backend could not answer a query (bad input, missing record, failed server call)."""


class Backend(ABC):
    """Scores multiple-choice queries for one model."""

    name: ClassVar[str]
    blocking: ClassVar[bool] = True  # False: answers from memory in microseconds, so callers may call it inline

    @abstractmethod
    def score_choices(self, query: ChoiceQuery) -> ChoiceScores:
        """Log-likelihood of every choice of ``query`` (raises :class:`BackendError` when it cannot answer)."""

    def generate(self, request: GenerationRequest) -> Generations:
        """``request.n`` continuations of the prompt, each cut before its first stop string."""
        raise BackendError(f"backend {self.name!r} cannot generate text")

    def probe_query(self) -> ChoiceQuery:
        """A question this backend can answer, for ``rlens pool check``: a two-choice sum by default."""
        return ChoiceQuery(id="0", prompt="Q: add: 2+2=\nA:", choices=[" 4", " 5"])


B = TypeVar("B", bound=type[Backend])
BACKENDS: dict[str, type[Backend]] = {}


def register_backend(name: str) -> Callable[[B], B]:
    def register(cls: B) -> B:
        if name in BACKENDS:
            raise ValueError(f"backend {name!r} is registered twice")
        cls.name = name
        BACKENDS[name] = cls
        return cls

    return register


def create_backend(name: str, **options) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](**options)
