"""Faults on a real Apache Kafka cluster (3 brokers on loopback, replication 3, min.insync.replicas 2, idempotent
producers, acks=all): one broker killed with SIGKILL in the middle of a load through the gateway, a worker and the
learner killed likewise while it is down (a new worker and the learner started again on its checkpoints before it
comes back), then the broker restarted on its data. No query lost, none answered twice to a client, every feedback
joined exactly once.

Runs in CI's Kafka phase (``RLENS_TEST_KAFKA_BOOTSTRAP`` set: Java, Maven and the broker's jars are there); it
starts a cluster of its own with ``infra/kafka/kafka.sh cluster``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from brokers import EXTERNAL
from rlens.local.load import queries_of
from rlens.local.stack import LocalStack, write_replay_pool
from rlens.ports import port_taken
from rlens.settings import settings

ROOT = Path(__file__).resolve().parent.parent
KAFKA = ROOT / "infra" / "kafka" / "kafka.sh"
pytestmark = [
    pytest.mark.kafka,
    pytest.mark.skipif(
        EXTERNAL is None, reason="a real Kafka cluster: runs with RLENS_TEST_KAFKA_BOOTSTRAP set (CI's Kafka phase)"
    ),
]
RATE = 20.0  # requests per second through the gateway
DURATION_S = 60.0  # the load; a broker is killed at a third of it and restarted at two thirds
KILLS_S = (2.0, 4.0, 8.0)  # after the broker's kill: a worker killed, the learner killed, both started again


def free_base() -> int:
    """A port p with p, p+1, p+10, p+11, p+20 and p+21 free (three brokers and their controllers)."""
    for base in range(21000, 40000, 97):
        if not any(port_taken(base + offset) for offset in (0, 1, 10, 11, 20, 21)):
            return base
    raise RuntimeError("no free ports for a three-broker cluster")


@pytest.fixture()
def cluster(tmp_path):
    env = {**os.environ, "RLENS_KAFKA_RUN": str(tmp_path / "kafka")}

    def kafka(*args: str) -> str:
        result = subprocess.run(["bash", str(KAFKA), *args], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout.strip()

    bootstrap = kafka("cluster", str(free_base()))
    try:
        yield bootstrap, kafka
    finally:
        kafka("stop")


def request_body(query) -> dict:
    return {
        "model": "rlens-focal",
        "messages": [{"role": "user", "content": query.prompt}],
        "rlens": {"choices": query.choices, "reference_id": query.reference_id},
        "metadata": {"stream": query.stream},
    }


async def ask_and_rate(url: str, key: str, queries: list, stop_at: float) -> dict:
    """The load: each query once per 1/RATE s, retried with its Idempotency-Key until it is answered (a 503 or 504
    while a broker fails over), then its feedback (retried likewise). What each request got, by question."""
    answers: dict[str, list[str]] = {}
    feedback: dict[str, int] = {}
    refused: list[int] = []  # the status of every attempt that was not answered (a failover's 503s and 504s)
    headers = {"Authorization": f"Bearer {key}"}

    async def one(client: httpx.AsyncClient, i: int, query, label: int) -> None:
        body = request_body(query)
        while time.monotonic() < stop_at + 120:
            try:
                r = await client.post(
                    f"{url}/v1/chat/completions", json=body, headers={**headers, "Idempotency-Key": f"q{i}"}
                )
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
                continue
            if r.status_code == 200:
                answers.setdefault(str(i), []).append(r.json()["id"])
                break
            assert r.status_code in (502, 503, 504), r.text
            refused.append(r.status_code)
            await asyncio.sleep(0.5)
        query_id = answers.get(str(i), [None])[0]
        while query_id is not None and time.monotonic() < stop_at + 120:
            try:
                f = await client.post(f"{url}/v1/feedback", json={"id": query_id, "label": label}, headers=headers)
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
                continue
            if f.status_code in (200, 202):
                feedback[str(i)] = f.status_code
                break
            await asyncio.sleep(0.5)

    async with httpx.AsyncClient(timeout=60) as client:
        tasks, sent_at = [], []
        started = time.monotonic()
        for i, (query, label) in enumerate(queries):
            await asyncio.sleep(max(0.0, started + i / RATE - time.monotonic()))
            if time.monotonic() > stop_at:
                break
            sent_at.append(time.monotonic())
            tasks.append(asyncio.create_task(one(client, i, query, label)))
        await asyncio.gather(*tasks)
    return {"sent": len(tasks), "sent_at": sent_at, "answers": answers, "feedback": feedback, "refused": refused}


async def ask_again(url: str, key: str, queries: list, which: list[str]) -> dict[str, str]:
    """Every tenth request sent again with its Idempotency-Key: the id of the answer each gets (the first one's, if
    no query was made twice)."""
    again = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for i in which:
            query, _ = queries[int(i)]
            r = await client.post(
                f"{url}/v1/chat/completions",
                json=request_body(query),
                headers={"Authorization": f"Bearer {key}", "Idempotency-Key": f"q{i}"},
            )
            assert r.status_code == 200, r.text
            again[i] = r.json()["id"]
    return again


def learner_state(stack: LocalStack) -> dict:
    directory = stack.settings.learner.checkpoint_dir
    return json.loads((directory / (directory / "LATEST").read_text() / "state.json").read_text())


def checkpointed_joins(stack: LocalStack) -> int:
    """The transitions joined as of the learner's newest checkpoint (0 before its first)."""
    try:
        return learner_state(stack)["stats"]["joined"]
    except (OSError, ValueError, KeyError):  # none yet, or one being written
        return 0


def test_a_broker_a_worker_and_the_learner_killed_under_load_lose_no_query_and_no_feedback(cluster, tmp_path, zoo):
    bootstrap, kafka = cluster
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    pool = write_replay_pool(settings().service.demo_data, tmp_path / "pool.json")
    config = settings().updated(
        {
            "pool_file": pool,
            "kafka_replication": 3,
            "kafka_idempotence": True,
            "kafka_acks": "all",
            "kafka_session_timeout_ms": 6000,
            "kafka_heartbeat_ms": 1000,
            "gateway_port": 0,
            "gateway_id": "cluster-gw",
            "gateway_timeout_s": 20.0,
            "checkpoint_every_s": 5.0,  # the learner killed has checkpoints to resume from
        }
    )
    stack = LocalStack(config, tmp_path / "stack", 4, bootstrap)
    try:
        stack.start_service(workers=2, gateway=True)
        url = next(u for name, u in stack.http_urls().items() if name.startswith("gateway:"))
        assert stack.gateway_key is not None
        key = stack.gateway_key.read_text().strip()
        queries = queries_of(zoo, None, "cluster")
        stop_at = time.monotonic() + DURATION_S
        events: dict[str, float] = {}

        async def load_with_a_failover() -> dict:
            load = asyncio.create_task(ask_and_rate(url, key, queries, stop_at))
            await asyncio.sleep(DURATION_S / 3)
            events["broker killed"] = time.monotonic()
            await asyncio.to_thread(kafka, "kill", "2")
            worker_killed, learner_killed, restarted = KILLS_S
            await asyncio.sleep(worker_killed)
            stack.kill(stack.workers[0])
            await asyncio.sleep(learner_killed - worker_killed)
            assert stack.learner is not None
            stack.kill(stack.learner)
            await asyncio.sleep(restarted - learner_killed)
            stack.start_learner()
            stack.start_worker()
            await asyncio.sleep(DURATION_S / 3 - restarted)
            events["broker restarted"] = time.monotonic()
            await asyncio.to_thread(kafka, "restart", "2")
            return await load

        played = asyncio.run(load_with_a_failover())
        sent, answers, feedback = played["sent"], played["answers"], played["feedback"]
        replayed = asyncio.run(ask_again(url, key, queries, sorted(answers, key=int)[::10]))
        deadline = time.monotonic() + 180  # the learner started again, caught up and took a checkpoint
        while time.monotonic() < deadline and checkpointed_joins(stack) < len(feedback):
            time.sleep(1.0)
    finally:
        stack.stop()
    state = learner_state(stack)["stats"]
    print(  # BENCHMARKS.md's figures (pytest -s)
        f"{sent} requests (a broker, a worker and the learner killed), {len(answers)} answered, {len(played['refused'])} attempts refused and retried "
        f"({sorted(set(played['refused']))}), {len(feedback)} feedback, {state['joined']} joined"
    )
    # under load throughout the failover, however fast this machine sends: requests before the broker's kill and
    # while it was away (when the worker and the learner were killed too)
    killed, restarted = events["broker killed"], events["broker restarted"]
    assert any(t < killed for t in played["sent_at"]) and any(killed < t < restarted for t in played["sent_at"])
    assert len(answers) == sent, f"{sent - len(answers)} of {sent} queries never answered"  # none lost
    assert replayed and all(answers[i] == [query_id] for i, query_id in replayed.items())  # never a second answer
    assert len(feedback) == sent and state["joined"] == sent, (len(feedback), state["joined"], sent)
    assert state["invalid_feedback"] == 0 and state["forged_feedback"] == 0
    assert "resumed from checkpoint" in (stack.workdir / "learner.log").read_text()  # not a cold start
