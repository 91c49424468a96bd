"""``rlens gateway``: the OpenAI-compatible front door of the service (FastAPI on uvicorn, Kafka through FastStream).
This module wires it: the publishers, the Redis pool, the reply subscriber (:mod:`.replies`), the logic
(:mod:`.core`), the middleware, the routes (:mod:`.routes`) and the health routes; :func:`openapi_document` is the
document it serves (``python -m rlens.service.gateway.app`` rewrites ``schemas/gateway.openapi.json``)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from typing import Any
from contextlib import asynccontextmanager, suppress
from pathlib import Path

from aiokafka.errors import KafkaError
from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig
from faststream.kafka import KafkaBroker
from prometheus_client import CollectorRegistry
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from rlens.messages import DeadLetter, Feedback, Query, Spending
from rlens.service.common.health import Readiness, add_http_routes, admin_token, http_routes
from rlens.service.common.kafka import (
    Topics,
    TopicRestorer,
    ensure_topics,
    keep_topics,
    make_broker,
    read_topic,
    typed_publisher,
)
from rlens.service.common.metrics import GatewayMetrics
from rlens.service.common.security import feedback_tokens
from rlens.service.common.windows import RedisWindows
from rlens.service.gateway.api_keys import KeyStore
from rlens.service.gateway.core import Gateway, gateway_id
from rlens.service.gateway.middleware import BodyLimit, Contain, Measure
from rlens.service.gateway.openai_api import MODEL_OF
from rlens.service.gateway.replies import subscribe_replies
from rlens.redis_clients import async_redis, closed_transport_is_a_lost_connection, parse_redis_url
from rlens.service.common.tracing import trace_carrier
from rlens.service.gateway.routes import add_error_handlers, openai_router
from rlens.service.gateway.spending import SpendingLedger
from rlens.service.gateway.state import GatewayState
from rlens.settings import Settings

log = logging.getLogger("rlens.gateway")
REDIS_CONNECTIONS = 64
# polled all day by orchestrators and Prometheus: never traced (FastAPI's own telemetry traces every other request,
# its HTTP server span, without a span per dependency, endpoint and serialization step)
PROBES = ("/healthz", "/readyz", "/metrics")


def redis_pool(settings: Settings) -> Redis:
    """The gateway's Redis client: a bounded pool of connections (on one server, requests wait for a free one
    instead of failing), and a broken connection is replaced (tried again on a connection error only: a command the
    server may have run is never repeated after a timeout). A Sentinel's master or a Redis Cluster: the same
    options, through :func:`rlens.redis_clients.async_redis`."""
    url = settings.redis.url.get_secret_value()
    options: dict[str, Any] = {
        "max_connections": REDIS_CONNECTIONS,
        "socket_timeout": 5,
        "socket_connect_timeout": 2,
        # a pooled connection that a Redis restart broke fails once, then connects again: not a 503
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        "retry_on_error": [RedisConnectionError],
    }
    if parse_redis_url(url).kind != "single":
        return async_redis(url, **options)
    closed_transport_is_a_lost_connection()
    pool = BlockingConnectionPool.from_url(url, timeout=5, health_check_interval=10, **options)
    return Redis(connection_pool=pool)


def publishers(broker: KafkaBroker, topics: Topics) -> tuple[Any, Any, Any, Any]:
    """The gateway's publishers: queries, feedback, dead letters, spending."""
    return (
        typed_publisher(
            broker, topics.queries, Query, "gateway", "the requests, each with reply_to = the replica's reply topic"
        ),
        typed_publisher(broker, topics.feedback, Feedback, "gateway", "feedback given through POST /v1/feedback"),
        typed_publisher(
            broker, topics.dead_letter, DeadLetter, "gateway", "replies that could not be used, with the reason"
        ),
        typed_publisher(
            broker, topics.spending, Spending, "gateway", "each gateway process's running total per API key and period"
        ),
    )


async def publish_one(publisher: Any, message: Query | Feedback, restorer: TopicRestorer) -> None:
    """One message, with the request's trace context in the record's headers (W3C traceparent: the worker's spans
    join its trace); a publish the broker refuses is tried once more after the topics are made again (a broker
    restarted empty)."""
    for last in (False, True):
        try:
            await publisher.publish(
                message.model_dump_json().encode(), key=message.query_id.encode(), headers=trace_carrier() or None
            )
            return
        except KafkaError:
            if last:
                raise
            await restorer.restore()


def create_gateway_app(settings: Settings, keys: KeyStore | None = None) -> FastAPI:
    """The gateway's ASGI app: the OpenAI routes, feedback and answers, and /metrics, /healthz, /readyz."""
    keys = keys or KeyStore(
        settings.gateway.keys_file if settings.gateway.keys is None else None, settings.gateway.keys
    )
    topics = Topics.from_settings(settings)
    name = gateway_id(settings)
    reply_topic = topics.replies(name)
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    broker = make_broker(settings)
    queries, feedback, dead_letters, spending = publishers(broker, topics)
    redis = redis_pool(settings)
    marks = RedisWindows(redis, 1, 1, settings.redis.prefix)  # only its readiness mark

    restorer = TopicRestorer(settings, every_s=1.0, extra=(reply_topic,))
    state = GatewayState(redis, settings.redis.prefix, settings.gateway.retention_s)
    tokens = feedback_tokens(settings)

    async def publish_spending(record: Spending) -> None:
        await spending.publish(record.model_dump_json().encode(), key=record.record_key())

    async def read_spending() -> list[bytes | None]:
        return [record.value for record in await read_topic(settings, topics.spending)]

    ledger = SpendingLedger(name, state, tokens, publish_spending, read_spending)
    gateway = Gateway(
        settings,
        keys,
        state,
        tokens,
        metrics,
        ledger,
        lambda q: publish_one(queries, q, restorer),
        lambda f: publish_one(feedback, f, restorer),
        reply_topic,
    )
    subscribe_replies(broker, settings, gateway, metrics, dead_letters, reply_topic, name)

    url = f"http://{settings.gateway.host}:{settings.gateway.port}"
    readiness = Readiness("gateway", f"{socket.gethostname()}-{os.getpid()}", url, "Kafka not connected yet")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await ensure_topics(settings, extra=(reply_topic,))
        await broker.start()
        readiness.start(
            marks,
            marks.keep_reply_topic(reply_topic),  # workers reply to no other topic
            keep_topics(settings, (topics.queries, topics.feedback), extra=(reply_topic,)),  # a broker restarted empty
            ledger.keep_publishing(),
        )
        served = ", ".join(MODEL_OF[s] for s in gateway.strategies)
        log.info("gateway %s ready on %s (reply topic %s; serves %s)", name, url, reply_topic, served)
        try:
            yield
        finally:
            await readiness.stop()
            with suppress(TimeoutError):  # what this process charged since the last flush, unless the broker is gone
                await asyncio.wait_for(ledger.flush(), 5)
            await broker.stop()
            await redis.aclose()

    app = FastAPI(
        title="rlens gateway",
        version="1",
        lifespan=lifespan,
        description="OpenAI-compatible front door of an rlens ensemble, with a feedback API. See README.md.",
        telemetry=TelemetryConfig(operation_spans=False, exclude=lambda scope: scope.get("path") in PROBES),
    )
    app.state.gateway, app.state.broker = gateway, broker

    add_error_handlers(app)
    app.add_middleware(Contain)
    app.add_middleware(BodyLimit, limit=settings.gateway.max_body_bytes, timeout_s=settings.gateway.body_timeout_s)
    app.add_middleware(Measure, metrics=metrics, access_sample=settings.gateway.access_log_sample)
    app.include_router(openai_router(gateway))

    add_http_routes(app, http_routes(registry, readiness.not_ready, admin_token(settings)))
    return app


OPENAPI_FILE = Path(__file__).resolve().parents[3] / "schemas" / "gateway.openapi.json"


def openapi_document() -> dict:
    """The gateway's OpenAPI document (what it serves at /openapi.json)."""
    from pydantic import SecretStr

    settings = Settings.model_validate(  # defaults only: no variable, no file
        {"security": {"feedback_secret": SecretStr("x" * 32)}, "gateway": {"keys": "[]"}}
    )
    return create_gateway_app(settings).openapi()


if __name__ == "__main__":  # python -m rlens.service.gateway.app: rewrite schemas/gateway.openapi.json
    OPENAPI_FILE.write_text(json.dumps(openapi_document(), indent=1) + "\n")
    print(OPENAPI_FILE)
