"""The streaming service's wire messages: versioned pydantic models, JSON on Kafka (one model per topic).

Topics (names from the settings, prefix ``rlens.``): ``queries`` → worker → ``answers`` and ``experience``;
``feedback`` → learner; learner → ``policy`` → workers; learner → ``drift`` (changes found per stream); gateway → ``spending`` (what API keys spent); a learner shard → ``transitions`` → the trainer (sharded learners); anything unreadable → ``dead-letter``. Every message has
``schema_version``; fields are only ever added. A deployment runs one strategy: ``rl_focal`` (multiple-choice
queries, and open-ended ones through the models' sampled answers; :class:`Experience`) or ``rlae`` (open-ended
queries; :class:`RLAEExperience`), on the same topics. ``python -m rlens.messages`` writes their JSON schemas to
``schemas/messages/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Strategy = Literal["rl_focal", "rlae"]
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas" / "messages"

# Bounds of every message field: a message outside them is dead-lettered when it is read, so nothing downstream
# (windows, buffers, checkpoints, the agents' tensors) ever holds a value it cannot represent.
MAX_MODELS = 64
MAX_CHOICES = 64
MAX_TEXT = 100_000  # characters of a prompt, an answer text or a reference
MAX_VECTOR = 4096  # floats in one observation vector
MAX_SPANS = 512
MAX_ABS = 1e6  # magnitude of any observation value
Real = Annotated[float, Field(ge=-MAX_ABS, le=MAX_ABS)]
Key = Annotated[str, Field(min_length=1, max_length=256)]
Choice = Annotated[int, Field(ge=-1, lt=MAX_CHOICES)]  # a choice position, -1 for none


TENANT_MARK = "@"  # a stream key "@<tenant>/<stream>" is a gateway tenant's: only a query a gateway signed uses one


def tenant_stream(tenant: str, stream: str) -> str:
    """The stream key of a gateway tenant's stream: its windows, metrics and dashboard are the tenant's alone."""
    return f"{TENANT_MARK}{tenant}/{stream}"


def tenant_free(stream: str) -> str:
    """The stream as its tenant named it (``@acme/support`` → ``support``); other keys as they are."""
    return stream.split("/", 1)[1] if stream.startswith(TENANT_MARK) and "/" in stream else stream


TRACEPARENT = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"  # W3C trace context


class Message(BaseModel):
    """Every wire message: JSON, frozen, unknown fields ignored, no NaN or infinity anywhere."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    schema_version: Literal[1] = 1


class Query(Message):
    """A question to answer. Multiple choice when ``choices`` is given; open-ended otherwise."""

    query_id: Key
    stream: Key = Field(
        description="stream / task key: the sliding window it belongs to (one starting with @ is a gateway tenant's: `@<tenant>/<stream>`, refused without the gateway's signature)"
    )
    prompt: str = Field(max_length=MAX_TEXT)
    choices: list[Annotated[str, Field(max_length=10_000)]] | None = Field(None, min_length=2, max_length=MAX_CHOICES)
    reference_id: str | None = Field(
        None, max_length=256, description="the question's id in a recorded dataset (replay backend)"
    )
    sent_at: float | None = Field(None, description="unix time the producer sent it (latency accounting)")
    budget: float | None = Field(
        None,
        gt=0,
        le=1,
        description="rl_focal: the most this query may spend, as a share of the whole pool's cost: the Decider's greedy "
        "pool cut to fit (no exploration, no probe); at least one model is called",
    )
    reply_to: str | None = Field(
        None,
        max_length=249,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="a gateway replica's reply topic (under <topic_prefix>replies.): the worker publishes the answer there too",
    )
    signature: str = Field(
        "",
        max_length=128,
        description="a gateway's HMAC over the query id and the stream: needed on a tenant's stream (one starting with @)",
    )


class ModelFailureRecord(BaseModel):
    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    model: str
    reason: str


class ModelCallRecord(BaseModel):
    """One model's call for a query: when it started (from the worker taking the query's batch), how long it took,
    and the tokens it read and wrote (``estimated`` from the texts where its backend cannot tell)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    model: str
    offset_ms: float = Field(ge=0)
    duration_ms: float = Field(ge=0)
    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    estimated: bool = False
    money: float | None = Field(
        None, ge=0, description="what the call cost, at the pool's price of the model (none without)"
    )


class Answer(Message):
    query_id: str
    stream: str
    answer: str = Field(
        description="the chosen choice's text (rl_focal) or the generated text (rlae); empty when no model answered"
    )
    answer_index: int = Field(
        ge=-1,
        description="position of the answer among the query's choices (rl_focal, open-ended: among candidates); -1 when no model answered or under rlae",
    )
    distribution: list[float] = Field(
        description="the Fusion agent's distribution over the choices (rl_focal, open-ended: over candidates; empty under rlae)"
    )
    candidates: list[str] = Field(
        default_factory=list,
        description="rl_focal, open-ended queries: the answers extracted from the pool's samples, most frequent first (what answer_index and distribution refer to)",
    )
    chosen_models: list[str] = Field(description="the Decider's pool")
    answered_models: list[str] = Field(description="models of the pool that answered (the Fusion agent used these)")
    called_models: list[str] = Field(description="models asked (the pool, plus the rest on a window-refresh probe)")
    failures: list[ModelFailureRecord] = Field(default_factory=list)
    model_calls: list[ModelCallRecord] = Field(
        default_factory=list, description="each model asked, timed, with its tokens (what `usage` adds up)"
    )
    policy_version: int = Field(ge=0)
    latency_ms: float = Field(ge=0, description="from the worker taking the query to publishing the answer")
    model_ms: float = Field(
        0.0,
        ge=0,
        description="of which the models' own time: the pool call of its batch (rlae: the whole decoding, the models "
        "run in the worker)",
    )
    cost: float = Field(0.0, ge=0, description="the pool's cost units of the models called (each model's pool cost)")
    worker: str
    strategy: Strategy = "rl_focal"
    span_weights: list[list[float]] = Field(
        default_factory=list, description="rlae: the ensemble weights of each span, one per model"
    )
    finish_reason: str | None = Field(None, description="rlae: 'stop' (end of text or a stop string) or 'length'")
    feedback_token: str = Field(
        "",
        description="what this query's Feedback must carry as its token (binds feedback to the answer); empty when no model answered, and on the shared answers topic for a gateway's query (its feedback comes through the gateway)",
    )
    signature: str = Field(
        "",
        max_length=128,
        description="on a reply topic: the worker's HMAC over every other field, which the gateway checks (an answer without a valid one is refused)",
    )


class Feedback(Message):
    """The outcome of an answered query: the correct choice (``label``) or the correct text (``reference``, open-ended
    queries: the reward is exact match), or a bare ``reward``; a given ``reward`` is used as is. ``token`` is the
    answer's ``feedback_token``: feedback without it is dead-lettered, so only who received the answer can rate it."""

    query_id: Key
    token: str = Field(min_length=1, max_length=128, description="the answer's feedback_token")
    stream: Key | None = Field(None, description="if given, it must be the query's stream")
    label: int | None = Field(None, ge=0, lt=MAX_CHOICES)
    reference: str | None = Field(
        None, max_length=MAX_TEXT, description="the correct answer text of an open-ended query"
    )
    reward: float | None = Field(None, ge=-1, le=1)

    @model_validator(mode="after")
    def _has_outcome(self) -> "Feedback":
        if self.label is None and self.reward is None and self.reference is None:
            raise ValueError("feedback needs a label, a reference or a reward")
        return self


class JointVote(BaseModel):
    """A pool's joint fit on one query (:class:`rlens.focal.calibration.PoolCombiner`): what replaced its vote."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    pool: list[bool] = Field(max_length=MAX_MODELS)
    log_probs: list[Annotated[float, Field(le=0)]] = Field(
        max_length=MAX_CHOICES, description="its log-probabilities over the choices, 6 significant digits"
    )


class Behaviour(BaseModel):
    """What off-policy evaluation needs of one served rl_focal query (:mod:`rlens.focal.propensity`): the serving
    mixture in force, its greedy actions, the probability of what it served, and every called model's answer."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    explore_rate: float = Field(ge=0, le=1, description="the share of queries explored when this one was answered")
    probe: bool = Field(description="the whole pool was called to refresh the windows (every model's answer known)")
    greedy_pool: list[bool] = Field(max_length=MAX_MODELS, description="the pool the greedy Decider takes here")
    greedy_answer: Choice = Field(
        description="the greedy policy's answer here (greedy pool, greedy Fusion); -1 where the greedy pool was not called"
    )
    propensity: float = Field(
        ge=0,
        le=1,
        description="the mixture's probability of the served pool and answer: explore_rate · P(pool) · P(answer | pool) "
        "+ (1 − explore_rate) · [both greedy]",
    )
    model_probs: list[Annotated[list[Annotated[float, Field(ge=0, le=1)]], Field(max_length=MAX_CHOICES)]] = Field(
        max_length=MAX_MODELS,
        description="per model: its distribution over the choices, 6 significant digits; [] where not called or failed",
    )
    reliability: list[Annotated[float, Field(ge=0, le=1)]] = Field(
        max_length=MAX_MODELS, description="the stream window's per-model reliability the Fusion agent read"
    )
    label_prior: list[Annotated[float, Field(ge=0, le=1)]] = Field(
        max_length=MAX_CHOICES, description="the stream window's label frequencies the Fusion agent read"
    )
    offset: float = Field(
        0.0,
        ge=-MAX_ABS,
        le=MAX_ABS,
        description="the deployment's or the stream's budget: its offset when this query was served, which shifted "
        "the greedy Decider's logits by offset times each model's price (rlens.focal.budget.logit_shift); 0: none",
    )
    budget: float | None = Field(
        None, gt=0, le=1, description="the query's own budget, if it had one: its greedy pool was cut to fit"
    )
    calibrated: list[Annotated[list[Annotated[float, Field(le=0)]], Field(max_length=MAX_CHOICES)]] = Field(
        default_factory=list,
        max_length=MAX_MODELS,
        description="with calibrations (RLENS_FOCAL_CALIBRATION_ROWS): per model, its calibrated log-probabilities over "
        "the choices, 6 significant digits; [] where not called or not calibrated yet; [] for all: no calibrations",
    )
    calibration_prior: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=list,
        max_length=MAX_CHOICES,
        description="with calibrations: the stream's label prior the calibrated vote divides by",
    )
    joint: list[JointVote] = Field(
        default_factory=list,
        max_length=2,
        description="with joint fits (RLENS_FOCAL_JOINT_ROWS): the served and the greedy pool's joint "
        "log-probabilities, where the stream had a joint fit for them (it replaced their vote)",
    )


class Shadow(BaseModel):
    """A candidate policy's greedy action on a query the champion served: its pool, and its answer where the models
    it needs were called (no model is called for it)."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    epoch: int = Field(ge=0)
    version: int = Field(ge=1)
    pool: list[bool] = Field(max_length=MAX_MODELS)
    answer: Choice = Field(description="-1 where its pool holds a model the query did not call, or none answered")
    explored: list[Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=list,
        max_length=MAX_CHOICES,
        description="its Fusion's own distribution over the choices on that pool (what an explored answer there is "
        "sampled from, without the calibrated vote), 4 significant digits; [] where answer is -1",
    )


class Split(BaseModel):
    """rlae under gated promotion: a candidate was out when this query came, and a random share of the queries
    (``RLENS_GATE_SPLIT``) was served by it instead of the champion (an A/B split: RLAE's span weights change what
    the models generate, so a candidate cannot be scored on the champion's answer)."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    epoch: int = Field(ge=0, description="the candidate's")
    version: int = Field(ge=1, description="the candidate's")
    candidate: bool = Field(description="the candidate served this query (its policy_version); false: the champion")


class Experience(Message):
    """What the learner needs from one answered rl_focal query to train both agents once its feedback arrives."""

    trace: str | None = Field(
        None,
        pattern=TRACEPARENT,
        description="the W3C traceparent of the worker's span for this query, when traces are on: the learner's join "
        "of its feedback joins that trace",
    )

    strategy: Literal["rl_focal"] = "rl_focal"
    query_id: Key
    stream: Key
    policy_version: int = Field(ge=0)
    n_choices: int = Field(
        ge=1, le=MAX_CHOICES, description="the query's choices (open-ended: its candidates, at least 1)"
    )
    decider_state: list[Real] = Field(max_length=MAX_VECTOR)
    critic_state: list[Real] = Field(max_length=MAX_VECTOR)
    pool: list[bool] = Field(max_length=MAX_MODELS)
    pool_logp: float = Field(le=0, ge=-MAX_ABS)
    predictions: list[Choice] = Field(
        max_length=MAX_MODELS, description="per model: its top choice, -1 where not called or failed (the window row)"
    )
    fusion_features: list[Annotated[list[Real], Field(max_length=MAX_VECTOR)]] = Field(
        max_length=MAX_CHOICES, description="the Fusion agent's observation [choices, features]"
    )
    answer_index: int = Field(ge=0, lt=MAX_CHOICES)
    answer_logp: float = Field(le=0, ge=-MAX_ABS)
    explored: bool = Field(
        False,
        description="both agents sampled their actions (pool_logp and answer_logp are of the sampled actions); "
        "false: greedy, which trains only the critic",
    )
    candidates: list[Annotated[str, Field(max_length=10_000)]] | None = Field(
        None,
        max_length=MAX_CHOICES,
        description="open-ended queries: the extracted answers the choices stand for "
        "(a feedback reference is matched against them); None: multiple choice",
    )
    behaviour: Behaviour | None = Field(None, description="for off-policy evaluation; None from workers before it")
    shadow: Shadow | None = Field(
        None, description="the candidate policy's greedy action on this query, scored in shadow (guarded promotion)"
    )


class SpanDecision(BaseModel):
    """One weighting decision of the RLAE agent: its observation at the span start, its action, log-prob and value."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    obs: list[Real] = Field(max_length=MAX_VECTOR)
    action: list[Real] = Field(max_length=MAX_MODELS)
    logp: Real
    value: Real


class RLAEExperience(Message):
    """What the learner needs from one answered rlae query: the generated text (exact match against a reference)
    and the agent's decision at every span."""

    trace: str | None = Field(
        None,
        pattern=TRACEPARENT,
        description="the W3C traceparent of the worker's span for this query, when traces are on: the learner's join "
        "of its feedback joins that trace",
    )

    strategy: Literal["rlae"] = "rlae"
    query_id: Key
    stream: Key
    policy_version: int = Field(ge=0)
    text: str = Field(max_length=MAX_TEXT)
    spans: list[SpanDecision] = Field(min_length=1, max_length=MAX_SPANS)
    sampled: bool | None = Field(
        None,
        description="the span weights were sampled from the policy (each span's logp is then the density of its "
        "action); false: the policy's mean served; None from workers before it",
    )
    split: Split | None = Field(None, description="gated promotion: the A/B split this query was drawn in")


class Policy(Message):
    """Versioned weights of every agent of a strategy: a safetensors blob (base64), its SHA-256, and the learner's
    Ed25519 signature over every other field (:meth:`signed_bytes`). Workers order policies by (epoch, version):
    a learner takes a new, larger epoch at every start, so a restarted learner's versions supersede the old ones."""

    strategy: Strategy = "rl_focal"
    epoch: int = Field(ge=0, description="the publishing learner's start (milliseconds since 1970)")
    version: int = Field(ge=1)
    created_at: float
    n_models: int = Field(ge=1, le=MAX_MODELS)
    models: list[Key] = Field(max_length=MAX_MODELS)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    signature: str = Field(
        max_length=128, description="base64 Ed25519 signature of signed_bytes() by the learner's key"
    )
    weights_b64: str
    stage: Literal["live", "candidate"] = Field(
        "live",
        description="live: workers serve it; candidate: workers score it in shadow beside the live one until the "
        "learner promotes it (the same weights again, live) or drops it",
    )
    origin: Literal["learner", "operator"] = Field(
        "learner", description="who published it: the learner, or an operator (rlens policy promote / rollback)"
    )
    note: str = Field("", max_length=300, description="why it was published (an operator's promotion or rollback)")
    share: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="rlae: the share of the queries a candidate serves itself (the A/B split), set by the learner; "
        "None: the workers' RLENS_GATE_SPLIT",
    )
    shadow_calls: float | None = Field(
        None,
        gt=0,
        le=1,
        description="rl_focal: the share of the queries on which workers also call the models a candidate's pool needs "
        "and the served pool lacks, so that its answer is known exactly beside the served one (the replaced champion "
        "on probation), set by the learner; None: only the served pool's (and the probes')",
    )

    def signed_bytes(self) -> bytes:
        """What the learner signs: the whole message but the signature and the weights' encoding (their SHA-256 is
        signed): what the weights are, how they may be used (a candidate's stage, so that it cannot be replayed as
        live; an operator's origin and note; a candidate's share and shadow calls) and when they were published. An
        unset ``shadow_calls`` is left out, so that the policies published before it existed still verify."""
        unset = {"shadow_calls"} if self.shadow_calls is None else set()
        fields = self.model_dump(mode="json", exclude={"signature", "weights_b64", *unset})
        return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


class DriftEvent(Message):
    """A change the learner's detector found in one signal of one stream (rlens.drift): ``outcome`` (the ensemble
    right or wrong, from feedback), ``model:<name>`` (one model right or wrong) or ``confidence`` (label-free: the
    Fusion agent's probability of its answer, or the RLAE agent's value estimate, from the answer itself)."""

    stream: Key
    signal: str = Field(max_length=300)
    detector: str = Field(max_length=64, description="the river detector (adwin, page_hinkley)")
    position: int = Field(ge=1, description="the how-many-th value of this signal on this stream it came with")
    query_id: Key = Field(description="the query whose value completed the detection")
    mean_before: float | None = Field(
        description="mean of the 100 values before the last 20 (null when there were none)"
    )
    mean_after: float = Field(description="mean of the last 20 values")
    window: int = Field(ge=0, description="values the detector kept after the change")
    at: float = Field(description="unix time of the detection")


class DeadLetter(Message):
    """A message a consumer could not use, and why: its coordinates, its first bytes, its size and SHA-256."""

    topic: str
    partition: int
    offset: int
    key_b64: str | None
    value_b64: str = Field(
        description="the value's first DEAD_LETTER_VALUE_BYTES bytes (all of it when value_truncated is false)"
    )
    value_bytes: int = Field(0, ge=0, description="the whole value's size")
    value_sha256: str = Field("", description="the whole value's SHA-256 (hex)")
    value_truncated: bool = False
    reason: str
    consumer: str
    at: float


class Spending(Message):
    """One gateway process's running total of what an API key spent in a budget period (on the compacted
    ``spending`` topic, keyed ``<key id>/<period>/<process>``): a key's spending is the sum over processes of each
    one's last record, which rebuilds it after Redis lost it. Signed by the gateway (an HMAC under a key derived from
    the feedback secret): a record without a valid signature is ignored."""

    key_id: Key
    period: str = Field(
        pattern=r"^(total|\d{4}-\d{2}(-\d{2})?)$", description="the budget period: total, a month or a day (UTC)"
    )
    process: Key = Field(description="the gateway process that spent it (its id and a start-unique suffix)")
    amount: float = Field(ge=0, le=1e15, description="what the key spent in the period through this process so far")
    at: float
    signature: str = Field("", max_length=128)

    def record_key(self) -> bytes:
        return f"{self.key_id}/{self.period}/{self.process}".encode()


class Transition(Message):
    """One joined rl_focal query, from the learner shard that joined it to the trainer (on ``transitions``): the
    experience, its feedback, the reward the shard computed and the outcome's label (what the gate scores). The
    trainer trains on each query id once, so a shard that re-joins after a crash hands nothing on twice."""

    query_id: Key
    experience: Experience
    feedback: Feedback
    reward: float = Field(ge=-MAX_ABS, le=MAX_ABS)
    label: Choice | None = Field(None, description="the outcome's choice (open-ended: the reference's candidate)")
    shard: int = Field(ge=0, description="the learner shard that joined it")


class RLAETransition(Transition):
    """:class:`Transition`'s rlae form."""

    experience: RLAEExperience  # type: ignore[assignment]


MESSAGES: dict[str, type[Message]] = {
    "query": Query,
    "answer": Answer,
    "feedback": Feedback,
    "experience": Experience,
    "rlae_experience": RLAEExperience,
    "policy": Policy,
    "drift_event": DriftEvent,
    "dead_letter": DeadLetter,
    "spending": Spending,
    "transition": Transition,
    "rlae_transition": RLAETransition,
}

AnyExperience = Experience | RLAEExperience
# by strategy
EXPERIENCE: dict[str, type[Experience] | type[RLAEExperience]] = {
    "rl_focal": Experience,
    "rlae": RLAEExperience,
}
TRANSITION: dict[str, type[Transition]] = {"rl_focal": Transition, "rlae": RLAETransition}


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
