"""The service on the wire: a real Kafka-protocol broker (tansu), real redis-servers, learner and workers as real
processes, traffic from the load generator. End to end, kill -9 of a worker and of the learner, Redis restarted
empty, and 10,000 fuzzed malformed messages."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from rlens.dataset import load_dataset
from rlens.focal.engine import FocalEngine
from rlens.focal.schedule import run_online
from rlens.messages import DeadLetter, Feedback, Query
from rlens.service.kafka import Topics
from rlens.service.load import play, queries_of
from rlens.service.local import LocalRedis
from rlens.service.stack import LocalStack, write_replay_pool
from rlens.settings import settings

N = 600  # the first 5 task blocks of the bundled stream


@pytest.fixture(scope="module")
def zoo():
    return load_dataset(settings().demo_data)


def make_stack(tmp_path: Path, workers: int = 1, **options) -> LocalStack:
    pool = write_replay_pool(settings().demo_data, tmp_path / "pool.json")
    config = settings().model_copy(update={"pool_file": pool, "kafka_session_timeout_ms": 2000, "kafka_heartbeat_ms": 500, "worker_batch": 16})
    stack = LocalStack(config, tmp_path, **options)
    stack.start_learner()
    for _ in range(workers):
        stack.start_worker()
    stack.wait_ready(120)
    return stack


def final_learner_state(stack: LocalStack) -> dict:
    """The learner's state as its last checkpoint holds it (written at its clean shutdown)."""
    directory = stack.settings.checkpoint_dir
    return json.loads((directory / (directory / "LATEST").read_text() / "state.json").read_text())


def traffic(zoo, run: str, n: int = N):
    return queries_of(zoo.subset(list(range(n))), None, run)


def test_end_to_end_learns_as_well_as_the_offline_loop(tmp_path, zoo):
    stack = make_stack(tmp_path)
    try:
        report = asyncio.run(play(stack.settings, traffic(zoo, "e2e"), rate=60, idle_timeout_s=60))
        time.sleep(1.0)  # the last feedback reaches the learner
    finally:
        stack.stop()
    offline = run_online(FocalEngine(zoo.n_models, zoo.model_costs, seed=0), zoo.subset(list(range(N))))
    assert report.answered == N and report.duplicates == 0 and report.no_answer == 0
    assert abs(report.accuracy - offline.correct.mean()) < 0.05, (report.accuracy, offline.correct.mean())
    assert max(report.policy_versions) >= 4  # policies were learned online and hot-swapped into the worker
    state = final_learner_state(stack)
    assert state["stats"]["joined"] == N and state["stats"]["windows_applied"] == N and state["stats"]["duplicates"] == 0


def test_a_worker_killed_mid_stream_loses_no_query(tmp_path, zoo):
    stack = make_stack(tmp_path, workers=2)
    killed = []

    def kill_one(report) -> None:
        if report.answered >= N // 3 and not killed:
            killed.append(stack.workers[0])
            stack.kill(stack.workers[0])

    try:
        report = asyncio.run(play(stack.settings, traffic(zoo, "kill-worker"), rate=80, idle_timeout_s=60, on_answer=kill_one))
    finally:
        stack.stop()
    assert killed and report.answered == N  # every query answered at least once
    assert report.duplicates <= 4 * 16  # only the killed worker's in-flight batches are answered twice


def test_a_learner_killed_mid_stream_resumes_without_losing_or_repeating_a_transition(tmp_path, zoo):
    stack = make_stack(tmp_path)
    restarted = []

    def kill_learner(report) -> None:
        if report.answered >= N // 2 and not restarted:
            stack.kill(stack.learner)
            restarted.append(stack.start_learner())

    try:
        report = asyncio.run(play(stack.settings, traffic(zoo, "kill-learner"), rate=60, idle_timeout_s=60, on_answer=kill_learner))
        wait_for_checkpoint(stack, joined=N - N % 64)  # the restarted learner caught up to its last update
        time.sleep(1.0)
        markers, rows = redis_outcomes(stack)
    finally:
        stack.stop()
    assert restarted and report.answered == N
    assert final_learner_state(stack)["stats"]["joined"] == N  # no transition lost, none applied twice
    assert markers == N and rows == N  # each outcome is in the Redis windows exactly once (5 streams x 120 < W)


def redis_outcomes(stack: LocalStack) -> tuple[int, int]:
    """(applied-outcome markers, rows in all windows) in the stack's Redis."""
    from redis import Redis

    redis = Redis.from_url(stack.settings.redis_url)
    prefix = stack.settings.redis_prefix
    markers = sum(1 for _ in redis.scan_iter(f"{prefix}:applied:*", count=1000))
    rows = sum(redis.llen(key) for key in redis.scan_iter(f"{prefix}:win:*"))
    redis.close()
    return markers, rows


def wait_for_checkpoint(stack: LocalStack, joined: int, timeout_s: float = 90.0) -> None:
    """Wait for a learner checkpoint with at least ``joined`` transitions (one is written at every update)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (stack.settings.checkpoint_dir / "LATEST").is_file() and final_learner_state(stack)["stats"]["joined"] >= joined:
            return
        time.sleep(0.5)
    raise TimeoutError(f"no checkpoint with {joined} joined transitions after {timeout_s:g} s")


def test_redis_restarted_empty_keeps_the_service_answering(tmp_path, zoo):
    redis = LocalRedis()
    stack = make_stack(tmp_path, redis_url=redis.url)
    restarted = []

    def restart_redis(report) -> None:
        if report.answered >= N // 3 and not restarted:
            redis.stop()
            time.sleep(1.0)
            restarted.append(LocalRedis(redis.port))

    try:
        report = asyncio.run(play(stack.settings, traffic(zoo, "redis"), rate=60, idle_timeout_s=60, on_answer=restart_redis))
        time.sleep(1.0)
    finally:
        stack.stop()
        for server in restarted:
            server.stop()
    assert restarted and report.answered == N and report.no_answer == 0
    assert report.recent_accuracy(100) > 0.6  # the windows refilled after the restart
    stats = final_learner_state(stack)["stats"]
    assert stats["joined"] == N and stats["windows_applied"] == N  # every outcome reached the new Redis


MALFORMED = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(str.encode),
    st.dictionaries(st.text(max_size=10), st.one_of(st.none(), st.integers(), st.text(max_size=20), st.lists(st.integers(), max_size=3)), max_size=6).map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries({"query_id": st.text(max_size=5), "stream": st.text(max_size=5), "prompt": st.integers(), "choices": st.lists(st.text(max_size=3), max_size=1)}).map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries({"query_id": st.just("q"), "label": st.integers(max_value=-1)}).map(lambda d: json.dumps(d).encode()),
)


def fuzzed_payloads(n: int) -> list[bytes]:
    payloads: list[bytes] = []

    @hsettings(max_examples=n, database=None, derandomize=True, suppress_health_check=list(HealthCheck), deadline=None)
    @given(MALFORMED)
    def collect(payload: bytes) -> None:
        payloads.append(payload)

    collect()
    return payloads


def is_valid(model, payload: bytes) -> bool:
    try:
        return model is not Query or model.model_validate_json(payload).choices is not None
    except ValueError:
        return False


def test_ten_thousand_fuzzed_messages_go_to_the_dead_letter_topic(tmp_path, zoo):
    payloads = fuzzed_payloads(10_000)
    assert len(payloads) >= 9_000
    stack = make_stack(tmp_path)
    topics = Topics.from_settings(stack.settings)
    to_queries = [p for p in payloads[::2] if not is_valid(Query, p)]
    to_feedback = [p for p in payloads[1::2] if not is_valid(Feedback, p)]

    async def scenario():
        producer = AIOKafkaProducer(bootstrap_servers=stack.settings.kafka_bootstrap, linger_ms=20)
        await producer.start()
        for payload in to_queries:
            await producer.send(topics.queries, payload)
        for payload in to_feedback:
            await producer.send(topics.feedback, payload)
        await producer.flush()
        report = await play(stack.settings, traffic(zoo, "fuzz", 200), rate=100, idle_timeout_s=90)
        await producer.stop()
        consumer = AIOKafkaConsumer(topics.dead_letter, bootstrap_servers=stack.settings.kafka_bootstrap, group_id=None, auto_offset_reset="earliest")
        await consumer.start()
        dead: list[DeadLetter] = []
        deadline = time.time() + 90
        while time.time() < deadline and len(dead) < len(to_queries) + len(to_feedback):
            for records in (await consumer.getmany(timeout_ms=500)).values():
                dead += [DeadLetter.model_validate_json(r.value) for r in records]
        await consumer.stop()
        return report, dead

    try:
        report, dead = asyncio.run(scenario())
        alive = all(p.poll() is None for p in stack.processes())
    finally:
        stack.stop()
    assert alive  # no crash
    assert report.answered == 200 and report.duplicates == 0  # valid traffic unaffected
    for topic, sent, consumer in ((topics.queries, to_queries, "worker"), (topics.feedback, to_feedback, "learner")):
        letters = [d for d in dead if d.topic == topic]
        assert sorted(base64.b64decode(d.value_b64) for d in letters) == sorted(sent)  # each one, byte for byte
        assert all(d.reason and d.consumer.startswith(consumer) for d in letters)
