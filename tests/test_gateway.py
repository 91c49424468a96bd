"""The OpenAI-compatible gateway: API keys and rate buckets on a real Redis; then, on the wire (tansu, Redis, a
learner, a worker and the gateway as real processes), the official `openai` client unchanged, feedback applied
once, the 401/403/404/409/413/429/503/504 refusals, tenant isolation, idempotent retries, a forged reply, and a
schemathesis fuzz of the published OpenAPI document."""

from __future__ import annotations

import asyncio
from collections import Counter
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest.mock import patch

import httpx
import openai
import pytest
import schemathesis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from pydantic import SecretStr
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from redis.asyncio import Redis
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from rlens.messages import Answer, ModelFailureRecord, Query, Spending
from rlens.service.gateway.api_keys import KeysError, KeyStore, add_key, read_records, revoke_key
from rlens.service.gateway.app import OPENAPI_FILE, openapi_document
from rlens.service.gateway.spending import SpendingLedger, totals
from rlens.service.gateway.state import GatewayState, SpendingLost
from rlens.service.common.kafka import Topics
from rlens.service.common.security import FeedbackTokens
from rlens.local.stack import write_replay_pool
from rlens.settings import settings
from brokers import stack_for_tests
from otlp import OtlpReceiver

CHOICES = ["A", "B", "C", "D"]  # the bundled stream's questions have four options


def test_keys_are_stored_hashed_bound_to_streams_and_revocable(tmp_path):
    path = tmp_path / "keys.json"
    key, record = add_key(path, "acme", ["acme-*", "shared"])
    # only the hash is stored
    assert key.startswith(f"rlk_{record.id}_") and key.split("_", 2)[2] not in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    store = KeyStore(path)
    assert store.lookup(key) == record
    assert (
        store.lookup(key[:-1] + ("x" if key[-1] != "x" else "y")) is None
        and store.lookup(None) is None
        and store.lookup("rlk_") is None
    )
    assert (
        record.allows("acme-eu")
        and record.allows("shared")
        and not record.allows("other")
        and not record.allows("acme")
    )
    revoke_key(path, record.id)
    store.refresh()
    assert store.lookup(key) is None and read_records(path)[0].revoked
    with pytest.raises(KeysError, match="no API keys file at .*: make a key with `rlens keys add"):
        KeyStore(tmp_path / "missing.json")
    path.write_text('[{"id": 1}]')
    with pytest.raises(KeysError, match="is not a valid keys file"):
        read_records(path)


def test_cli_makes_lists_and_revokes_keys_and_never_prints_a_stored_secret(tmp_path):
    from typer.testing import CliRunner

    from rlens.cli import app

    path = tmp_path / "keys.json"
    added = CliRunner().invoke(
        app, ["keys", "add", "--tenant", "acme", "--streams", "acme-*, shared", "--rate", "5", "--file", str(path)]
    )
    assert added.exit_code == 0, added.output
    key = added.stdout.strip().splitlines()[-1]
    record = KeyStore(path).lookup(key)
    assert record is not None and record.streams == ["acme-*", "shared"] and record.rate_per_s == 5
    listed = CliRunner().invoke(app, ["keys", "list", "--file", str(path)])
    assert record.id in listed.output and "acme" in listed.output and key.split("_", 2)[2] not in listed.output
    assert CliRunner().invoke(app, ["keys", "revoke", record.id, "--file", str(path)]).exit_code == 0
    assert KeyStore(path).lookup(key) is None
    missing = CliRunner().invoke(app, ["keys", "revoke", "nope", "--file", str(path)])
    assert missing.exit_code == 2 and "no key 'nope'" in missing.output


def test_an_unexpected_error_is_a_500_logged_with_where_it_was_raised_never_its_text(caplog):
    """The gateway's outermost middleware: a bug is a 500 in the API's error shape, and its log line names the route,
    the type and the innermost frames (file, line, function), not the exception's text (it may quote the input)."""
    from fastapi import FastAPI

    from rlens.service.gateway.middleware import Contain

    app = FastAPI()

    @app.post("/v1/bug")
    async def bug(body: dict) -> dict:
        return {"value": body["prompt"].missing}  # AttributeError: 'str' object has no attribute 'missing'

    app.add_middleware(Contain)  # as the gateway's app adds it

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post("/v1/bug", json={"prompt": "a secret prompt"})

    with caplog.at_level("ERROR", logger="rlens.gateway"):
        reply = asyncio.run(scenario())
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "internal_error"
    [line] = [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
    assert line.startswith("internal error on /v1/bug: AttributeError at test_gateway.py:")
    assert " bug" in line and "secret" not in line and "missing" not in line


def test_the_rate_bucket_allows_the_burst_then_says_how_long_to_wait(redis_server):
    async def run() -> list[float]:
        redis = Redis.from_url(redis_server.url)
        state = GatewayState(redis, "bucket-test", 60)
        try:
            return [await state.take_token("k1", 2.0, 3) for _ in range(4)] + [await state.take_token("k2", 2.0, 3)]
        finally:
            await redis.aclose()

    waits = asyncio.run(run())
    assert waits[:3] == [0.0, 0.0, 0.0]  # the burst of 3
    assert 0.3 < waits[3] <= 0.5  # the 4th: one token at 2/s is 0.5 s away (less the time the calls took)
    assert waits[4] == 0.0  # another key has its own bucket


def test_a_keys_spending_is_the_sum_of_each_processs_last_record_and_comes_back_after_redis_lost_it(redis_server):
    """Issue 60: the spending topic's records, summed by hand; a Redis that lost a key's spending (no restored mark)
    refuses its hold until the ledger restored it; records without a gateway's signature, and spending that an older
    rlens kept under the key alone, handled as they should be. (The topic is a list here; the live test below has a
    broker.)"""
    ten = "2026-11"
    records = [
        Spending(key_id="k1", period="total", process="a", amount=1.0, at=1),
        Spending(key_id="k1", period="total", process="a", amount=2.5, at=2),  # a's last: 2.5
        Spending(key_id="k1", period="total", process="b", amount=0.5, at=3),
        Spending(key_id="k2", period=ten, process="a", amount=3.0, at=4),
    ]
    assert totals(records) == {("k1", "total"): 3.0, ("k2", ten): 3.0}
    tokens = FeedbackTokens("s" * 32)
    topic: list[bytes | None] = []

    async def publish(record: Spending) -> None:
        topic.append(record.model_dump_json().encode())

    async def read() -> list[bytes | None]:
        return list(topic)

    async def run() -> dict:
        redis = Redis.from_url(redis_server.url)
        state = GatewayState(redis, "spending-test", 60)
        one, two = (SpendingLedger("gw", state, tokens, publish, read) for _ in range(2))
        try:
            with pytest.raises(SpendingLost):  # a key never seen: no mark, restored (from nothing) first
                await state.reserve("k1", "total", "q0", 1.0, 0.1, 10.0)
            assert await one.restore("k1", "total") == 0.0
            assert await state.reserve("k1", "total", "q0", 1.0, 0.1, 10.0) == (True, 1.0)
            await state.settle([("k1", "total", "q0", 0.75)])
            one.add("k1", "total", 0.75)
            two.add("k1", "total", 2.0)
            two.add("k1", "total", 1.25)
            await one.flush()
            await two.flush()
            await two.flush()  # nothing new: nothing published
            topic.append(Spending(key_id="k1", period="total", process="x", amount=99, at=5).model_dump_json().encode())
            topic.append(b"not json")
            topic.append(None)  # a tombstone
            published = len(topic)
            await redis.flushall()  # Redis restarted empty
            await redis.set("spending-test:gw:spent:k1", 0.5)  # what an rlens before budget periods kept
            with pytest.raises(SpendingLost):
                await state.reserve("k1", "total", "q1", 1.0, 0.1, 10.0)
            restored = await one.restore("k1", "total")  # 0.75 + 3.25 (the forged 99 ignored) + the old 0.5
            after = await state.reserve("k1", "total", "q1", 10.0, 0.1, 10.0)
            await one.flush()  # the old spending is on the topic now, as one's
            return {
                "published": published,
                "restored": restored,
                "after": after,
                "old": await redis.get("spending-test:gw:spent:k1"),
                "topic": totals(
                    r
                    for r in (Spending.model_validate_json(v) for v in topic if v and v.startswith(b"{"))
                    if r.signature
                ),
            }
        finally:
            await redis.aclose()

    seen = asyncio.run(run())
    assert seen["published"] == 2 + 3  # one record of each ledger (two's two charges in one total), 3 not a gateway's
    assert seen["restored"] == pytest.approx(4.5)
    assert seen["after"] == (True, pytest.approx(5.5))  # what is left of 10
    assert seen["old"] is None and seen["topic"] == {("k1", "total"): pytest.approx(4.5)}


# on the wire

TIMEOUT_S = 8.0
ADMIN_TOKEN = "admin-token-of-the-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_WAITING = 3
HEADER_TIMEOUT_S = 3.0
PER_ADDRESS = 100  # connections one client address may hold (the tests' own requests come from 127.0.0.1)
BUDGET = 1.0  # cost units of the "budget" key (the replay pool's models cost 0.1 to 135 each)
PRICE = {"input": 3.0, "output": 15.0}  # the first model's, per million tokens


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gateway")
    pool = write_replay_pool(settings().service.demo_data, workdir / "pool.json")
    priced = json.loads(pool.read_text())  # one model priced in money: answers say what its calls cost
    priced["models"][0]["price"] = PRICE
    pool.write_text(json.dumps(priced))
    config = settings().updated(
        {
            "pool_file": pool,
            "kafka_session_timeout_ms": 2000,
            "kafka_heartbeat_ms": 500,
            "gateway_port": 0,
            "gateway_id": "test-gw",
            "gateway_timeout_s": TIMEOUT_S,
            "gateway_max_waiting": MAX_WAITING,
            "gateway_max_prompt_chars": 1000,
            "gateway_body_timeout_s": 2.0,
            "gateway_header_timeout_s": HEADER_TIMEOUT_S,
            "gateway_max_connections_per_address": PER_ADDRESS,
            "admin_token": SecretStr(ADMIN_TOKEN),
            "trace_dir": workdir / "traces",  # every process's spans, as JSON lines
        }
    )
    stack = stack_for_tests(config, workdir)
    keys = {"local": stack.gateway_key.read_text().strip()}
    keys["acme"], _ = add_key(workdir / "keys.json", "acme", ["acme-*"])
    keys["other"], _ = add_key(workdir / "keys.json", "other", ["*"])
    keys["slow"], _ = add_key(workdir / "keys.json", "slow", ["*"], rate_per_s=0.2, burst=2)
    keys["acme-eu"], _ = add_key(workdir / "keys.json", "acme", ["acme-eu"])  # acme's, on one stream only
    keys["budget"], _ = add_key(workdir / "keys.json", "budget", ["*"], budget=BUDGET)
    keys["crowd"], _ = add_key(workdir / "keys.json", "crowd", ["*"], rate_per_s=1000, burst=1000, budget=2.0)
    keys["daily"], _ = add_key(workdir / "keys.json", "daily", ["*"], budget=BUDGET, budget_period="daily")
    keys["durable"], _ = add_key(workdir / "keys.json", "durable", ["*"], budget=BUDGET)
    receiver = OtlpReceiver()  # the processes export their spans over OTLP too, set up by the SDK's own variables
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_SERVICE_NAME": "rlens-under-test",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=test",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    with patch.dict(os.environ, otel):  # the children's environment only
        stack.start_learner()
        stack.start_worker()
        stack.start_gateway()
    try:
        stack.wait_ready(120)
        urls = stack.http_urls()
        url = next(u for name, u in urls.items() if name.startswith("gateway:"))
        yield {"stack": stack, "url": url, "keys": keys, "urls": urls, "otlp": receiver}
    finally:
        for worker in stack.workers:
            worker.send_signal(signal.SIGCONT)
        stack.stop()
        receiver.close()


def auth(gw, who: str = "local") -> dict[str, str]:
    return {"Authorization": f"Bearer {gw['keys'][who]}"}


def ask(
    gw,
    who: str = "local",
    question: int = 0,
    stream: str = "demo",
    headers: dict | None = None,
    timeout: float = 60,
    **extra,
) -> httpx.Response:
    body = {
        "model": "rlens-focal",
        "messages": [{"role": "user", "content": f"question {question}"}],
        "rlens": {"choices": CHOICES, "reference_id": str(question)},
        "metadata": {"stream": stream},
        **extra,
    }
    return httpx.post(
        f"{gw['url']}/v1/chat/completions", json=body, headers={**auth(gw, who), **(headers or {})}, timeout=timeout
    )


def metric(url: str, name: str, **labels) -> float:
    """One sample of a process's /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics", headers=ADMIN, timeout=10).text
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + wanted + '}') if labels else ''} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def role_url(gw, role: str) -> str:
    return next(u for name, u in gw["urls"].items() if name.startswith(f"{role}:"))


def spend_until_refused(gw, key: str, check=lambda response: None) -> tuple[list[float], httpx.Response]:
    """Questions 0, 1, ... with ``key`` (on a stream of its name) until one is refused (at most 200), each answer
    ``check``ed: the answers' costs, and the last response."""
    charged = []
    for question in range(200):
        response = ask(gw, key, question=question, stream=key)
        if response.status_code == 429:
            break
        assert response.status_code == 200, response.text
        check(response)
        charged.append(response.json()["rlens"]["cost"])
    return charged, response


def test_each_answer_says_its_cost_and_overhead_and_a_spent_budget_refuses_the_key(gw):
    """Every answer: the pool cost units of the models it called, the models' time, the time rlens added (header,
    as LiteLLM's overhead header). A key with a budget is charged each answer's cost once, and refused past it."""
    pool = json.loads((gw["stack"].workdir / "pool.json").read_text())["models"]
    costs = {m["name"]: m["cost"] for m in pool}

    def check(response: httpx.Response) -> None:
        body, headers = response.json(), response.headers
        account = body["rlens"]
        assert account["cost"] == pytest.approx(sum(costs[m] for m in account["called_models"]))
        assert float(headers["x-rlens-cost"]) == pytest.approx(account["cost"], rel=1e-5)
        assert float(headers["x-rlens-model-duration-ms"]) == pytest.approx(account["model_ms"], abs=0.1)
        assert 0 <= account["model_ms"] <= account["latency_ms"]
        assert float(headers["x-rlens-overhead-duration-ms"]) >= 0
        # where the time went (issue 59): each stage once, the wait split with the worker's own figures
        stages = {
            k: float(v.removeprefix("dur="))
            for k, v in (p.strip().split(";") for p in headers["server-timing"].split(","))
        }
        assert list(stages) == ["admit", "state", "publish", "kafka", "worker", "models", "respond"]
        assert stages["models"] == pytest.approx(account["model_ms"], abs=0.01) and min(stages.values()) >= 0
        assert stages["worker"] + stages["models"] == pytest.approx(account["latency_ms"], abs=0.02)
        assert sum(stages.values()) <= 1000 * response.elapsed.total_seconds() + 1

    charged, response = spend_until_refused(gw, "budget", check)
    error = response.json()["error"]
    assert response.status_code == 429 and error["code"] == "budget_exhausted" and "budget of" in error["message"]
    # a budget caps: each query held what it may cost before it was published, its pool cut to what was left, so
    # the key never spends past it; it is refused once less than the cheapest model's cost is left
    assert len(charged) >= 2 and sum(charged) <= BUDGET + 1e-6 and BUDGET - sum(charged) < min(costs.values())
    key_id = gw["keys"]["budget"].split("_")[1]
    assert metric(gw["url"], "rlens_gateway_cost_total", key=key_id) == pytest.approx(sum(charged))
    assert metric(gw["url"], "rlens_gateway_budget_refused_total") >= 1
    assert metric(gw["url"], "rlens_gateway_stage_seconds_count", stage="kafka") >= len(charged)


def test_concurrent_requests_cannot_overspend_a_budget_and_a_daily_one_is_counted_by_day(gw):
    """Issue 60: 60 requests at once on a key with a budget of 2 (one answer of the full pool costs 135): what is
    spent stays within 2, every request is answered or refused with budget_exhausted, and a daily budget's spending
    is kept under today's date."""
    import datetime

    async def crowd():
        body = {
            "model": "rlens-focal",
            "messages": [{"role": "user", "content": "question 3"}],
            "rlens": {"choices": CHOICES, "reference_id": "3"},
            "metadata": {"stream": "crowd"},
        }
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(f"{gw['url']}/v1/chat/completions", json=body, headers=auth(gw, "crowd"))
                    for _ in range(60)
                )
            )

    responses = asyncio.run(crowd())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(200) >= 1, codes
    assert all(r.json()["error"]["code"] == "budget_exhausted" for r in responses if r.status_code == 429)
    spent = sum(r.json()["rlens"]["cost"] for r in responses if r.status_code == 200)
    assert spent <= 2.0 + 1e-6, spent

    async def stored(key_id: str, period: str) -> float:
        settings_ = gw["stack"].settings
        state = GatewayState(Redis.from_url(settings_.redis.url.get_secret_value()), settings_.redis.prefix, 60)
        try:
            return await state.spent(key_id, period)
        finally:
            await state.redis.aclose()

    assert asyncio.run(stored(gw["keys"]["crowd"].split("_")[1], "total")) == pytest.approx(spent)
    response = ask(gw, "daily", question=4, stream="daily")
    assert response.status_code == 200, response.text
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    state_key = f"{gw['stack'].settings.redis.prefix}:gw:spent:{{{gw['keys']['daily'].split('_')[1]}}}:{today}"
    assert asyncio.run(redis_float(gw, state_key)) == pytest.approx(response.json()["rlens"]["cost"])
    body = {"model": "rlens-focal", "messages": [{"role": "user", "content": "q"}], "rlens": {"budget": True}}
    refused = httpx.post(f"{gw['url']}/v1/chat/completions", json=body, headers=auth(gw), timeout=60)
    assert refused.status_code == 400 and "budget" in refused.text  # a boolean is not a number


def test_a_spent_budget_stays_spent_after_redis_restarts_empty(gw):
    """Issue 60: a key spends its budget; then Redis loses the key's spending (what an empty restart does to it: its
    spending, holds and restored mark gone). The key is still refused, its spending rebuilt from the spending topic."""
    charged, response = spend_until_refused(gw, "durable")
    assert response.status_code == 429 and len(charged) >= 2
    settings_ = gw["stack"].settings
    key_id = gw["keys"]["durable"].split("_")[1]
    # the gateway publishes its totals every second: wait until the topic has all of it
    on_topic = lambda found: totals(r for r in found if r.key_id == key_id).get((key_id, "total"), 0.0)  # noqa: E731
    spending_topic = Topics.from_settings(settings_).spending
    seen = read_topic(settings_, spending_topic, Spending, lambda f, _: on_topic(f) >= sum(charged) - 1e-9, 120)
    assert on_topic(seen) == pytest.approx(sum(charged))

    async def forget() -> int:
        redis = Redis.from_url(settings_.redis.url.get_secret_value())
        try:
            names = [k async for k in redis.scan_iter(f"{settings_.redis.prefix}:gw:*{{{key_id}}}*")]
            return await redis.delete(*names)
        finally:
            await redis.aclose()

    assert asyncio.run(forget()) >= 2  # its spending and its mark (its holds are settled)
    refused = ask(gw, "durable", question=0, stream="durable")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exhausted", refused.text
    spent = asyncio.run(redis_float(gw, f"{settings_.redis.prefix}:gw:spent:{{{key_id}}}:total"))
    assert spent == pytest.approx(sum(charged))
    assert "spending of key " + key_id + " restored" in (gw["stack"].workdir / "gateway.log").read_text()


async def redis_float(gw, key: str) -> float:
    redis = Redis.from_url(gw["stack"].settings.redis.url.get_secret_value())
    try:
        return float(await redis.get(key) or 0.0)
    finally:
        await redis.aclose()


def test_a_requests_own_budget_cuts_its_pool_and_a_bad_one_is_refused(gw):
    """rlens.budget: the models called for the request cost at most that share of the pool's cost (the bundled pool:
    one model is 99.6 % of it), the worker's Query carries it; out of (0, 1] it is a 400 naming the field."""
    pool = json.loads((gw["stack"].workdir / "pool.json").read_text())["models"]
    costs = {m["name"]: m["cost"] for m in pool}
    total = sum(costs.values())
    for question in range(12):
        budget = 0.002 if question % 2 else 0.5
        rlens = {"choices": CHOICES, "reference_id": str(question), "budget": budget}
        response = ask(gw, question=question, stream="capped", rlens=rlens)
        assert response.status_code == 200, response.text
        account = response.json()["rlens"]
        assert account["called_models"] and account["cost"] <= budget * total * (1 + 1e-6), (budget, account)
    assert read_answers(gw["stack"].settings, response.json()["id"]).cost <= 0.002 * total * (1 + 1e-6)
    for bad in (0, 1.5, "half"):
        refused = ask(gw, question=1, stream="capped", rlens={"choices": CHOICES, "reference_id": "1", "budget": bad})
        assert refused.status_code == 400 and "budget" in refused.text, refused.text


def spans_of(directory: Path) -> list[dict]:
    return [json.loads(line) for path in directory.glob("*.jsonl") for line in path.read_text().splitlines() if line]


@pytest.mark.kafka
def test_one_trace_follows_a_request_through_the_gateway_the_worker_its_models_and_the_learners_join(gw):
    """OpenTelemetry: the gateway's span, the worker's answer (its child, through the query record's traceparent
    header), one span per model called, and the learner's join of the feedback (through the experience's header)."""
    for probe in ("/healthz", "/readyz"):  # polled all day by an orchestrator: never traced
        assert httpx.get(f"{gw['url']}{probe}", timeout=30).status_code == 200
    response = ask(gw, question=21, stream="traced")
    assert response.status_code == 200, response.text
    query_id = response.json()["id"]
    given = httpx.post(f"{gw['url']}/v1/feedback", json={"id": query_id, "label": 1}, headers=auth(gw), timeout=30)
    assert given.status_code == 202, given.text
    deadline, found = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        spans = spans_of(gw["stack"].workdir / "traces")
        served = [s for s in spans if s["attributes"].get("rlens.query_id") == query_id]
        if any(s["name"] == "rlens.learner join" for s in served):
            found = spans
            break
        time.sleep(0.5)
    assert found, "the learner's join of the feedback was never traced"
    (request,) = [
        s for s in found if s["name"] == "chat rlens-focal" and s["attributes"].get("rlens.query_id") == query_id
    ]
    trace_id = request["context"]["trace_id"]
    in_trace = [s for s in found if s["context"]["trace_id"] == trace_id]
    roles = {s["resource"]["attributes"]["rlens.role"] for s in in_trace}
    assert roles == {"gateway", "worker", "learner"}, roles
    (answer,) = [s for s in in_trace if s["name"] == "rlens.worker answer"]
    assert answer["parent_id"] == request["context"]["span_id"]
    calls = [s for s in in_trace if s["name"].startswith("text_completion ")]
    called = response.json()["rlens"]["called_models"]
    assert sorted(s["attributes"]["gen_ai.request.model"] for s in calls) == sorted(called)
    assert all(s["parent_id"] == answer["context"]["span_id"] for s in calls)
    (join,) = [s for s in in_trace if s["name"] == "rlens.learner join"]
    assert join["parent_id"] == answer["context"]["span_id"] and -2.0 <= join["attributes"]["rlens.reward"] <= 1.0
    assert request["attributes"]["gen_ai.operation.name"] == "chat" and request["attributes"]["rlens.cost"] > 0
    usage = response.json()["usage"]
    assert request["attributes"]["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
    # one HTTP server span per request (FastAPI's, the route's span under it); the feedback's links to the query's
    (server,) = [s for s in in_trace if s["kind"] == "SpanKind.SERVER"]
    assert server["name"] == "POST /v1/chat/completions" and request["parent_id"] == server["context"]["span_id"]
    (feedback,) = [s for s in found if s["name"] == "POST /v1/feedback" and s["kind"] == "SpanKind.SERVER"]
    assert [link["context"]["span_id"] for link in feedback["links"]] == [request["context"]["span_id"]]
    assert not [s for s in found if any(probe in s["name"] for probe in ("/readyz", "/healthz", "/metrics"))]

    # the same trace over OTLP, configured only by OTEL_* variables: every model call its own timed span
    received: list[dict] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(s["name"] == "rlens.learner join" for s in received):
        received = [s for s in gw["otlp"].received() if s["trace_id"] == trace_id.removeprefix("0x")]
        time.sleep(0.5)
    assert {s["name"] for s in received} == {s["name"] for s in in_trace}, received
    assert {s["resource"]["service.name"] for s in received} == {"rlens-under-test"}
    assert {s["resource"]["rlens.role"] for s in received} == {"gateway", "worker", "learner"}
    assert {s["resource"]["deployment.environment.name"] for s in received} == {"test"}
    model_calls = {c["model"]: c for c in response.json()["rlens"]["model_calls"]}
    exported = [s for s in received if s["name"].startswith("text_completion ")]
    assert sorted(s["attributes"]["gen_ai.request.model"] for s in exported) == sorted(called) == sorted(model_calls)
    for s in exported:
        call = model_calls[s["attributes"]["gen_ai.request.model"]]
        assert s["attributes"]["gen_ai.provider.name"] == "replay" and s["attributes"]["gen_ai.response.model"]
        assert s["attributes"]["gen_ai.usage.input_tokens"] == call["prompt_tokens"] > 0
        assert abs((s["end_ns"] - s["start_ns"]) / 1e6 - call["duration_ms"]) < 0.01, (s, call)
    if len(exported) > 1:  # the replay models answer inline, one after the other: no two calls share a start
        assert len({s["start_ns"] for s in exported}) == len(exported), exported


def test_the_official_openai_client_works_unchanged(gw):
    client = openai.OpenAI(base_url=f"{gw['url']}/v1", api_key=gw["keys"]["local"], max_retries=0)
    assert [m.id for m in client.models.list()] == ["rlens-focal"]
    extra = {"rlens": {"choices": CHOICES, "reference_id": "3"}, "metadata": {"stream": "client"}}
    chat = client.chat.completions.create(
        model="rlens-focal", messages=[{"role": "user", "content": "question 3"}], extra_body=extra
    )
    account = chat.model_extra["rlens"]
    assert chat.id == account["query_id"] and chat.id.startswith("rl-") and chat.choices[0].finish_reason == "stop"
    assert (
        chat.choices[0].message.content == CHOICES[account["answer_index"]]
        and account["answered_models"]
        and account["policy_version"] >= 0
    )
    assert (
        account["stream"] == "client"
        and len(account["distribution"]) == 4
        and abs(sum(account["distribution"]) - 1) < 1e-4
    )
    text = client.completions.create(
        model="rlens-focal",
        prompt="question 4",
        extra_body={**extra, "rlens": {"choices": CHOICES, "reference_id": "4"}},
    )
    assert text.choices[0].text in CHOICES and text.id != chat.id
    # usage: every model called, its tokens (estimated from the texts: a replay pool has no tokenizer)
    for reply in (chat, text):
        calls = reply.model_extra["rlens"]["model_calls"]
        assert sorted(c["model"] for c in calls) == sorted(reply.model_extra["rlens"]["called_models"])
        assert reply.usage.prompt_tokens == sum(c["prompt_tokens"] for c in calls) > 0
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
        assert reply.usage.model_extra["cost"] == reply.model_extra["rlens"]["cost"] > 0
        priced = [c for c in calls if c["money"] is not None]
        assert [c["model"] for c in priced] == [c["model"] for c in calls if c["model"] == "smollm2-135m"]
        for c in priced:
            assert c["money"] == pytest.approx((3.0 * c["prompt_tokens"] + 15.0 * c["completion_tokens"]) / 1e6)
        assert reply.usage.model_extra["money"] == (pytest.approx(priced[0]["money"]) if priced else None)
    chunks = list(
        client.chat.completions.create(
            model="rlens-focal",
            messages=[{"role": "user", "content": "question 5"}],
            stream=True,
            extra_body={**extra, "rlens": {"choices": CHOICES, "reference_id": "5"}},
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) in CHOICES
        and chunks[-1].choices[0].finish_reason == "stop"
        and all(c.usage is None for c in chunks)
    )
    counted = list(
        client.chat.completions.create(
            model="rlens-focal",
            messages=[{"role": "user", "content": "question 6"}],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={**extra, "rlens": {"choices": CHOICES, "reference_id": "6"}},
        )
    )
    assert all(c.usage is None for c in counted[:-1]) and counted[-1].choices == []
    assert counted[-1].usage.prompt_tokens > 0 and counted[-2].choices[0].finish_reason == "stop"
    with pytest.raises(openai.NotFoundError, match="this deployment does not run rlens-rlae"):
        client.chat.completions.create(model="rlens-rlae", messages=[{"role": "user", "content": "2+2="}])
    # open-ended: the models are asked for samples, which a pool replaying multiple-choice records cannot give
    # (the client gets each model's name and kind of failure; the reason, which may hold internal URLs, is logged)
    with pytest.raises(
        openai.InternalServerError,
        match=r"no model of the pool answered \(smollm2-135m: error, .* in the worker's log under",
    ) as refused:
        client.chat.completions.create(
            model="rlens-focal",
            messages=[{"role": "user", "content": "2+2="}],
            extra_body={"rlens": {"reference_id": "6"}},
        )
    query_id = refused.value.body["query_id"]  # type: ignore[index]
    assert "records choice probabilities" not in str(refused.value)
    logged = [
        line
        for path in gw["stack"].workdir.glob("worker-*.log")
        for line in path.read_text().splitlines()
        if query_id in line and "no model answered" in line
    ]
    assert len(logged) == 1 and "records choice probabilities, not samples" in logged[0]


def test_each_request_has_one_access_log_line_that_never_holds_the_prompt(gw):
    """Issue 56: one JSON line per request on ``rlens.gateway.access``: route, status, latency, the key and its
    tenant, the query and its cost; an unauthorised request gets its line too."""
    import time

    answered = ask(gw, "acme", question=11, stream="acme-logs")
    assert answered.status_code == 200
    query_id, cost = answered.json()["id"], answered.json()["rlens"]["cost"]
    refused = httpx.get(f"{gw['url']}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert refused.status_code == 401
    log = gw["stack"].workdir / "gateway.log"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        access = [r for r in records if r.get("logger") == "rlens.gateway.access"]
        mine = [r for r in access if r.get("query_id") == query_id]
        if mine and any(r["status"] == 401 for r in access):
            break
        time.sleep(0.2)
    assert len(mine) == 1, mine
    line = mine[0]
    assert (line["route"], line["method"], line["status"], line["tenant"]) == (
        "/v1/chat/completions",
        "POST",
        200,
        "acme",
    )
    assert line["key_id"] == gw["keys"]["acme"].split("_")[1] and line["cost"] == pytest.approx(cost)
    assert line["latency_ms"] > 0 and line["client"] == "127.0.0.1"
    assert "question 11" not in log.read_text()  # the prompt is never logged


@pytest.mark.kafka
def test_feedback_is_checked_against_its_query_applied_once_and_joined_by_the_learner(gw):
    answer = ask(gw, question=7, stream="fb").json()
    url = f"{gw['url']}/v1/feedback"
    assert httpx.post(url, json={"id": answer["id"], "label": 9}, headers=auth(gw)).status_code == 400  # 4 options
    # not open-ended
    assert httpx.post(url, json={"id": answer["id"], "reference": "B"}, headers=auth(gw)).status_code == 400
    infinite = b'{"id": "%s", "reward": Infinity}' % answer["id"].encode()
    assert (
        httpx.post(url, content=infinite, headers={**auth(gw), "Content-Type": "application/json"}).status_code == 400
    )
    assert httpx.post(url, json={"id": answer["id"], "reward": 2.0}, headers=auth(gw)).status_code == 400
    assert httpx.post(url, json={"id": answer["id"]}, headers=auth(gw)).status_code == 400
    unknown = httpx.post(url, json={"id": "rl-unknown", "label": 1}, headers=auth(gw))
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "query_not_found"
    first = httpx.post(url, json={"id": answer["id"], "label": 2}, headers=auth(gw))
    again = httpx.post(url, json={"id": answer["id"], "label": 2}, headers=auth(gw))
    assert (first.status_code, first.json()["status"]) == (202, "accepted") and (
        again.status_code,
        again.json()["status"],
    ) == (200, "duplicate")
    learner = role_url(gw, "learner")
    deadline = time.monotonic() + 60
    while metric(learner, "rlens_learner_joined_total", stream="@local/fb") < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # a second application would show by now
    assert metric(learner, "rlens_learner_joined_total", stream="@local/fb") == 1.0
    assert metric(gw["url"], "rlens_gateway_feedback_total", outcome="accepted") >= 1


def test_keys_streams_tenants_sizes_and_rates_are_enforced(gw, tmp_path):
    assert ask(gw).status_code == 200
    no_key = httpx.get(f"{gw['url']}/v1/models")
    assert no_key.status_code == 401 and no_key.headers["www-authenticate"] == "Bearer"
    wrong = gw["keys"]["local"][:-2] + "zz"
    assert httpx.get(f"{gw['url']}/v1/models", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
    forbidden = ask(gw, "acme", stream="other-team")
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "stream_not_allowed"
    assert ask(gw, "acme", stream="acme-eu").status_code == 200
    # the header wins
    assert ask(gw, headers={"X-Rlens-Stream": "acme-eu"}, stream="x").json()["rlens"]["stream"] == "acme-eu"
    # the workers saw the tenant's key: the window is local's "acme-eu", not acme's (nor an application's)
    answer = read_answers(gw["stack"].settings, ask(gw, question=7, stream="acme-eu").json()["id"])
    assert answer.stream == "@local/acme-eu"
    big = httpx.post(
        f"{gw['url']}/v1/chat/completions",
        content=b"{" + b" " * 1_100_000 + b"}",
        headers={**auth(gw), "Content-Type": "application/json"},
    )
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    malformed = httpx.post(
        f"{gw['url']}/v1/chat/completions",
        content=b'{"model": "rlens-focal",, }',
        headers={**auth(gw), "Content-Type": "application/json"},
    )
    error = malformed.json()["error"]
    assert malformed.status_code == 400 and error["code"] == "invalid_json" and error.get("param") is None
    assert error["message"].startswith("the body is not valid JSON (at character 24"), error
    long_prompt = httpx.post(
        f"{gw['url']}/v1/completions",
        json={"model": "rlens-focal", "prompt": "x" * 1001, "rlens": {"choices": CHOICES}},
        headers=auth(gw),
    )
    assert long_prompt.status_code == 413 and long_prompt.json()["error"]["code"] == "prompt_too_long"
    # another tenant can neither read nor rate this tenant's answer, and trying changes nothing
    mine = ask(gw, question=11, stream="iso").json()["id"]
    assert httpx.get(f"{gw['url']}/v1/answers/{mine}", headers=auth(gw, "other")).status_code == 404
    assert (
        httpx.post(f"{gw['url']}/v1/feedback", json={"id": mine, "label": 0}, headers=auth(gw, "other")).status_code
        == 404
    )
    assert httpx.get(f"{gw['url']}/v1/answers/{mine}", headers=auth(gw)).json()["id"] == mine
    assert (
        httpx.post(f"{gw['url']}/v1/feedback", json={"id": mine, "label": 0}, headers=auth(gw)).json()["status"]
        == "accepted"
    )
    # the slow key: a burst of 2, then 429 with Retry-After
    codes = [ask(gw, "slow", question=i) for i in range(3)]
    assert [c.status_code for c in codes] == [200, 200, 429]
    assert int(codes[2].headers["retry-after"]) >= 1 and codes[2].json()["error"]["type"] == "rate_limit_error"


@pytest.mark.kafka
def test_an_idempotent_retry_gets_the_same_answer_without_asking_twice(gw):
    worker = role_url(gw, "worker")
    key = {"Idempotency-Key": f"order-{time.time()}"}
    first, retry = ask(gw, question=20, stream="idem", headers=key), ask(gw, question=20, stream="idem", headers=key)
    assert first.status_code == retry.status_code == 200 and first.json()["id"] == retry.json()["id"]
    assert first.json()["choices"] == retry.json()["choices"]
    assert metric(worker, "rlens_worker_queries_total", stream="@local/idem") == 1.0  # the models were asked once
    reused = ask(gw, question=21, stream="idem", headers=key)
    assert reused.status_code == 409 and reused.json()["error"]["query_id"] == first.json()["id"]
    # the same request as other bytes (spaced, keys in another order) is the same request (issue 54)
    body = {
        "rlens": {"reference_id": "20", "choices": CHOICES},
        "metadata": {"stream": "idem"},
        "messages": [{"content": "question 20", "role": "user"}],
        "model": "rlens-focal",
    }
    spaced = httpx.post(
        f"{gw['url']}/v1/chat/completions",
        content=json.dumps(body, indent=3).encode(),
        headers={**auth(gw), **key, "Content-Type": "application/json"},
        timeout=60,
    )
    assert spaced.status_code == 200 and spaced.json()["id"] == first.json()["id"], spaced.text
    # another key of the tenant that may not use the first request's stream is not told its id (issue 60)
    acme = {"Idempotency-Key": f"acme-{time.time()}"}
    assert ask(gw, "acme", question=22, stream="acme-us", headers=acme).status_code == 200
    other = ask(gw, "acme-eu", question=23, stream="acme-eu", headers=acme)
    assert other.status_code == 409 and "query_id" not in other.json()["error"], other.text


def test_a_key_sees_only_its_streams_a_retry_names_its_stream_and_a_broken_keys_file_keeps_the_keys(gw):
    # a key limited to acme-eu cannot read or rate its tenant's answers on another stream
    theirs = ask(gw, "acme", question=12, stream="acme-us").json()["id"]
    assert httpx.get(f"{gw['url']}/v1/answers/{theirs}", headers=auth(gw, "acme-eu")).status_code == 404
    refused = httpx.post(f"{gw['url']}/v1/feedback", json={"id": theirs, "label": 0}, headers=auth(gw, "acme-eu"))
    assert refused.status_code == 404
    assert httpx.get(f"{gw['url']}/v1/answers/{theirs}", headers=auth(gw, "acme")).status_code == 200
    # the same Idempotency-Key and body naming another stream in the header is another request
    key = {"Idempotency-Key": f"stream-{time.time()}"}
    assert ask(gw, question=13, stream="idem-a", headers=key).status_code == 200
    moved = ask(gw, question=13, stream="idem-a", headers={**key, "X-Rlens-Stream": "idem-b"})
    assert moved.status_code == 409 and moved.json()["error"]["code"] == "idempotency_key_reused"
    # a half-written keys file: the gateway keeps the keys it had, and says so in its log
    path = gw["stack"].workdir / "keys.json"
    good = path.read_bytes()
    try:
        path.write_bytes(good[: len(good) // 2])
        assert ask(gw, question=14, stream="keys").status_code == 200
        assert ask(gw, "acme", question=15, stream="acme-x").status_code == 200
    finally:
        path.write_bytes(good)
    log = (gw["stack"].workdir / "gateway.log").read_text()
    assert "is not a valid keys file" in log and "keeping the 9 keys read before" in log


def read_topic(settings_, topic: str, model, done, timeout_s: float = 30) -> list:
    """The messages of ``topic`` from its start, parsed as ``model``, read until ``done(found, last_read)`` (or
    ``timeout_s``)."""

    async def run() -> list:
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=settings_.kafka.bootstrap, group_id=None, auto_offset_reset="earliest"
        )
        await consumer.start()
        found: list = []
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                batches = await consumer.getmany(timeout_ms=1000)
                found += [model.model_validate_json(r.value) for records in batches.values() for r in records]
                if done(found, batches):
                    break
        finally:
            await consumer.stop()
        return found

    return asyncio.run(run())


def read_queries(settings_, after: set[str]) -> list[Query]:
    """Queries on the queries topic whose ids are not in ``after``, once some arrive."""
    fresh = lambda found: [q for q in found if q.query_id not in after]  # noqa: E731
    return fresh(read_topic(settings_, Topics.from_settings(settings_).queries, Query, lambda f, _: fresh(f)))


def all_query_ids(settings_) -> set[str]:
    """The ids on the queries topic now (read until a read finds nothing more)."""
    queries = read_topic(settings_, Topics.from_settings(settings_).queries, Query, lambda _, last: not last)
    return {q.query_id for q in queries}


def read_answers(settings_, query_id: str) -> Answer:
    """The answer of ``query_id`` on the shared answers topic."""
    mine = lambda found: [a for a in found if a.query_id == query_id]  # noqa: E731
    answers = mine(read_topic(settings_, Topics.from_settings(settings_).answers, Answer, lambda f, _: mine(f)))
    assert answers, f"no answer of {query_id} on the answers topic"
    return answers[0]


@pytest.mark.kafka
def test_a_stalled_worker_gives_504_with_the_query_id_503_when_full_and_the_late_answer_is_kept(gw):
    worker = gw["stack"].workers[0]
    worker.send_signal(signal.SIGSTOP)
    try:
        results: list[httpx.Response] = []
        threads = [
            threading.Thread(target=lambda i=i: results.append(ask(gw, question=30 + i, stream="stall")))
            for i in range(MAX_WAITING)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while metric(gw["url"], "rlens_gateway_waiting") < MAX_WAITING and time.monotonic() < deadline:
            time.sleep(0.1)
        full = ask(gw, question=40, stream="stall")
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        for t in threads:
            t.join(60)
        assert sorted(r.status_code for r in results) == [504] * MAX_WAITING
        late = results[0].json()["error"]
        assert late["code"] == "answer_timeout" and f"/v1/answers/{late['query_id']}" in late["message"]
        pending = httpx.get(f"{gw['url']}/v1/answers/{late['query_id']}", headers=auth(gw))
        assert pending.status_code == 202 and pending.json() == {"id": late["query_id"], "status": "pending"}
    finally:
        worker.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 60
    while (
        fetched := httpx.get(f"{gw['url']}/v1/answers/{late['query_id']}", headers=auth(gw))
    ).status_code == 202 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (
        fetched.status_code == 200
        and fetched.json()["id"] == late["query_id"]
        and fetched.json()["choices"][0]["message"]["content"] in CHOICES
    )


@pytest.mark.kafka
def test_a_forged_reply_never_answers_a_client(gw):
    stack, worker = gw["stack"], gw["stack"].workers[0]
    before = all_query_ids(stack.settings)
    worker.send_signal(signal.SIGSTOP)
    try:
        result: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: result.append(ask(gw, question=50, stream="forge")))
        thread.start()
        query = read_queries(stack.settings, before)[0]
        forged = Answer(
            query_id=query.query_id,
            stream=query.stream,
            answer="D",
            answer_index=3,
            distribution=[0, 0, 0, 1],
            chosen_models=["x"],
            answered_models=["x"],
            called_models=["x"],
            policy_version=0,
            latency_ms=1,
            worker="attacker",
            feedback_token="0" * 32,
        )
        # an empty answer (no model answered, no token) with the attacker's text: it used to fail the request (502)
        empty = forged.model_copy(
            update={"answer": "", "answer_index": -1, "distribution": [], "answered_models": [], "feedback_token": ""}
        )
        empty = empty.model_copy(
            update={"failures": [ModelFailureRecord(model="x", reason="attacker's text")], "signature": "0" * 64}
        )

        async def send() -> None:
            producer = AIOKafkaProducer(bootstrap_servers=stack.settings.kafka.bootstrap)
            await producer.start()
            try:
                for fake in (empty, forged):
                    await producer.send_and_wait(
                        query.reply_to, fake.model_dump_json().encode(), key=query.query_id.encode()
                    )
            finally:
                await producer.stop()

        asyncio.run(send())
        deadline = time.monotonic() + 30
        while metric(gw["url"], "rlens_gateway_replies_total", outcome="forged") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        worker.send_signal(signal.SIGCONT)
    thread.join(60)
    assert query.reply_to == Topics.from_settings(stack.settings).replies("test-gw")
    assert result[0].status_code == 200 and result[0].json()["rlens"]["worker"] != "attacker"
    assert metric(gw["url"], "rlens_gateway_replies_total", outcome="forged") == 2.0
    served = httpx.get(f"{gw['url']}/v1/answers/{query.query_id}", headers=auth(gw)).json()
    assert served["rlens"]["worker"] != "attacker" and not served["rlens"]["failures"]
    # the shared answers topic carries the gateway query's answer without its feedback token (it went to the
    # gateway alone): no application reading `answers` can rate a gateway tenant's answer
    shared = read_answers(stack.settings, query.query_id)
    assert shared.answered_models and shared.feedback_token == ""


@pytest.mark.kafka
def test_a_query_replying_outside_the_reply_topics_is_dead_lettered(gw):
    """A reply topic must be a live gateway's: neither another topic nor a made-up name under the reply prefix
    (thirty of those used to make thirty topics)."""
    settings_ = gw["stack"].settings
    topics = Topics.from_settings(settings_)
    hijack = Query(
        query_id="hijack-1", stream="s", prompt="p", choices=CHOICES, reference_id="1", reply_to=topics.policy
    )
    spam = [
        hijack.model_copy(update={"query_id": f"spam-{i}", "reply_to": topics.replies(f"spam-{i}")}) for i in range(5)
    ]
    # an application on Kafka asking on a gateway tenant's stream key (it used to move that tenant's windows)
    intruders = [
        hijack.model_copy(update={"query_id": f"intruder-{i}", "stream": "@acme/acme-eu", "reply_to": None, **extra})
        for i, extra in enumerate([{}, {"signature": "0" * 64}])
    ]
    spam += intruders
    keys = {base64.b64encode(q.query_id.encode()).decode(): q.query_id for q in [hijack, *spam]}

    async def run() -> tuple[dict, list, set]:
        producer = AIOKafkaProducer(bootstrap_servers=settings_.kafka.bootstrap)
        await producer.start()
        for query in [hijack, *spam]:
            await producer.send_and_wait(topics.queries, query.model_dump_json().encode(), key=query.query_id.encode())
        await producer.stop()
        consumer = AIOKafkaConsumer(
            topics.dead_letter,
            topics.policy,
            bootstrap_servers=settings_.kafka.bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
        )
        await consumer.start()
        letters, policies = {}, []
        deadline = time.monotonic() + 60
        try:
            while len(letters) < len(keys) and time.monotonic() < deadline:
                for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                    values = [json.loads(r.value) for r in records]
                    if tp.topic == topics.dead_letter:
                        letters.update({keys[v["key_b64"]]: v["reason"] for v in values if v["key_b64"] in keys})
                    else:
                        policies += [v for v in values if v.get("query_id") == "hijack-1"]
            existing = await consumer.topics()
        finally:
            await consumer.stop()
        return letters, policies, existing

    letters, policies, existing = asyncio.run(run())
    assert letters["hijack-1"].startswith(f"reply_to {topics.policy!r} is not a reply topic") and not policies
    for query in spam:
        if query in intruders:
            assert "is a gateway tenant's, and no gateway signed this query" in letters[query.query_id], letters
            continue
        assert "is no live gateway's reply topic" in letters[query.query_id], letters
        assert query.reply_to not in existing
    assert topics.replies("test-gw") in existing


def test_prompts_never_reach_the_logs(gw):
    marker = f"confidential-{time.time_ns()}"
    assert ask(gw, question=2, stream="private", messages=[{"role": "user", "content": marker}]).status_code == 200
    assert ask(gw, "acme", stream="not-allowed", messages=[{"role": "user", "content": marker}]).status_code == 403
    # a lone surrogate (valid JSON, invalid Unicode) is refused with a 400 that names the field, never a 500
    for body in (
        b'{"model": "rlens-focal", "messages": [{"role": "user", "content": "%s \\ud800 x"}]}' % marker.encode(),
        b'{"model": "rlens-focal", "prompt": "%s \\udfff", "rlens": {"choices": ["a", "b"]}}' % marker.encode(),
        b'{"model": "rlens-focal", "prompt": "%s", "rlens": {"choices": ["\\ud800", "b"]}}' % marker.encode(),
    ):
        route = "chat/completions" if b"messages" in body else "completions"
        refused = httpx.post(
            f"{gw['url']}/v1/{route}", content=body, headers={**auth(gw), "Content-Type": "application/json"}
        )
        assert refused.status_code == 400 and "lone surrogate" in refused.json()["error"]["message"], refused.text
    time.sleep(1.0)
    logs = {path.name: path.read_text(errors="replace") for path in gw["stack"].workdir.glob("*.log")}
    assert "gateway.log" in logs and not [name for name, text in logs.items() if marker in text]


def test_the_published_openapi_document_is_current():
    assert json.loads(OPENAPI_FILE.read_text()) == openapi_document(), (
        "regenerate it: python -m rlens.service.gateway.app"
    )


@pytest.fixture(scope="module")
def api_schema(gw):
    return schemathesis.openapi.from_url(f"{gw['url']}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@hsettings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_get_documented_answers_and_never_an_internal_error(case, gw):
    response = case.call_and_validate(
        headers=auth(gw),
        checks=[status_code_conformance, content_type_conformance, response_schema_conformance],
        timeout=60,
    )
    assert response.status_code != 500


def test_each_process_of_the_stack_gets_only_its_own_secrets(gw):
    """The policy signing key is the learner's alone: a worker or the gateway that leaks its environment cannot
    sign a policy."""
    stack = gw["stack"]
    environments = {}
    for process in stack.processes():
        raw = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        role = process.args[3]
        environments[role] = {k.decode() for k, _, _ in (item.partition(b"=") for item in raw) if k}
    assert set(environments) == {"learner", "worker", "gateway"}
    assert "RLENS_POLICY_SIGNING_KEY" in environments["learner"]
    assert "RLENS_POLICY_SIGNING_KEY" not in environments["worker"] | environments["gateway"]
    assert all("RLENS_FEEDBACK_SECRET" in env for env in environments.values())


def test_a_slow_body_guessed_keys_and_rapid_reads_are_limited(gw):
    host, port = gw["url"].removeprefix("http://").split(":")
    # headers and one byte of a 100-byte body: 408 once the body timeout has passed, not a connection held open
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        started = time.monotonic()
        status_line = conn.recv(4096).split(b"\r\n")[0]
        assert b" 408 " in status_line and time.monotonic() - started < 30, status_line
    # an address that keeps guessing keys gets 429 after its burst (20, refilled at 5/s); a valid key from it is
    # still served. The guesses go at once, so a busy machine's slowness cannot refill the bucket between them.

    async def guesses() -> tuple[list[int], float]:
        async with httpx.AsyncClient(timeout=60) as client:
            started = time.monotonic()
            responses = await asyncio.gather(
                *(
                    client.get(f"{gw['url']}/v1/models", headers={"Authorization": f"Bearer rlk_guess{i:03d}_x"})
                    for i in range(100)
                )
            )
            return [r.status_code for r in responses], time.monotonic() - started

    codes, elapsed = asyncio.run(guesses())
    assert set(codes) == {401, 429} and codes.count(401) <= 20 + 5 * elapsed + 1, (codes.count(401), elapsed)
    assert httpx.get(f"{gw['url']}/v1/models", headers=auth(gw)).status_code == 200
    # reading answers takes from the key's rate like asking does
    reads = [httpx.get(f"{gw['url']}/v1/answers/rl-none", headers=auth(gw, "slow")).status_code for _ in range(4)]
    assert set(reads) <= {404, 429} and 429 in reads, reads  # a burst of 2 (less if earlier tests used it)


def test_metrics_and_the_dashboard_need_the_admin_token_and_probes_do_not(gw):
    """They list every tenant's stream names; the probes tell nothing."""
    learner = role_url(gw, "learner")
    guarded = [f"{u}/metrics" for u in gw["urls"].values()] + [f"{learner}/dashboard", f"{learner}/api/dashboard"]
    for url in guarded:
        refused = httpx.get(url, headers=auth(gw), timeout=10)  # a tenant's API key is no admin token
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic"), url
        assert httpx.get(url, headers=ADMIN, timeout=10).status_code == 200, url
        assert httpx.get(url, auth=("anyone", ADMIN_TOKEN), timeout=10).status_code == 200, url  # a browser's way
    for url in gw["urls"].values():
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("command, variable", [("worker", "RLENS_METRICS_HOST"), ("gateway", "RLENS_GATEWAY_HOST")])
def test_monitoring_beyond_loopback_needs_the_admin_token(tmp_path, command, variable):
    env = {k: v for k, v in os.environ.items() if k != "RLENS_ADMIN_TOKEN"}
    result = subprocess.run(
        [sys.executable, "-m", "rlens.cli", command],
        env={**env, variable: "0.0.0.0", "RLENS_GATEWAY_KEYS": "[]", "RLENS_FEEDBACK_SECRET": "x" * 32},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "set RLENS_ADMIN_TOKEN" in lines[0], lines


@hsettings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    field=st.sampled_from(["content", "stream", "choice", "model", "metadata_key"]),
    text=st.text(st.characters(codec=None, categories=["Cs", "Lo", "So", "Zs"]), min_size=1, max_size=20),
)
def test_malformed_unicode_in_any_field_is_a_4xx_never_a_500(gw, field, text):
    body = {
        "model": "rlens-focal",
        "messages": [{"role": "user", "content": "question 1"}],
        "rlens": {"choices": CHOICES, "reference_id": "1"},
        "metadata": {"stream": "unicode"},
    }
    if field == "content":
        body["messages"][0]["content"] = text
    elif field == "stream":
        body["metadata"]["stream"] = text
    elif field == "choice":
        body["rlens"]["choices"] = [text, *CHOICES[1:]]
    elif field == "model":
        body["model"] = text
    else:
        body["metadata"] = {text: "x", "stream": "unicode"}
    response = httpx.post(
        f"{gw['url']}/v1/chat/completions",
        content=json.dumps(body, ensure_ascii=True).encode(),  # lone surrogates as \\udXXX escapes: valid JSON
        headers={**auth(gw), "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code < 500, response.text


@pytest.mark.kafka
def test_kafka_attacks_of_round_three_do_no_harm(gw):
    """Issue 60, from outside the processes with a plain Kafka client: (1) a gateway query's id asked again on
    another stream is dead-lettered, never answered (its token would rate the tenant's query); (2) FastStream's
    ``reply_to`` header makes no subscriber write anywhere; (3) a record header without a value or not UTF-8
    dead-letters its own record only, on queries, feedback and a gateway's reply topic, and the valid queries
    around it are answered once."""
    settings_ = gw["stack"].settings
    topics = Topics.from_settings(settings_)
    victim = ask(gw, question=60, stream="victim")
    assert victim.status_code == 200
    victim_id = victim.json()["id"]
    hijack_topic = f"{settings_.kafka.topic_prefix}hijack-by-header"
    stolen = Query(query_id=victim_id, stream="evil", prompt="p", choices=CHOICES, reference_id="60")
    valid = [
        Query(query_id=f"hdr-ok-{i}", stream="headers", prompt="p", choices=CHOICES, reference_id=str(61 + i))
        for i in range(8)
    ]
    bad_headers = {"hdr-null": [("x-note", None)], "hdr-latin": [("x-note", b"\xff\xfe caf\xe9")]}
    bad = [valid[0].model_copy(update={"query_id": qid}) for qid in bad_headers]
    rpc = valid[0].model_copy(update={"query_id": "hdr-rpc", "reference_id": "70"})

    async def attack() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=settings_.kafka.bootstrap)
        await producer.start()
        try:
            send = producer.send_and_wait
            await send(topics.queries, stolen.model_dump_json().encode(), key=victim_id.encode())
            for query in bad:
                await send(topics.queries, query.model_dump_json().encode(), headers=bad_headers[query.query_id])
            await send(topics.queries, rpc.model_dump_json().encode(), headers=[("reply_to", hijack_topic.encode())])
            for query in valid:
                await send(topics.queries, query.model_dump_json().encode(), key=query.query_id.encode())
            feedback = json.dumps({"query_id": "hdr-ok-0", "token": "0" * 64, "label": 0}).encode()
            await send(topics.feedback, feedback, headers=[("reply_to", hijack_topic.encode()), ("x", None)])
            await send(topics.replies("test-gw"), b"{}", headers=[("x-note", b"\xc3\x28")])
        finally:
            await producer.stop()

    asyncio.run(attack())
    # a client's request after the bad record on its gateway's reply topic is still answered
    after = ask(gw, question=71, stream="headers")
    assert after.status_code == 200, after.text

    wanted = {victim_id, "hdr-null", "hdr-latin"}

    async def read_back() -> tuple[dict, dict, set]:
        consumer = AIOKafkaConsumer(
            topics.dead_letter,
            topics.answers,
            bootstrap_servers=settings_.kafka.bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
        )
        await consumer.start()
        letters: dict[str, list[str]] = {}
        answers: dict[str, list[dict]] = {}
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline and not (
                wanted <= set(letters)
                and all(len(answers.get(q.query_id, [])) for q in [*valid, rpc])
                and any("header" in r for r in letters.get("", []))
            ):
                for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                    for r in records:
                        value = json.loads(r.value)
                        if tp.topic == topics.dead_letter:
                            key = base64.b64decode(value["key_b64"]).decode() if value["key_b64"] else ""
                            if not key and value["topic"] == topics.queries:
                                key = json.loads(base64.b64decode(value["value_b64"]))["query_id"]
                            letters.setdefault(key, []).append(value["reason"])
                        else:
                            answers.setdefault(value["query_id"], []).append(value)
            existing = await consumer.topics()
        finally:
            await consumer.stop()
        return letters, answers, existing

    letters, answers, existing = asyncio.run(read_back())
    assert any("belongs to another stream" in r for r in letters[victim_id]), letters.get(victim_id)
    assert all(a["stream"] != "evil" for a in answers.get(victim_id, []))  # never answered on the attacker's stream
    assert all(a["feedback_token"] == "" for a in answers.get(victim_id, []))
    assert any("has no value" in r for r in letters["hdr-null"]) and any("not UTF-8" in r for r in letters["hdr-latin"])
    assert all(len(r) < 400 for reasons in letters.values() for r in reasons)  # a bounded excerpt
    assert all(len(answers.get(q.query_id, [])) == 1 for q in [*valid, rpc]), {
        q.query_id: len(answers.get(q.query_id, [])) for q in valid
    }
    assert hijack_topic not in existing  # no reply to FastStream's reply_to header, from the worker or the learner
    assert any("has no value" in r for r in letters.get("", [])) or any(
        "header" in r for rs in letters.values() for r in rs
    )
    assert metric(gw["url"], "rlens_gateway_replies_total", outcome="unreadable") >= 1


def test_slow_headers_hold_a_bounded_share_of_the_gateway(gw):
    """Issue 60: 130 connections from one address (127.0.0.2) that send a request line and one header and then
    nothing: the address's cap refuses 30 of them at once (503, closed), the rest are closed with a 408 once the
    header timeout has passed, and meanwhile a client on another address (127.0.0.1) is answered."""
    host, port = httpx.URL(gw["url"]).host, httpx.URL(gw["url"]).port

    async def slowloris() -> tuple[list[bytes], int]:
        async def one() -> bytes:
            reader, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
            await writer.drain()
            try:
                return await asyncio.wait_for(reader.read(200), HEADER_TIMEOUT_S * 10)
            finally:
                writer.close()

        held = [asyncio.create_task(one()) for _ in range(PER_ADDRESS + 30)]
        await asyncio.sleep(0.5)
        answered = await asyncio.to_thread(ask, gw, question=80, stream="slow-headers")
        return list(await asyncio.gather(*held)), answered.status_code

    replies, status = asyncio.run(slowloris())
    assert status == 200
    statuses = Counter(r.split(b" ", 2)[1] if r.startswith(b"HTTP/1.1 ") else r[:20] for r in replies)
    assert statuses == {b"503": 30, b"408": PER_ADDRESS}, statuses
