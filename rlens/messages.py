"""The streaming service's wire messages: versioned pydantic models, JSON on Kafka (one model per topic).

Topics (names from the settings, prefix ``rlens.``): ``queries`` → worker → ``answers`` and ``experience``;
``feedback`` → learner; learner → ``policy`` → workers; anything unreadable → ``dead-letter``. Every message has
``schema_version``; fields are only ever added. A deployment runs one strategy: ``rl_focal`` (multiple-choice
queries; :class:`Experience`) or ``rlae`` (open-ended queries; :class:`RLAEExperience`), on the same topics. ``python -m rlens.messages`` writes their JSON schemas to
``schemas/messages/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

Strategy = Literal["rl_focal", "rlae"]

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas" / "messages"


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = 1


class Query(Message):
    """A question to answer. Multiple choice when ``choices`` is given; open-ended otherwise."""

    query_id: str = Field(min_length=1, max_length=256)
    stream: str = Field(min_length=1, max_length=256, description="stream / task key: the sliding window it belongs to")
    prompt: str = Field(max_length=100_000)
    choices: list[str] | None = Field(None, min_length=2, max_length=64)
    reference_id: str | None = Field(None, description="the question's id in a recorded dataset (replay backend)")
    sent_at: float | None = Field(None, description="unix time the producer sent it (latency accounting)")


class ModelFailureRecord(BaseModel):
    model: str
    reason: str


class Answer(Message):
    query_id: str
    stream: str
    answer: str = Field(description="the chosen choice's text (rl_focal) or the generated text (rlae); empty when no model answered")
    answer_index: int = Field(ge=-1, description="position of the answer among the query's choices; -1 when no model answered or the query is open-ended")
    distribution: list[float] = Field(description="the Fusion agent's distribution over the choices (empty for open-ended queries)")
    chosen_models: list[str] = Field(description="the Decider's pool")
    answered_models: list[str] = Field(description="models of the pool that answered (the Fusion agent used these)")
    called_models: list[str] = Field(description="models asked (the pool, plus the rest on a window-refresh probe)")
    failures: list[ModelFailureRecord] = Field(default_factory=list)
    policy_version: int = Field(ge=0)
    latency_ms: float = Field(ge=0, description="from the worker taking the query to publishing the answer")
    worker: str
    strategy: Strategy = "rl_focal"
    span_weights: list[list[float]] = Field(default_factory=list, description="rlae: the ensemble weights of each span, one per model")
    finish_reason: str | None = Field(None, description="rlae: 'stop' (end of text or a stop string) or 'length'")


class Feedback(Message):
    """The outcome of an answered query: the correct choice (``label``) or the correct text (``reference``, open-ended
    queries: the reward is exact match), or a bare ``reward``; a given ``reward`` is used as is."""

    query_id: str = Field(min_length=1, max_length=256)
    label: int | None = Field(None, ge=0)
    reference: str | None = Field(None, max_length=100_000, description="the correct answer text of an open-ended query")
    reward: float | None = Field(None, ge=-10, le=10)

    @model_validator(mode="after")
    def _has_outcome(self) -> "Feedback":
        if self.label is None and self.reward is None and self.reference is None:
            raise ValueError("feedback needs a label, a reference or a reward")
        return self


class Experience(Message):
    """What the learner needs from one answered rl_focal query to train both agents once its feedback arrives."""

    strategy: Literal["rl_focal"] = "rl_focal"
    query_id: str
    stream: str
    policy_version: int = Field(ge=0)
    n_choices: int = Field(ge=2)
    decider_state: list[float]
    critic_state: list[float]
    pool: list[bool]
    pool_logp: float
    predictions: list[int] = Field(description="per model: its top choice, -1 where not called or failed (the window row)")
    fusion_features: list[list[float]] = Field(description="the Fusion agent's observation [choices, features]")
    answer_index: int = Field(ge=0)
    answer_logp: float


class SpanDecision(BaseModel):
    """One weighting decision of the RLAE agent: its observation at the span start, its action, log-prob and value."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    obs: list[float]
    action: list[float]
    logp: float
    value: float


class RLAEExperience(Message):
    """What the learner needs from one answered rlae query: the generated text (exact match against a reference)
    and the agent's decision at every span."""

    strategy: Literal["rlae"] = "rlae"
    query_id: str
    stream: str
    policy_version: int = Field(ge=0)
    text: str
    spans: list[SpanDecision] = Field(min_length=1)


class Policy(Message):
    """Versioned weights of every agent of a strategy: a safetensors blob (base64) and its SHA-256."""

    strategy: Strategy = "rl_focal"
    version: int = Field(ge=1)
    created_at: float
    n_models: int = Field(ge=1)
    models: list[str]
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    weights_b64: str


class DeadLetter(Message):
    """A message a consumer could not use, byte for byte, and why."""

    topic: str
    partition: int
    offset: int
    key_b64: str | None
    value_b64: str
    reason: str
    consumer: str
    at: float


MESSAGES: dict[str, type[Message]] = {
    "query": Query,
    "answer": Answer,
    "feedback": Feedback,
    "experience": Experience,
    "rlae_experience": RLAEExperience,
    "policy": Policy,
    "dead_letter": DeadLetter,
}

EXPERIENCE: dict[str, type[Message]] = {"rl_focal": Experience, "rlae": RLAEExperience}  # by strategy


def write_schemas(directory: Path = SCHEMA_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, model in MESSAGES.items():
        path = directory / f"{name}.schema.json"
        path.write_text(json.dumps(model.model_json_schema(), indent=2) + "\n")
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_schemas():
        print(written)
