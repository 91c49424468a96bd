"""``rlens gateway``: the OpenAI-compatible front door of the service (FastAPI on uvicorn, Kafka through FastStream).

Request → reply over Kafka: a request becomes a :class:`~rlens.messages.Query` (its id is the response id) with
``reply_to`` = this replica's reply topic (``<prefix>replies.<gateway id>``), so each replica reads only the
answers of its own queries. The replica waits for the answer up to ``RLENS_GATEWAY_TIMEOUT_S``; a timeout is a 504
carrying the query id, and the answer, when it comes, is kept (``GET /v1/answers/{id}``) for
``RLENS_GATEWAY_RETENTION_S``. Everything replicas share is in Redis (:mod:`rlens.service.gateway.state`): the
first answer of each query (at-least-once duplicates never reach the client), ``Idempotency-Key`` → query id (a
retry, on any replica, gets the same answer instead of asking the models twice), feedback given, rate buckets.

Answers are accepted only with a valid feedback token (an HMAC only workers can make), so a message forged onto
a reply topic cannot answer a client. ``POST /v1/feedback`` checks the feedback against its query (tenant, label
range, kind), gives each query's feedback once, and publishes it with the token the learner checks.

Security: :mod:`rlens.service.gateway.api_keys` (hashed keys, tenant, allowed streams, rate); 401 without a valid key,
403 for a stream the key may not use, 404 for another tenant's queries, 413 above the body or prompt limits, 429
with ``Retry-After`` past the key's rate, 503 when ``RLENS_GATEWAY_MAX_WAITING`` requests already wait. Prompts
are never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import socket
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from faststream import AckPolicy
from faststream.kafka import KafkaMessage
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from rlens.messages import MAX_TEXT, Answer, DeadLetter, Feedback, Query, tenant_stream
from rlens.service.gateway.api_keys import FailedAuth, KeyRecord, KeyStore
from rlens.service.gateway.state import GatewayState, QueryRecord, digest
from rlens.service.common.kafka import (
    Topics,
    check_idempotence,
    dead_letter,
    ensure_topics,
    keep_bytes,
    make_broker,
    parse_or_dead_letter,
    publish_dead_letters,
    typed_publisher,
)
from rlens.service.common.logs import setup_logging
from rlens.service.common.metrics import GatewayMetrics, admin_token
from rlens.service.gateway.openai_api import (
    MODEL_OF,
    MODELS,
    DEFAULT_STREAM,
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
    chat_completion,
    completion,
    stream_chunks,
)
from rlens.service.common.security import FeedbackTokens, admin_allowed, check_exposure
from rlens.service.common.windows import RedisWindows
from rlens.settings import Settings

log = logging.getLogger("rlens.gateway")
REDIS_CONNECTIONS = 64
POLL_S = 0.5  # how often a request whose answer goes to another replica (an idempotent retry) looks in Redis


def gateway_id(settings: Settings) -> str:
    return settings.gateway_id or re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:100]


class Gateway:
    """The gateway's logic without HTTP: authorize, ask (publish a query, wait for its answer), take replies,
    take feedback, fetch answers. ``publish_query`` / ``publish_feedback`` send one message and return once the
    broker confirmed it."""

    def __init__(
        self,
        settings: Settings,
        keys: KeyStore,
        state: GatewayState,
        tokens: FeedbackTokens,
        metrics: GatewayMetrics,
        publish_query,
        publish_feedback,
        reply_topic: str,
    ):
        self.settings, self.keys, self.state, self.tokens, self.metrics = settings, keys, state, tokens, metrics
        self.publish_query, self.publish_feedback, self.reply_topic = publish_query, publish_feedback, reply_topic
        self.strategies = settings.gateway_strategies or [settings.strategy]
        self.waiting = 0
        self.auth_failures = FailedAuth(settings.gateway_auth_failures_per_s)
        self._answers: dict[str, asyncio.Future] = {}  # query id -> its answer, for requests waiting on this replica
        self._waiters: Counter[str] = Counter()  # query id -> requests waiting for it here

    def authorize(self, authorization: str | None, client: str) -> KeyRecord:
        """The key's record; 401 for a missing or wrong key, 429 instead once ``client`` (an address) has failed
        too often (a valid key is never held back by its address's failures)."""
        self.keys.refresh()
        scheme, _, key = (authorization or "").partition(" ")
        record = self.keys.lookup(key.strip()) if scheme.lower() == "bearer" else None
        if record is None and not self.auth_failures.take(client):
            self.metrics.rate_limited.inc()
            raise ApiError(
                429,
                "too many failed authentications from this address; retry later",
                "rate_limit_error",
                "too_many_auth_failures",
                headers={"Retry-After": "1"},
            )
        if record is None:
            raise ApiError(
                401,
                "missing or invalid API key: send `Authorization: Bearer rlk_...` (make keys with `rlens keys add`)",
                "invalid_request_error",
                "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return record

    # asking

    def _check(
        self, key: KeyRecord, request: ChatCompletionRequest | CompletionRequest, prompt: str, stream_header: str | None
    ) -> str:
        """The request's stream key, or the error that refuses the request (model, choices, stream, prompt size)."""
        strategy = MODELS.get(request.model)
        if strategy is None or strategy not in self.strategies:
            served = ", ".join(MODEL_OF[s] for s in self.strategies)
            why = (
                f"model {request.model!r} does not exist"
                if strategy is None
                else f"this deployment does not run {request.model}"
            )
            raise ApiError(404, f"{why}; it serves {served}", "invalid_request_error", "model_not_found", "model")
        choices = request.rlens.choices
        if strategy == "rlae" and choices is not None:
            raise ApiError(
                400,
                "rlens-rlae answers open-ended requests: leave out rlens.choices (multiple-choice requests go to rlens-focal)",
                "invalid_request_error",
                "unexpected_choices",
                "rlens.choices",
            )
        stream = stream_header or (request.metadata or {}).get("stream") or DEFAULT_STREAM
        if len(tenant_stream(key.tenant, stream)) > 256:  # the key the workers see: the tenant's @<tenant>/<stream>
            raise ApiError(
                400,
                f"the stream key is longer than {256 - len(tenant_stream(key.tenant, ''))} characters",
                "invalid_request_error",
                "invalid_stream",
                "metadata.stream",
            )
        if not key.allows(stream):
            raise ApiError(
                403,
                f"this API key may not use stream {stream!r}",
                "permission_error",
                "stream_not_allowed",
                "metadata.stream",
            )
        if len(prompt) > min(self.settings.gateway_max_prompt_chars, MAX_TEXT):
            raise ApiError(
                413,
                f"the prompt has {len(prompt)} characters; the limit is {self.settings.gateway_max_prompt_chars}",
                "invalid_request_error",
                "prompt_too_long",
                "messages",
            )
        return stream

    async def take_token(self, key: KeyRecord) -> None:
        """One request of this key's rate (every route that reads or writes a query takes one): 429 past it."""
        wait = await self.state.take_token(key.id, key.rate_per_s, key.burst)
        if wait > 0:
            self.metrics.rate_limited.inc()
            raise ApiError(
                429,
                f"rate limit of this API key ({key.rate_per_s:g} requests/s, bursts of {key.burst}) reached; retry in {wait:.2f} s",
                "rate_limit_error",
                "rate_limit_exceeded",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )

    async def ask(
        self,
        key: KeyRecord,
        request: ChatCompletionRequest | CompletionRequest,
        body: bytes,
        idempotency_key: str | None,
        stream_header: str | None,
    ) -> Answer:
        """The answer to one request: published as a query and waited for (or the first answer of an earlier
        request with the same ``Idempotency-Key``)."""
        chat = isinstance(request, ChatCompletionRequest)
        prompt = request.prompt() if isinstance(request, ChatCompletionRequest) else request.text()
        stream = self._check(key, request, prompt, stream_header)
        await self.take_token(key)
        if self.waiting >= self.settings.gateway_max_waiting:  # before any wait, an idempotent retry's included
            raise ApiError(
                503,
                f"{self.waiting} requests are waiting for answers on this gateway; retry shortly",
                "server_error",
                "overloaded",
                headers={"Retry-After": "1"},
            )
        query_id = f"rl-{uuid.uuid4().hex}"
        if idempotency_key:
            if len(idempotency_key) > 256:
                raise ApiError(
                    400,
                    "Idempotency-Key is longer than 256 characters",
                    "invalid_request_error",
                    "invalid_idempotency_key",
                )
            request_digest = digest(stream.encode() + b"\0" + body)  # the stream too: it may come from the header
            earlier = await self.state.idempotent(key.tenant, idempotency_key, request_digest, query_id)
            if earlier is not None:
                query_id, earlier_digest = earlier
                if earlier_digest != request_digest:
                    raise ApiError(
                        409,
                        "this Idempotency-Key was used with a different request",
                        "invalid_request_error",
                        "idempotency_key_reused",
                        query_id=query_id,
                    )
                self.metrics.idempotent_replays.inc()
                if (answer := await self.state.answer(query_id)) is not None:
                    return answer
                record = await self.state.query(query_id)
                if record is not None and record.published:
                    return await self._wait(query_id, poll=True)
                # the first request never published it (that replica crashed in between): publish it now
        record = QueryRecord(
            tenant=key.tenant, stream=stream, model=request.model, chat=chat, n_choices=len(request.rlens.choices or [])
        )
        await self.state.remember_query(query_id, record)
        scoped = tenant_stream(key.tenant, stream)  # its windows are this tenant's alone
        query = Query(
            query_id=query_id,
            stream=scoped,
            prompt=prompt,
            choices=request.rlens.choices,
            reference_id=request.rlens.reference_id,
            sent_at=time.time(),
            reply_to=self.reply_topic,
            signature=self.tokens.query_signature(query_id, scoped),
        )
        try:
            await self.publish_query(query)
        except (KafkaError, OSError, TimeoutError) as exc:
            raise ApiError(
                503,
                f"could not publish the query to Kafka ({type(exc).__name__}); retry shortly",
                "server_error",
                "unavailable",
                query_id=query_id,
                headers={"Retry-After": "1"},
            ) from exc
        await self.state.mark_published(query_id, record)
        return await self._wait(query_id)

    async def _wait(self, query_id: str, poll: bool = False) -> Answer:
        """The query's answer: from this replica's replies (:meth:`on_replies` keeps each answer in Redis before it
        wakes the waiters, so one that came before this wait began is found there), or, with ``poll``, from Redis
        every POLL_S (a retry of a query another replica asked)."""
        future = self._answers.setdefault(query_id, asyncio.get_running_loop().create_future())
        self._waiters[query_id] += 1
        deadline = time.monotonic() + self.settings.gateway_timeout_s
        self.waiting += 1
        self.metrics.waiting.set(self.waiting)
        try:
            while True:
                if future.done():
                    return future.result()
                if (answer := await self.state.answer(query_id)) is not None:
                    return answer
                left = deadline - time.monotonic()
                if left <= 0:
                    self.metrics.timeouts.inc()
                    raise ApiError(
                        504,
                        f"no answer within {self.settings.gateway_timeout_s:g} s; fetch it later at /v1/answers/{query_id}",
                        "timeout",
                        "answer_timeout",
                        query_id=query_id,
                    )
                try:
                    return await asyncio.wait_for(asyncio.shield(future), min(left, POLL_S) if poll else left)
                except TimeoutError:
                    pass
        finally:
            self.waiting -= 1
            self.metrics.waiting.set(self.waiting)
            self._waiters[query_id] -= 1
            if self._waiters[query_id] <= 0:  # the last waiter of this id forgets its future
                del self._waiters[query_id]
                self._answers.pop(query_id, None)

    async def on_replies(self, answers: list[Answer]) -> list[str]:
        """Take answers from the reply topic; what became of each (stored, duplicate, unknown, forged)."""
        # only a worker (holding the feedback secret) can sign an answer, an empty one included
        outcomes = ["" if self.tokens.signed(answer) else "forged" for answer in answers]
        candidates = [i for i, outcome in enumerate(outcomes) if not outcome]
        known = await self.state.known([answers[i].query_id for i in candidates])
        for i, is_known in zip(candidates, known):
            outcomes[i] = "" if is_known else "unknown"  # not ours, or past retention
        kept = [i for i, outcome in enumerate(outcomes) if not outcome]
        for i, first in zip(kept, await self.state.store_answers([answers[i] for i in kept])):
            outcomes[i] = "stored" if first else "duplicate"
            answer = answers[i] if first else await self.state.answer(answers[i].query_id) or answers[i]
            future = self._answers.get(answer.query_id)
            if future is not None and not future.done():
                future.set_result(answer)
        return outcomes

    # after the answer

    async def owned_query(self, key: KeyRecord, query_id: str) -> QueryRecord:
        """The record of a query this key's tenant asked on a stream this key may use; 404 otherwise (another
        tenant's, or another stream's, looks the same as none)."""
        record = await self.state.query(query_id)
        if record is None or record.tenant != key.tenant or not key.allows(record.stream):
            raise ApiError(
                404,
                f"no query {query_id!r} for this API key's tenant (unknown, or older than {self.settings.gateway_retention_s} s)",
                "invalid_request_error",
                "query_not_found",
                "id",
            )
        return record

    async def feedback(self, key: KeyRecord, request: FeedbackRequest) -> FeedbackReceipt:
        record = await self.owned_query(key, request.id)
        if request.label is None and request.reference is None and request.reward is None:
            raise ApiError(
                400, "feedback needs a label, a reference or a reward", "invalid_request_error", "missing_outcome"
            )
        if request.label is not None and not record.n_choices:
            raise ApiError(
                400,
                "label is for multiple-choice queries; this one was open-ended: give a reference or a reward",
                "invalid_request_error",
                "invalid_label",
                "label",
            )
        if request.label is not None and request.label >= record.n_choices:
            raise ApiError(
                400,
                f"label {request.label} is out of range: the query had {record.n_choices} options",
                "invalid_request_error",
                "invalid_label",
                "label",
            )
        if request.reference is not None and record.n_choices:
            raise ApiError(
                400,
                "reference is for open-ended queries; this one was multiple choice: give a label",
                "invalid_request_error",
                "invalid_reference",
                "reference",
            )
        if not await self.state.claim_feedback(request.id):
            self.metrics.feedback.labels("duplicate").inc()
            return FeedbackReceipt(id=request.id, status="duplicate")
        message = Feedback(
            query_id=request.id,
            token=self.tokens.token(request.id),
            stream=tenant_stream(record.tenant, record.stream),
            label=request.label,
            reference=request.reference,
            reward=request.reward,
        )
        try:
            await self.publish_feedback(message)
        except Exception:
            await self.state.release_feedback(request.id)
            raise
        self.metrics.feedback.labels("accepted").inc()
        return FeedbackReceipt(id=request.id, status="accepted")


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413, and one that has not arrived whole within
    ``timeout_s`` gets 408, before the app reads any of it (a client that sends headers and a byte holds nothing)."""

    def __init__(self, app, limit: int, timeout_s: float):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send)
        body, more = b"", True
        try:
            async with asyncio.timeout(self.timeout_s):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > self.limit:
                        return await self._refuse(scope, receive, send)
        except TimeoutError:
            late = ApiError(
                408,
                f"the request body did not arrive within {self.timeout_s:g} s",
                "invalid_request_error",
                "request_timeout",
                headers={"Connection": "close"},
            )
            return await error_response(late)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        error = ApiError(
            413, f"the request body is larger than {self.limit} bytes", "invalid_request_error", "request_too_large"
        )
        await error_response(error)(scope, receive, send)


class Contain:
    """ASGI middleware: an unexpected error is a 500 logged by its type and route alone. A traceback would log the
    exception's text, which may hold the request's input (a pydantic error quotes it), and prompts are never logged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = [False]

        async def sending(message) -> None:
            started[0] = started[0] or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            route = scope.get("route")
            log.error(
                "internal error on %s: %s", route.path if route is not None else scope["path"], type(exc).__name__
            )
            if not started[0]:
                error = ApiError(500, "internal error (logged by the gateway)", "server_error", "internal_error")
                await error_response(error)(scope, receive, send)


class Measure:
    """ASGI middleware: each request's count by route and status, and its duration by route."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [500]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            path = route.path if route is not None else "unmatched"
            self.metrics.requests.labels(path, str(status[0])).inc()
            self.metrics.request_seconds.labels(path).observe(time.perf_counter() - started)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body.model_dump(exclude_none=True), error.status, headers=error.headers)


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 429, 502, 503, 504)
}


def create_gateway_app(settings: Settings, keys: KeyStore | None = None) -> FastAPI:
    """The gateway's ASGI app: the OpenAI routes, feedback and answers, and /metrics, /healthz, /readyz."""
    from rlens.service.run import feedback_tokens

    keys = keys or KeyStore(
        settings.gateway_keys_file if settings.gateway_keys is None else None, settings.gateway_keys
    )
    topics = Topics.from_settings(settings)
    name = gateway_id(settings)
    reply_topic = topics.replies(name)
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    broker = make_broker(settings)
    queries = typed_publisher(
        broker, topics.queries, Query, "gateway", "the requests, each with reply_to = the replica's reply topic"
    )
    feedback = typed_publisher(broker, topics.feedback, Feedback, "gateway", "feedback given through POST /v1/feedback")
    dead_letters = typed_publisher(
        broker, topics.dead_letter, DeadLetter, "gateway", "replies that could not be used, with the reason"
    )
    pool = BlockingConnectionPool.from_url(
        settings.redis_url.get_secret_value(),
        max_connections=REDIS_CONNECTIONS,
        timeout=5,
        socket_timeout=5,
        socket_connect_timeout=2,
        health_check_interval=10,
    )
    redis = Redis(connection_pool=pool)  # requests wait for a free connection instead of failing
    marks = RedisWindows(redis, 1, 1, settings.redis_prefix)  # only its readiness mark

    async def publish_one(publisher, message) -> None:
        await publisher.publish(message.model_dump_json().encode(), key=message.query_id.encode())

    gateway = Gateway(
        settings,
        keys,
        GatewayState(redis, settings.redis_prefix, settings.gateway_retention_s),
        feedback_tokens(settings),
        metrics,
        lambda q: publish_one(queries, q),
        lambda f: publish_one(feedback, f),
        reply_topic,
    )
    consumer = f"gateway {name}"

    @broker.subscriber(
        reply_topic,
        group_id=settings.group("gateway", name),
        batch=True,
        max_records=256,
        batch_timeout_ms=5,
        auto_offset_reset="earliest",
        ack_policy=AckPolicy.NACK_ON_ERROR,
        decoder=keep_bytes,
        session_timeout_ms=settings.kafka_session_timeout_ms,
        heartbeat_interval_ms=settings.kafka_heartbeat_ms,
        fetch_max_wait_ms=settings.kafka_fetch_max_wait_ms,
        description="answers to this replica's queries (workers publish each answer here too)",
    )
    async def on_replies(bodies: list[bytes], message: KafkaMessage) -> None:
        parsed = [(record, parse_or_dead_letter(Answer, record, consumer)) for record in message.raw_message]
        answers = [(record, p) for record, p in parsed if not isinstance(p, DeadLetter)]
        dead = [p for _, p in parsed if isinstance(p, DeadLetter)]
        outcomes = await gateway.on_replies([a for _, a in answers])  # Redis down: raises, the batch is read again
        for (record, answer), outcome in zip(answers, outcomes):
            metrics.replies.labels(outcome).inc()
            if outcome == "forged":
                dead.append(
                    dead_letter(record, f"answer for {answer.query_id} without a valid worker signature", consumer)
                )
        for _ in range(len(parsed) - len(answers)):
            metrics.replies.labels("unreadable").inc()
        await publish_dead_letters(dead_letters, dead)

    started: list[bool] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await ensure_topics(settings, extra=(reply_topic,))
        await broker.start()
        started.append(True)
        url = f"http://{settings.gateway_host}:{settings.gateway_port}"
        process = f"{socket.gethostname()}-{os.getpid()}"
        mark = asyncio.create_task(marks.keep_ready("gateway", process, url))
        registration = asyncio.create_task(marks.keep_reply_topic(reply_topic))  # workers reply to no other
        log.info(
            "gateway %s ready on %s (reply topic %s; serves %s)",
            name,
            url,
            reply_topic,
            ", ".join(MODEL_OF[s] for s in gateway.strategies),
        )
        try:
            yield
        finally:
            mark.cancel()
            registration.cancel()
            await marks.mark_ready("gateway", process, ready=False)
            await broker.stop()
            await redis.aclose()

    app = FastAPI(
        title="rlens gateway",
        version="1",
        lifespan=lifespan,
        description="OpenAI-compatible front door of an rlens ensemble, with a feedback API. See README.md.",
    )
    app.state.gateway, app.state.broker = gateway, broker

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
        return error_response(
            ApiError(
                400,
                f"{where}: {first['msg']}" if where else first["msg"],
                "invalid_request_error",
                "invalid_request",
                where or None,
            )
        )

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(
            ApiError(exc.status_code, str(exc.detail), "invalid_request_error", headers=dict(exc.headers or {}))
        )

    @app.exception_handler(RedisError)
    async def on_redis(request: Request, exc: RedisError) -> JSONResponse:
        log.error("Redis unreachable: %s", exc)
        return error_response(
            ApiError(
                503,
                "the gateway's state store (Redis) is unreachable; retry shortly",
                "server_error",
                "unavailable",
                headers={"Retry-After": "1"},
            )
        )

    app.add_middleware(Contain)
    app.add_middleware(BodyLimit, limit=settings.gateway_max_body_bytes, timeout_s=settings.gateway_body_timeout_s)
    app.add_middleware(Measure, metrics=metrics)

    async def key_of(request: Request, authorization: str | None = Header(None)) -> KeyRecord:  # async: no thread hop
        return gateway.authorize(authorization, request.client.host if request.client else "")

    def answer_response(answer: Answer, model: str, chat: bool, stream: bool) -> Any:
        if not answer.answered_models:
            failures = "; ".join(f"{f.model}: {f.reason}" for f in answer.failures) or "no model was called"
            raise ApiError(
                502,
                f"no model of the pool answered ({failures})",
                "server_error",
                "no_model_answered",
                query_id=answer.query_id,
            )
        if stream:
            events = (
                "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in stream_chunks(answer, model, chat))
                + "data: [DONE]\n\n"
            )
            return StreamingResponse(iter([events]), media_type="text/event-stream")
        body = chat_completion(answer, model) if chat else completion(answer, model)
        # already validated: skip FastAPI's second pass
        return Response(body.model_dump_json(), media_type="application/json")

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models(key: KeyRecord = Depends(key_of)) -> ModelList:
        """The strategies this deployment runs, as models."""
        return ModelList(data=[ModelCard(id=MODEL_OF[s]) for s in gateway.strategies])

    async def ask(
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        key: KeyRecord,
        idempotency_key: str | None,
        stream_key: str | None,
    ):
        answer = await gateway.ask(key, body, await request.body(), idempotency_key, stream_key)
        return answer_response(answer, body.model, isinstance(body, ChatCompletionRequest), body.stream)

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERRORS)
    async def chat_completions(
        request: Request,
        body: ChatCompletionRequest,
        key: KeyRecord = Depends(key_of),
        idempotency_key: str | None = Header(None),
        x_rlens_stream: str | None = Header(None),
    ):
        """Answer a conversation (multiple choice with rlens.choices, model rlens-focal; open-ended: rlens-rlae, or rlens-focal over sampled answers)."""
        return await ask(request, body, key, idempotency_key, x_rlens_stream)

    @app.post("/v1/completions", response_model=Completion, responses=ERRORS)
    async def completions(
        request: Request,
        body: CompletionRequest,
        key: KeyRecord = Depends(key_of),
        idempotency_key: str | None = Header(None),
        x_rlens_stream: str | None = Header(None),
    ):
        """Answer a prompt (multiple choice with rlens.choices, model rlens-focal; open-ended: rlens-rlae, or rlens-focal over sampled answers)."""
        return await ask(request, body, key, idempotency_key, x_rlens_stream)

    @app.get(
        "/v1/answers/{query_id}",
        response_model=ChatCompletion | Completion,
        responses={**ERRORS, 202: {"model": AnswerStatus}},
    )
    async def answers(query_id: str, key: KeyRecord = Depends(key_of)):
        """A query's answer (e.g. after a 504), for as long as the gateway retains it; 202 while it is pending."""
        await gateway.take_token(key)
        record = await gateway.owned_query(key, query_id)
        answer = await gateway.state.answer(query_id)
        if answer is None:
            return JSONResponse(AnswerStatus(id=query_id).model_dump(), 202)
        return answer_response(answer, record.model, record.chat, stream=False)

    @app.post(
        "/v1/feedback",
        response_model=FeedbackReceipt,
        status_code=202,
        responses={**ERRORS, 200: {"model": FeedbackReceipt}},
    )
    async def feedback_route(body: FeedbackRequest, key: KeyRecord = Depends(key_of)):
        """Rate an answer of this key's tenant once: 202 accepted; 200 duplicate (it had feedback; nothing changed)."""
        await gateway.take_token(key)
        receipt = await gateway.feedback(key, body)
        return receipt if receipt.status == "accepted" else JSONResponse(receipt.model_dump(), 200)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        return Response("ok\n")

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> Response:
        if not started:
            return Response("not ready: Kafka not connected yet\n", 503)
        try:
            await redis.ping()
        except (RedisError, OSError) as exc:
            return Response(f"not ready: Redis unreachable ({exc})\n", 503)
        return Response("ready\n")

    @app.get("/metrics", include_in_schema=False)
    async def metrics_route(authorization: str | None = Header(None)) -> Response:
        if not admin_allowed(authorization, admin_token(settings)):
            return Response(
                "the admin token is needed here\n", 401, {"WWW-Authenticate": 'Basic realm="rlens monitoring"'}
            )
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_gateway(settings: Settings) -> None:
    import uvicorn

    from rlens.ports import free_port

    check_exposure(settings.gateway_host, admin_token(settings), "RLENS_GATEWAY_HOST")
    asyncio.run(check_idempotence(settings))
    if not settings.gateway_port:
        settings = settings.model_copy(update={"gateway_port": free_port()})
    setup_logging()
    uvicorn.run(
        create_gateway_app(settings),
        host=settings.gateway_host,
        port=settings.gateway_port,
        log_level="warning",
        limit_concurrency=settings.gateway_max_connections,
        timeout_keep_alive=max(1, round(settings.gateway_idle_timeout_s)),
    )


OPENAPI_FILE = Path(__file__).resolve().parents[3] / "schemas" / "gateway.openapi.json"


def openapi_document() -> dict:
    """The gateway's OpenAPI document (what it serves at /openapi.json)."""
    from pydantic import SecretStr

    settings = Settings(_env_file=None, feedback_secret=SecretStr("x" * 32), gateway_keys="[]")  # defaults only
    return create_gateway_app(settings).openapi()


if __name__ == "__main__":  # python -m rlens.service.gateway.app: rewrite schemas/gateway.openapi.json
    OPENAPI_FILE.write_text(json.dumps(openapi_document(), indent=1) + "\n")
    print(OPENAPI_FILE)
