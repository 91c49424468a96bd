"""The subset of the OpenAI API the gateway speaks: request and response models, and OpenAI-style errors.

Requests: ``/v1/chat/completions`` and ``/v1/completions``. The ``model`` names the strategy (:data:`MODELS`);
OpenAI sampling parameters (temperature, top_p, max_tokens, ...) are accepted and ignored: the ensemble decides.
rlens's own fields travel in the extension object ``rlens`` (:class:`RlensRequest`: a multiple-choice query's
``choices``; the recorded question id for replay pools; the request's own ``budget``), the stream key in
``metadata.stream`` (or the ``X-Rlens-Stream`` header). Responses are OpenAI's, with the ensemble's account in an
``rlens`` object (:class:`RlensAnswer`: chosen models, failures, each model's call, policy version, rlae span
weights), and ``usage``: the tokens of every model called, added up (as each backend reports them, or estimated from
the texts where it cannot tell), with the cost in the pool's units.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlens.messages import MAX_CHOICES, Answer, ModelCallRecord, ModelFailureRecord, tenant_free

MODELS = {"rlens-focal": "rl_focal", "rlens-rlae": "rlae"}  # API model name -> strategy
MODEL_OF = {strategy: name for name, strategy in MODELS.items()}
DEFAULT_STREAM = "default"


def _no_surrogate(value: Any) -> Any:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which no UTF-8 message can carry: refused here (400)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("holds a lone surrogate (an unpaired \\ud800-\\udfff escape): not valid Unicode") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _no_surrogate(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_surrogate(key)
            _no_surrogate(item)
    return value


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return _no_surrogate(value)


class RlensRequest(Request):
    """rlens's extension of a request."""

    choices: list[Annotated[str, Field(max_length=10_000)]] | None = Field(
        None,
        min_length=2,
        max_length=MAX_CHOICES,
        description="multiple choice: the options (rlens-focal); absent: open-ended (rlens-rlae, or rlens-focal over the models' sampled answers)",
    )
    reference_id: str | None = Field(
        None, max_length=256, description="the question's id in a recorded dataset (pools of replay backends)"
    )
    budget: float | None = Field(
        None,
        gt=0,
        le=1,
        strict=True,
        description="rlens-focal: the most this request may spend, as a share of the whole pool's cost (the models "
        "called); the ensemble's pool is cut to fit, and at least one model is called",
    )


class TextPart(Request):
    type: Literal["text"]
    text: str


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(Request):
    include_usage: bool = Field(False, description="a last chunk with `usage` and no choices, before [DONE]")


class CommonRequest(Request):
    model: str = Field(
        description="rlens-focal (RL-Focal: multiple choice, or open-ended over sampled answers) or rlens-rlae (open-ended, RLAE)"
    )
    stream: bool = Field(
        False,
        description="server-sent events in OpenAI's chunk format (one content chunk: workers do not stream spans yet)",
    )
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="one answer per request")
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, description="metadata.stream: the stream key (default 'default')"
    )
    rlens: RlensRequest = Field(default_factory=RlensRequest)


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)

    def prompt(self) -> str:
        """One user message is its text; a conversation is ``role: text`` lines."""
        if len(self.messages) == 1 and self.messages[0].role == "user":
            return self.messages[0].text()
        return "\n".join(f"{m.role}: {m.text()}" for m in self.messages)


class CompletionRequest(CommonRequest):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] = Field(description="one prompt")

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class FeedbackRequest(Request):
    """The outcome of an answered request: ``label`` (the correct choice's position; multiple choice),
    ``reference`` (the correct text; open-ended, rewarded by exact match) or a bare ``reward`` in [-1, 1]."""

    id: str = Field(min_length=1, max_length=256, description="the response id (= the query id)")
    label: int | None = Field(None, ge=0, lt=MAX_CHOICES)
    reference: str | None = Field(None, max_length=100_000)
    reward: float | None = Field(None, ge=-1, le=1)


# responses


class RlensAnswer(BaseModel):
    """The ensemble's account of an answer."""

    query_id: str
    stream: str
    answer_index: int = Field(
        description="rlens-focal: the chosen option's position (open-ended: among candidates; -1 when none)"
    )
    distribution: list[float] = Field(
        description="rlens-focal: the Fusion agent's distribution over the options (open-ended: over candidates)"
    )
    candidates: list[str] = Field(
        default_factory=list,
        description="rlens-focal, open-ended: the answers the pool's samples held, most frequent first",
    )
    chosen_models: list[str]
    answered_models: list[str]
    called_models: list[str]
    failures: list[ModelFailureRecord]
    model_calls: list[ModelCallRecord] = Field(description="each model asked: when, how long, its tokens")
    policy_version: int
    span_weights: list[list[float]] = Field(description="rlae: each span's weights, one per model")
    worker: str
    latency_ms: float
    model_ms: float = Field(description="of which the models' own time (the pool call of the worker's batch)")
    cost: float = Field(description="the pool's cost units of the models called (what a key's budget counts)")

    @classmethod
    def of(cls, answer: Answer) -> "RlensAnswer":
        """The account of an answer, its stream as the tenant named it (the workers saw ``@<tenant>/<stream>``)."""
        return cls(**{**answer.model_dump(include=set(cls.model_fields)), "stream": tenant_free(answer.stream)})


class Usage(BaseModel):
    """OpenAI's ``usage``: the tokens of every model called, added up; ``cost`` in the pool's units (rlens's own)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cost: float = Field(description="the pool's cost units of the models called (what a key's budget counts)")
    estimated: bool = Field(
        description="true when some model's tokens were estimated from the texts (4 characters a token)"
    )
    money: float | None = Field(
        description="what the calls cost in money at the pool's prices (the priced models'; null when none is priced)"
    )

    @classmethod
    def of(cls, answer: Answer) -> "Usage":
        prompt = sum(c.prompt_tokens for c in answer.model_calls)
        completion = sum(c.completion_tokens for c in answer.model_calls)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            cost=answer.cost,
            estimated=any(c.estimated for c in answer.model_calls),
            money=sum(priced) if (priced := [c.money for c in answer.model_calls if c.money is not None]) else None,
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    finish_reason: str
    logprobs: None = None


class ChatChoice(Choice):
    message: AssistantMessage


class CompletionChoice(Choice):
    text: str


class Reply(BaseModel):
    """What both completion responses share: the id (= the query id), when, which model, and the ensemble's account."""

    id: str
    created: int
    model: str
    usage: Usage
    rlens: RlensAnswer


class ChatCompletion(Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Completion(Reply):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "rlens"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class FeedbackReceipt(BaseModel):
    id: str
    status: Literal["accepted", "duplicate"] = Field(
        description="accepted: published to the learner; duplicate: this query already has feedback, nothing changed"
    )


class AnswerStatus(BaseModel):
    id: str
    status: Literal["pending"] = "pending"


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    query_id: str | None = Field(
        None,
        description="the query's id where one was made (a timed-out request's answer is at /v1/answers/{query_id})",
    )


class ErrorResponse(BaseModel):
    error: ErrorBody


class ApiError(Exception):
    """An error the gateway answers in OpenAI's shape, with its HTTP status (and headers, e.g. Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        code: str | None = None,
        param: str | None = None,
        query_id: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.headers = status, headers or {}
        self.body = ErrorResponse(
            error=ErrorBody(message=message, type=type, code=code, param=param, query_id=query_id)
        )


def finish_reason(answer: Answer) -> str:
    return answer.finish_reason or "stop"


def chat_completion(answer: Answer, model: str) -> ChatCompletion:
    return ChatCompletion(
        id=answer.query_id,
        created=int(time.time()),
        model=model,
        usage=Usage.of(answer),
        rlens=RlensAnswer.of(answer),
        choices=[ChatChoice(message=AssistantMessage(content=answer.answer), finish_reason=finish_reason(answer))],
    )


def completion(answer: Answer, model: str) -> Completion:
    return Completion(
        id=answer.query_id,
        created=int(time.time()),
        model=model,
        usage=Usage.of(answer),
        rlens=RlensAnswer.of(answer),
        choices=[CompletionChoice(text=answer.answer, finish_reason=finish_reason(answer))],
    )


def stream_chunks(answer: Answer, model: str, chat: bool, include_usage: bool = False) -> list[dict[str, Any]]:
    """The server-sent events of an answer in OpenAI's chunk format: the content, then the finish (with ``rlens``);
    with ``include_usage``, every chunk's ``usage`` is null and a last chunk without choices carries it."""
    base: dict[str, Any] = {"id": answer.query_id, "created": int(time.time()), "model": model}
    if include_usage:
        base["usage"] = None
    account = RlensAnswer.of(answer).model_dump()
    if chat:
        kind = {**base, "object": "chat.completion.chunk"}
        content = {"index": 0, "delta": {"role": "assistant", "content": answer.answer}}
        finish: dict[str, Any] = {"index": 0, "delta": {}}
    else:
        kind = {**base, "object": "text_completion"}
        content, finish = {"index": 0, "text": answer.answer}, {"index": 0, "text": ""}
    chunks = [
        {**kind, "choices": [{**content, "finish_reason": None, "logprobs": None}]},
        {**kind, "choices": [{**finish, "finish_reason": finish_reason(answer), "logprobs": None}], "rlens": account},
    ]
    if include_usage:
        chunks.append({**kind, "choices": [], "usage": Usage.of(answer).model_dump()})
    return chunks


def error_response(error: ApiError) -> JSONResponse:
    """An :class:`ApiError` as the response OpenAI's clients expect."""
    return JSONResponse(error.body.model_dump(exclude_none=True), error.status, headers=error.headers)
