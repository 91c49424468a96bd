"""The gateway's HTTP routes (the OpenAI API, answers, feedback) and how errors become OpenAI-shaped responses."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from rlens.messages import Answer
from rlens.service.gateway.api_keys import KeyRecord
from rlens.service.common.tracing import tracer
from rlens.service.common.metrics import failure_kind
from rlens.service.gateway.core import Gateway
from rlens.service.gateway.timing import Stages
from rlens.service.gateway.openai_api import (
    MODEL_OF,
    AnswerStatus,
    ApiError,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    FeedbackReceipt,
    FeedbackRequest,
    ModelCard,
    ModelList,
    Usage,
    chat_completion,
    completion,
    error_response,
    stream_chunks,
)

log = logging.getLogger("rlens.gateway")
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 429, 502, 503, 504)
}


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's shape (``{"error": {...}}``): ours, invalid bodies, HTTP errors, Redis down (503)."""

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":  # its loc is the character where parsing failed, not a field
            reason = first.get("ctx", {}).get("error", "")
            message = f"the body is not valid JSON (at character {first['loc'][-1]}{': ' + reason if reason else ''})"
            return error_response(ApiError(400, message, "invalid_request_error", "invalid_json"))
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return error_response(ApiError(400, message, "invalid_request_error", "invalid_request", where or None))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(
            ApiError(exc.status_code, str(exc.detail), "invalid_request_error", headers=dict(exc.headers or {}))
        )

    @app.exception_handler(RedisError)
    async def on_redis(request: Request, exc: RedisError) -> JSONResponse:
        log.error("Redis unreachable: %s", exc)
        message = "the gateway's state store (Redis) is unreachable; retry shortly"
        return error_response(ApiError(503, message, "server_error", "unavailable", headers={"Retry-After": "1"}))


# what rlens added to a request beyond the models' own time, in milliseconds (as LiteLLM's
# x-litellm-overhead-duration-ms): the gateway, Kafka both ways, the worker's own code
OVERHEAD_HEADER = "x-rlens-overhead-duration-ms"


def answer_response(
    answer: Answer,
    model: str,
    chat: bool,
    stream: bool,
    elapsed_s: float | None = None,
    stages: Stages | None = None,
    include_usage: bool = False,
) -> Any:
    """An answer as a completion (or its event stream); 502 when no model of the pool answered. With the request's
    time (``elapsed_s``), headers say what rlens added beyond the models' own time and what the answer cost; with
    its ``stages``, where its time went (``Server-Timing``)."""
    if not answer.answered_models:  # the failures' details (URLs, upstream bodies) are for the worker's log only
        failures = ", ".join(f"{f.model}: {failure_kind(f.reason)}" for f in answer.failures) or "no model was called"
        raise ApiError(
            502,
            f"no model of the pool answered ({failures}); each model's failure is in the worker's log under this query id",
            "server_error",
            "no_model_answered",
            query_id=answer.query_id,
        )
    headers = {"x-rlens-cost": f"{answer.cost:g}", "x-rlens-model-duration-ms": f"{answer.model_ms:.1f}"}
    if elapsed_s is not None:
        headers[OVERHEAD_HEADER] = f"{max(1000 * elapsed_s - answer.model_ms, 0.0):.1f}"
    if stream:
        chunks = stream_chunks(answer, model, chat, include_usage)
        content = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks)
        content += "data: [DONE]\n\n"
    else:  # validated: skip FastAPI's second pass
        content = (chat_completion(answer, model) if chat else completion(answer, model)).model_dump_json()
    if stages is not None:
        stages.mark("respond")
        headers["Server-Timing"] = stages.header()
    if stream:
        return StreamingResponse(iter([content]), media_type="text/event-stream", headers=headers)
    return Response(content, media_type="application/json", headers=headers)


async def ask(
    gateway: Gateway,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    key: KeyRecord,
    idempotency_key: str | None,
    stream_key: str | None,
) -> Response:
    """A completion through the stream, in a GenAI span (its usage, cost and stages as attributes), with the
    overhead and each stage's seconds observed."""
    started, stages = time.perf_counter(), Stages()
    chat = isinstance(body, ChatCompletionRequest)
    operation = "chat" if chat else "text_completion"
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": body.model,
        "gen_ai.provider.name": "rlens",
        "rlens.tenant": key.tenant,
    }
    with tracer().start_as_current_span(f"{operation} {body.model}", kind=SpanKind.INTERNAL, attributes=attributes):
        answer = await gateway.ask(key, body, idempotency_key, stream_key, stages)
        request.state.access.update(query_id=answer.query_id, cost=answer.cost)
        stages.answered(answer)
        usage = Usage.of(answer)
        trace.get_current_span().set_attributes(
            {
                "gen_ai.response.id": answer.query_id,
                "gen_ai.response.model": body.model,
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
                "rlens.query_id": answer.query_id,
                "rlens.cost": answer.cost,
                "rlens.policy_version": answer.policy_version,
                "rlens.models_called": len(answer.called_models),
            }
        )
        elapsed_s = time.perf_counter() - started
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        response = answer_response(answer, body.model, chat, body.stream, elapsed_s, stages, with_usage)
        trace.get_current_span().set_attributes({f"rlens.stage.{k}_ms": 1000 * v for k, v in stages.seconds.items()})
    gateway.metrics.overhead_seconds.observe(max(elapsed_s - answer.model_ms / 1000, 0.0))
    for stage, seconds in stages.seconds.items():
        gateway.metrics.stage_seconds.labels(stage).observe(seconds)
    return response


def openai_router(gateway: Gateway) -> APIRouter:
    """``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/answers/{id}``, ``/v1/feedback``."""
    router = APIRouter()

    async def key_of(request: Request, authorization: str | None = Header(None)) -> KeyRecord:  # async: no thread hop
        key = gateway.authorize(authorization, request.client.host if request.client else "")
        request.state.access = {"key_id": key.id, "tenant": key.tenant}  # for the access log (middleware.Measure)
        return key

    @router.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models(key: KeyRecord = Depends(key_of)) -> ModelList:
        """The strategies this deployment runs, as models."""
        return ModelList(data=[ModelCard(id=MODEL_OF[s]) for s in gateway.strategies])

    @router.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERRORS)
    async def chat_completions(
        request: Request,
        body: ChatCompletionRequest,
        key: KeyRecord = Depends(key_of),
        idempotency_key: str | None = Header(None),
        x_rlens_stream: str | None = Header(None),
    ):
        """Answer a conversation (multiple choice with rlens.choices, model rlens-focal; open-ended: rlens-rlae, or rlens-focal over sampled answers)."""
        return await ask(gateway, request, body, key, idempotency_key, x_rlens_stream)

    @router.post("/v1/completions", response_model=Completion, responses=ERRORS)
    async def completions(
        request: Request,
        body: CompletionRequest,
        key: KeyRecord = Depends(key_of),
        idempotency_key: str | None = Header(None),
        x_rlens_stream: str | None = Header(None),
    ):
        """Answer a prompt (multiple choice with rlens.choices, model rlens-focal; open-ended: rlens-rlae, or rlens-focal over sampled answers)."""
        return await ask(gateway, request, body, key, idempotency_key, x_rlens_stream)

    @router.get(
        "/v1/answers/{query_id}",
        response_model=ChatCompletion | Completion,
        responses={**ERRORS, 202: {"model": AnswerStatus}},
    )
    async def answers(request: Request, query_id: str, key: KeyRecord = Depends(key_of)):
        """A query's answer (e.g. after a 504), for as long as the gateway retains it; 202 while it is pending."""
        request.state.access["query_id"] = query_id
        await gateway.take_token(key)
        record = await gateway.owned_query(key, query_id)
        answer = await gateway.state.answer(query_id)
        if answer is None:
            return JSONResponse(AnswerStatus(id=query_id).model_dump(), 202)
        return answer_response(answer, record.model, record.chat, stream=False)

    @router.post(
        "/v1/feedback",
        response_model=FeedbackReceipt,
        status_code=202,
        responses={**ERRORS, 200: {"model": FeedbackReceipt}},
    )
    async def feedback_route(request: Request, body: FeedbackRequest, key: KeyRecord = Depends(key_of)):
        """Rate an answer of this key's tenant once: 202 accepted; 200 duplicate (it had feedback; nothing changed)."""
        request.state.access["query_id"] = body.id
        await gateway.take_token(key)
        receipt = await gateway.feedback(key, body)
        return receipt if receipt.status == "accepted" else JSONResponse(receipt.model_dump(), 200)

    return router
