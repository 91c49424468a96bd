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
import logging
import math
import re
import socket
import time
import uuid
from typing import cast
from collections import Counter

from aiokafka.errors import KafkaError

from rlens.messages import MAX_TEXT, Answer, Feedback, Query, tenant_stream
from rlens.service.gateway.api_keys import FailedAuth, KeyRecord, KeyStore
from rlens.service.gateway.spending import SpendingLedger
from rlens.service.gateway.state import GatewayState, QueryRecord, SpendingLost, digest
from rlens.service.gateway.timing import Stages
from rlens.service.common.metrics import GatewayMetrics
from rlens.service.gateway.openai_api import (
    MODEL_OF,
    MODELS,
    DEFAULT_STREAM,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    FeedbackReceipt,
    FeedbackRequest,
)
from rlens.service.common.security import FeedbackTokens
from rlens.service.common.tracing import link_to, trace_carrier
from rlens.settings import Settings

log = logging.getLogger("rlens.gateway")
POLL_S = 0.5  # how often a request whose answer goes to another replica (an idempotent retry) looks in Redis


def gateway_id(settings: Settings) -> str:
    return settings.gateway.id or re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:100]


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
        spending: SpendingLedger,
        publish_query,
        publish_feedback,
        reply_topic: str,
    ):
        self.settings, self.keys, self.state, self.tokens, self.metrics = settings, keys, state, tokens, metrics
        self.spending = spending
        self.publish_query, self.publish_feedback, self.reply_topic = publish_query, publish_feedback, reply_topic
        self.strategies = settings.gateway.strategies or [settings.service.strategy]
        self.waiting = 0
        self.auth_failures = FailedAuth(settings.gateway.auth_failures_per_s)
        self._answers: dict[str, asyncio.Future] = {}  # query id -> its answer, for requests waiting on this replica
        self._waiters: Counter[str] = Counter()  # query id -> requests waiting for it here
        self._asked: dict[str, QueryRecord] = {}  # query id -> its record, for queries this replica published

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
        if strategy == "rlae" and request.rlens.budget is not None:
            raise ApiError(
                400,
                "rlens-rlae merges every model of the pool token by token: rlens.budget applies to rlens-focal only",
                "invalid_request_error",
                "unexpected_budget",
                "rlens.budget",
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
        if len(prompt) > min(self.settings.gateway.max_prompt_chars, MAX_TEXT):
            raise ApiError(
                413,
                f"the prompt has {len(prompt)} characters; the limit is {self.settings.gateway.max_prompt_chars}",
                "invalid_request_error",
                "prompt_too_long",
                "messages",
            )
        return stream

    async def _hold_budget(self, key: KeyRecord, query_id: str, strategy: str, cap: float | None) -> float | None:
        """Hold what the query may cost of the key's budget before it is published, and return the query's own
        budget (a share of the pool's cost): the request's ``rlens.budget``, cut to what the key has left (the
        Decider then calls only models that fit). rlae calls the whole pool: it needs the pool's full cost left.
        429 when less than the cheapest answer is left; 503 before any worker announced the pool's costs."""
        if key.budget is None:
            return cap
        costs = await self.state.pool_costs(strategy)
        if costs is None:
            raise ApiError(
                503,
                "no worker has announced its pool's costs yet (a key with a budget needs them); retry shortly",
                "server_error",
                "unavailable",
                headers={"Retry-After": "1"},
            )
        full = sum(costs)
        if full <= 0:
            return cap
        most, least = (full, full) if strategy == "rlae" else (full * (cap or 1.0), min(costs))
        try:
            taken, amount = await self.state.reserve(key.id, key.budget_period, query_id, most, least, key.budget)
        except SpendingLost:  # Redis restarted empty: the key's spending comes back from the topic first
            await self._restore_spending(key)
            taken, amount = await self.state.reserve(key.id, key.budget_period, query_id, most, least, key.budget)
        if not taken:
            self.metrics.budget_refused.inc()
            period = "" if key.budget_period == "total" else f" for this {key.budget_period[:-2].replace('dai', 'day')}"
            raise ApiError(
                429,
                f"this API key's budget of {key.budget:g} cost units{period} has {max(amount, 0.0):.6g} left, less "
                f"than the cheapest answer ({least:.6g}); a larger budget needs a new key (rlens keys add --budget)",
                "insufficient_quota",
                "budget_exhausted",
            )
        share = amount / full
        return None if strategy == "rlae" or share >= 1.0 else share

    async def _restore_spending(self, key: KeyRecord) -> None:
        """The key's spending back from the spending topic; 503 while the topic cannot be read (no hold is made on
        a spending Redis lost)."""
        try:
            await self.spending.restore(key.id, key.budget_period)
        except (KafkaError, OSError, TimeoutError) as exc:
            log.warning("could not restore the spending of key %s: %r", key.id, exc)
            raise ApiError(
                503,
                "this API key's spending is being restored (the state store restarted) and the spending topic "
                "cannot be read now; retry shortly",
                "server_error",
                "unavailable",
                headers={"Retry-After": "2"},
            ) from exc

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
        idempotency_key: str | None,
        stream_header: str | None,
        stages: Stages | None = None,
    ) -> Answer:
        """The answer to one request: published as a query and waited for (or the first answer of an earlier
        request with the same ``Idempotency-Key``); ``stages`` marks where the time went."""
        stages = stages or Stages()
        chat = isinstance(request, ChatCompletionRequest)
        prompt = request.prompt() if isinstance(request, ChatCompletionRequest) else request.text()
        stream = self._check(key, request, prompt, stream_header)
        await self.take_token(key)
        if self.waiting >= self.settings.gateway.max_waiting:  # before any wait, an idempotent retry's included
            raise ApiError(
                503,
                f"{self.waiting} requests are waiting for answers on this gateway; retry shortly",
                "server_error",
                "overloaded",
                headers={"Retry-After": "1"},
            )
        query_id = f"rl-{uuid.uuid4().hex}"
        if idempotency_key:
            # the request as parsed (JSON spaced or ordered otherwise is the same request), and its stream: it may
            # come from the header
            request_digest = digest(stream.encode() + b"\0" + request.model_dump_json().encode())
            query_id, answer, published = await self._earlier(key, idempotency_key, request_digest, query_id)
            if answer is not None:
                stages.mark("admit")
                return answer
            if published:
                stages.mark("admit")
                return await self._wait(query_id, poll=True)
        budget = await self._hold_budget(key, query_id, MODELS[request.model], request.rlens.budget)
        stages.mark("admit")
        record = QueryRecord(
            tenant=key.tenant,
            stream=stream,
            model=request.model,
            chat=chat,
            n_choices=len(request.rlens.choices or []),
            key_id=key.id,
            budget_period=key.budget_period if key.budget is not None else "",
            traceparent=trace_carrier().get("traceparent", ""),
        )
        # expected before it is published: a reply that comes before the wait begins wakes it, with no Redis read
        self._answers.setdefault(query_id, asyncio.get_running_loop().create_future())
        self._asked[query_id] = record
        try:
            await self.state.remember_query(query_id, record)
            stages.mark("state")
            await self._publish(query_id, tenant_stream(key.tenant, stream), prompt, request, budget)
            stages.mark("publish")
        except Exception:
            self._forget(query_id)
            if key.budget is not None:
                await self.state.release(key.id, query_id)
            raise
        if idempotency_key:  # only a retry with the same key reads it (:meth:`_earlier`)
            await self.state.mark_published(query_id, record)
            stages.mark("state")
        return await self._wait(query_id, look_first=False)

    async def _earlier(
        self, key: KeyRecord, idempotency_key: str, request_digest: str, query_id: str
    ) -> tuple[str, Answer | None, bool]:
        """The query an ``Idempotency-Key`` stands for (``query_id`` when it is new), its answer if one is kept, and
        whether an earlier request published it (then its answer is waited for); 409 when the key came with another
        request."""
        if len(idempotency_key) > 256:
            raise ApiError(
                400, "Idempotency-Key is longer than 256 characters", "invalid_request_error", "invalid_idempotency_key"
            )
        earlier = await self.state.idempotent(key.tenant, idempotency_key, request_digest, query_id)
        if earlier is None:
            return query_id, None, False
        query_id, earlier_digest = earlier
        if earlier_digest != request_digest:
            record = await self.state.query(query_id)
            raise ApiError(
                409,
                "this Idempotency-Key was used with a different request",
                "invalid_request_error",
                "idempotency_key_reused",
                # the first request's id only to a key that may read it (its tenant's, on a stream it may use)
                query_id=query_id if record is not None and key.allows(record.stream) else None,
            )
        self.metrics.idempotent_replays.inc()
        if (answer := await self.state.answer(query_id)) is not None:
            return query_id, answer, True
        record = await self.state.query(query_id)
        # not published: the first request's replica crashed before it published; this one publishes it now
        return query_id, None, record is not None and record.published

    async def _publish(
        self,
        query_id: str,
        stream: str,
        prompt: str,
        request: ChatCompletionRequest | CompletionRequest,
        budget: float | None,
    ) -> None:
        """The request on ``queries``, signed for its tenant's stream, replies to this replica; 503 if Kafka fails."""
        query = Query(
            query_id=query_id,
            stream=stream,
            prompt=prompt,
            choices=request.rlens.choices,
            reference_id=request.rlens.reference_id,
            budget=budget,
            sent_at=time.time(),
            reply_to=self.reply_topic,
            signature=self.tokens.query_signature(query_id, stream),
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

    async def _wait(self, query_id: str, poll: bool = False, look_first: bool = True) -> Answer:
        """The query's answer: from this replica's replies (:meth:`on_replies` keeps each answer in Redis before it
        wakes the waiters, so one that came before this wait began is found there; not looked for first where
        ``look_first`` is False: the query was expected here before it was published), or, with ``poll``, from
        Redis every POLL_S (a retry of a query another replica asked)."""
        future = self._answers.setdefault(query_id, asyncio.get_running_loop().create_future())
        self._waiters[query_id] += 1
        deadline = time.monotonic() + self.settings.gateway.timeout_s
        self.waiting += 1
        self.metrics.waiting.set(self.waiting)
        try:
            while True:
                if future.done():
                    return future.result()
                if look_first and (answer := await self.state.answer(query_id)) is not None:
                    return answer
                look_first = True
                left = deadline - time.monotonic()
                if left <= 0:
                    self.metrics.timeouts.inc()
                    raise ApiError(
                        504,
                        f"no answer within {self.settings.gateway.timeout_s:g} s; fetch it later at /v1/answers/{query_id}",
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
            self._forget(query_id)

    def _forget(self, query_id: str) -> None:
        """Once no request waits for the query here, its future and record."""
        if self._waiters[query_id] <= 0:
            del self._waiters[query_id]
            self._answers.pop(query_id, None)
            self._asked.pop(query_id, None)

    async def on_replies(self, answers: list[Answer]) -> list[str]:
        """Take answers from the reply topic; what became of each (stored, duplicate, unknown, forged)."""
        # only a worker (holding the feedback secret) can sign an answer, an empty one included
        outcomes = ["" if self.tokens.signed(answer) else "forged" for answer in answers]
        candidates = [i for i, outcome in enumerate(outcomes) if not outcome]
        records: dict[int, QueryRecord | None] = {
            i: self._asked[answers[i].query_id] for i in candidates if answers[i].query_id in self._asked
        }
        others = [i for i in candidates if i not in records]  # asked before a restart, or by a retry's replica
        if others:
            records.update(zip(others, await self.state.records([answers[i].query_id for i in others])))
        for i, record in records.items():
            outcomes[i] = "" if record is not None else "unknown"  # not ours, or past retention
        kept = [i for i, outcome in enumerate(outcomes) if not outcome]
        charges, resolved = [], []
        for i, first in zip(kept, await self.state.store_answers([answers[i] for i in kept])):
            outcomes[i] = "stored" if first else "duplicate"
            record = cast(QueryRecord, records[i])
            key_id = record.key_id
            if first and key_id:  # each answer once, to the key that asked
                charges.append((key_id, record.budget_period, answers[i].query_id, answers[i].cost))
                self.metrics.cost.labels(key_id).inc(answers[i].cost)
                self.metrics.model_calls.labels(key_id).inc(len(answers[i].called_models))
            resolved.append(answers[i] if first else await self.state.answer(answers[i].query_id) or answers[i])
        if charges:  # before a client hears its answer: its next request sees the spending
            await self.state.settle(charges)
            for key_id, period, _, cost in charges:
                self.spending.add(key_id, period, cost)
        for answer in resolved:
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
                f"no query {query_id!r} for this API key's tenant (unknown, or older than {self.settings.gateway.retention_s} s)",
                "invalid_request_error",
                "query_not_found",
                "id",
            )
        return record

    async def feedback(self, key: KeyRecord, request: FeedbackRequest) -> FeedbackReceipt:
        record = await self.owned_query(key, request.id)
        link_to(record.traceparent)  # the feedback's request span links to its query's trace
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
            token=self.tokens.token(request.id, tenant_stream(record.tenant, record.stream)),
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
