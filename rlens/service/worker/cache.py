"""The worker's model-output cache: a model asked the same question again answers from the cache.

A question matches exactly: the model's name with a multiple-choice query's prompt and choices, or with a generation
request's prompt and sampling parameters. Only a deterministic generation (temperature 0, or a seed) is cached:
sampling the same prompt twice must give new samples. Two tiers, looked up in this order:

- **recorded**: the answers of a recorded dataset that has its questions (``questions.jsonl``), for the pool's models of
  the same names, in memory and read-only (the pool file's ``recorded``: what the default ``rlens up`` seeds from the
  bundled recording, so ``rlens load`` replays it at once while any other prompt reaches the real models);
- **redis**: what the models answered, shared by every worker, each entry kept ``ttl_s`` seconds.

A cache that fails (Redis down or slow) never fails a call: the model answers, and the error is counted. Every
lookup is counted by model and result (``recorded``, ``hit``, ``miss``, ``error``) through :attr:`OutputCache.count`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import RedisError

from rlens.backends.base import Backend, ChoiceQuery, ChoiceScores, GenerationRequest, Generations
from rlens.backends.replay import recorded_scores
from rlens.records.dataset import load_dataset

log = logging.getLogger("rlens.worker")

Question = ChoiceQuery | GenerationRequest


def question_key(model: str, question: Question) -> str:
    """The digest that identifies ``model`` answering ``question`` (everything its answer depends on, nothing else)."""
    if isinstance(question, ChoiceQuery):
        body: list = ["choices", model, question.prompt, question.choices]
    else:
        q = question
        body = ["generate", model, q.prompt, q.n, q.max_tokens, q.temperature, q.stop, q.seed]
    return hashlib.sha256(json.dumps(body, ensure_ascii=False).encode()).hexdigest()


def deterministic(question: Question) -> bool:
    """Whether asking ``question`` again must give the same answer (so that it may be cached)."""
    return isinstance(question, ChoiceQuery) or question.temperature == 0 or question.seed is not None


def recorded_answers(dataset_dir: Path, models: list[str]) -> dict[str, ChoiceScores]:
    """question key → answer, for every question of a recorded dataset and each of ``models`` it recorded."""
    from rlens.zoo.record import QUESTIONS_FILE, read_questions

    dataset = load_dataset(dataset_dir)
    if not (dataset_dir / QUESTIONS_FILE).is_file():
        raise ValueError(f"{dataset_dir} has no {QUESTIONS_FILE}: its questions cannot seed the output cache")
    questions = read_questions(dataset_dir / QUESTIONS_FILE)
    if len(questions) != dataset.n_questions:
        raise ValueError(
            f"{dataset_dir}: {len(questions)} questions in {QUESTIONS_FILE}, {dataset.n_questions} recorded"
        )
    answers = {}
    for model in (m for m in models if m in dataset.model_names):
        index = dataset.model_names.index(model)
        for row, q in enumerate(questions):
            query = ChoiceQuery(id=str(row), prompt=q.prompt, choices=q.choices)
            answers[question_key(model, query)] = recorded_scores(dataset, row, index)
    return answers


class OutputCache:
    """The two tiers (either may be absent) and the lookup counter."""

    def __init__(self, recorded: dict[str, ChoiceScores], redis: Redis | None, prefix: str, ttl_s: float):
        self.recorded, self.redis, self.prefix, self.ttl_s = recorded, redis, prefix, ttl_s
        self.count: Callable[[str, str], None] = lambda model, result: None  # (model, result): the worker's metric

    def _redis_key(self, model: str, key: str) -> str:
        return f"{self.prefix}:cache:{model}:{key}"

    def get(self, model: str, question: Question) -> ChoiceScores | Generations | None:
        key = question_key(model, question)
        if isinstance(question, ChoiceQuery) and (recorded := self.recorded.get(key)) is not None:
            self.count(model, "recorded")
            return recorded
        if self.redis is None:
            self.count(model, "miss")
            return None
        try:
            raw = self.redis.get(self._redis_key(model, key))
        except RedisError:
            self.count(model, "error")
            return None
        if raw is None:
            self.count(model, "miss")
            return None
        kind: type[ChoiceScores | Generations] = ChoiceScores if isinstance(question, ChoiceQuery) else Generations
        try:
            answer = kind.model_validate_json(raw)
        except ValidationError:  # written by another version: asked again, and overwritten
            self.count(model, "miss")
            return None
        self.count(model, "hit")
        return answer

    def put(self, model: str, question: Question, answer: ChoiceScores | Generations) -> None:
        if self.redis is None:
            return
        try:
            self.redis.set(
                self._redis_key(model, question_key(model, question)),
                answer.model_dump_json(),
                ex=max(1, round(self.ttl_s)),
            )
        except RedisError:
            self.count(model, "error")


class CachedBackend(Backend):
    """A backend behind the output cache: a cached answer, else the backend's (then cached)."""

    name = "cached"

    def __init__(self, backend: Backend, model: str, cache: OutputCache):
        self.backend, self.model, self.cache = backend, model, cache

    def score_choices(self, query: ChoiceQuery) -> ChoiceScores:
        answer = self.cache.get(self.model, query)
        if isinstance(answer, ChoiceScores) and len(answer.loglikelihoods) == len(query.choices):
            return answer
        answer = self.backend.score_choices(query)
        self.cache.put(self.model, query, answer)
        return answer

    def generate(self, request: GenerationRequest) -> Generations:
        if not deterministic(request):
            return self.backend.generate(request)
        answer = self.cache.get(self.model, request)
        if isinstance(answer, Generations):
            return answer
        answer = self.backend.generate(request)
        self.cache.put(self.model, request, answer)
        return answer

    def probe_query(self) -> ChoiceQuery:
        return self.backend.probe_query()
