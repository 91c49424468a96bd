"""The units the worker's and the learner's apps are made of, each alone: which queries a batch admits, the learner's
offset bookkeeping, its window writer (a real redis-server), its drift watch and its offset commits, the consumer
lag, and which trace exporters a process sets up."""

import asyncio
import time
from types import SimpleNamespace

import pytest
from aiokafka.structs import TopicPartition
from redis.asyncio import Redis

from rlens.backends import create_backend
from rlens.drift import DriftConfig, DriftMonitor
from rlens.focal.engine import FocalEngine
from rlens.messages import Query
from rlens.service.common import kafka
from rlens.service.common.kafka import Topics
from rlens.service.common.windows import RedisWindows
from rlens.service.learner import batches
from rlens.service.learner.batches import Commits, RecordBatches
from rlens.service.learner.dashboard import Dashboard
from rlens.service.learner.drift_watch import DriftWatch
from rlens.service.learner.offsets import Offsets
from rlens.service.learner.window_writer import APPLY_BATCH, WindowWriter
from rlens.service.worker.batches import admit
from rlens.service.worker.core import FocalWorker
from rlens.settings import Settings
from trust import TOKENS, VERIFIER


def record(offset: int, value: bytes, topic: str = "rlens.queries", partition: int = 0):
    return SimpleNamespace(topic=topic, partition=partition, offset=offset, key=b"k", value=value, timestamp=None)


def query(qid: str, **fields) -> bytes:
    return (
        Query(query_id=qid, stream=fields.pop("stream", "s"), prompt="p", choices=["a", "b"], **fields)
        .model_dump_json()
        .encode()
    )


def test_admit_sorts_a_batch_into_queries_and_dead_letters_with_reasons(zoo):
    backends = {name: create_backend("replay", dataset=zoo, model=i) for i, name in enumerate(zoo.model_names)}
    worker = FocalWorker(FocalEngine(5, seed=0), zoo.model_names, backends, None, VERIFIER, TOKENS)
    topics = Topics.from_settings(Settings(_env_file=None))
    tenant = "@acme/support"
    signed = TOKENS.query_signature("q6", tenant)
    records = [
        record(0, query("q1")),
        record(1, b"not json"),
        record(2, query("q3", reply_to="elsewhere")),
        record(3, query("q4", reply_to=topics.replies("gw-0"))),
        record(4, query("q1")),  # the id again
        record(5, query("q5", stream=tenant)),  # a tenant's stream, unsigned
        record(6, query("q6", stream=tenant, signature=signed)),
    ]
    batch = admit(records, worker, topics, "worker w")
    assert [q.query_id for q in batch.queries] == ["q1", "q4", "q6"]
    assert sorted(batch.records) == ["q1", "q4", "q6"] and batch.records["q1"] is records[0]
    reasons = {letter.offset: letter.reason for letter in batch.dead}
    assert sorted(reasons) == [1, 2, 4, 5]
    assert reasons[1].startswith("invalid JSON")
    assert "is not a reply topic" in reasons[2]
    assert reasons[4] == "query id q1 appears twice in one batch"
    assert "no gateway signed this query" in reasons[5]
    assert all(letter.consumer == "worker w" for letter in batch.dead)


def test_offsets_tell_redeliveries_new_logs_and_what_may_be_committed():
    offsets = Offsets()
    feedback = [record(o, b"", topic="rlens.feedback") for o in range(3)]
    assert [offsets.already_seen(r) for r in feedback] == [False, False, False]
    assert offsets.read == {"rlens.feedback:0": 3} and offsets.moved()
    assert offsets.to_commit("rlens.feedback") == {}  # nothing is committed past a checkpoint
    offsets.checkpointed_now()
    assert not offsets.moved()
    assert offsets.to_commit("rlens.feedback") == {TopicPartition("rlens.feedback", 0): 3}
    assert offsets.to_commit("rlens.experience") == {}
    assert offsets.already_seen(feedback[1])  # a redelivery after a restart
    assert offsets.below([feedback[2], record(7, b"", topic="rlens.feedback", partition=1)]) == {"rlens.feedback:0"}
    offsets.new_logs({"rlens.feedback:0": 1})  # the partition now ends at 1, below the 3 reached: read it anew
    assert offsets.read["rlens.feedback:0"] == 0 and offsets.checkpointed["rlens.feedback:0"] == 0
    assert not offsets.already_seen(feedback[0])
    resumed = Offsets({"rlens.feedback:0": 5})
    assert resumed.checkpointed == {"rlens.feedback:0": 5} and not resumed.moved()


def test_the_window_writer_applies_in_order_once_per_query_and_keeps_a_backlog_while_redis_is_down(redis_server):
    async def scenario():
        redis = Redis.from_url(redis_server.url)
        await redis.flushdb()
        writer = WindowWriter(RedisWindows(redis, 2, 8), redis_wait_s=0.0, backlog_limit=3)
        assert not writer.queue("s", "q1", ([0, 1], 0), 1.0)
        writer.queue("s", "q2", ([1, -1], 1), 0.5)
        writer.queue("s", "q2", ([1, -1], 1), 0.5)  # a redelivered join: applied once
        writer.queue("s", "q3", ([0, 0, 0], 1), 1.0)  # a row no window of 2 models can hold: dropped, not blocking
        done = await writer.apply()
        assert done.windows_applied == 2 and not writer.backlog
        window = (await writer.windows.load(["s"]))["s"]
        assert window.n_rows == 2

        down = WindowWriter(
            RedisWindows(Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2), 2, 8),
            redis_wait_s=0.0,
            backlog_limit=3,
        )
        for i in range(5):
            down.queue("s", f"d{i}", ([0, 0], 0), 1.0)
        done = await down.apply()
        assert done.redis_retries == 1 and done.window_backlog_dropped == 2
        assert [row[1] for row in down.backlog] == ["d2", "d3", "d4"]  # the oldest went first
        assert (await down.apply()).redis_retries == 0  # no new try before the pause is over
        await redis.aclose()

    asyncio.run(scenario())
    assert APPLY_BATCH == 256


def test_the_drift_watch_reports_a_step_change_once_and_trims_the_window(redis_server):
    async def scenario():
        redis = Redis.from_url(redis_server.url)
        await redis.flushdb()
        windows = RedisWindows(redis, 2, 64)
        await windows.apply_many([["s", f"q{i}", [0, 0], 0, 1.0] for i in range(30)])
        watch = DriftWatch(DriftMonitor(DriftConfig(delta=0.05, min_gap=20)), 5, Dashboard("rl_focal", ["a", "b"]))
        detected = [watch.observe("s", {"outcome": 1.0 if i < 200 else 0.0}, f"q{i}") for i in range(400)]
        first = detected.index(True)
        assert 200 < first < 260  # found after the change, not before it
        events = watch.take_events()
        assert events and events[0].stream == "s" and events[0].signal == "outcome" and events[0].mean_after < 0.5
        assert watch.take_events() == []
        assert await watch.react("s", windows)
        assert (await windows.load(["s"]))["s"].n_rows == 5
        assert watch.to_json() and DriftWatch(None, None, watch.dashboard).to_json() == []
        await redis.aclose()

    asyncio.run(scenario())


def test_a_shift_too_small_to_act_on_is_an_event_but_not_a_log_line(caplog):
    """Issue 54: the learner logged "drift" for a confidence moving 0.94 -> 0.95. A detection whose means moved less
    than LOGGED_SHIFT is published and counted; only larger ones are logged."""
    import logging

    from rlens.service.learner.drift_watch import LOGGED_SHIFT

    def run(low: float, high: float) -> tuple[list, list[str]]:
        watch = DriftWatch(DriftMonitor(DriftConfig(delta=0.05, min_gap=20)), None, Dashboard("rl_focal", ["a"]))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="rlens.learner"):
            for i in range(2000):  # a tiny, steady step: ADWIN finds it over enough values
                watch.observe("s", {"confidence": low if i < 1000 else high}, f"q{i}")
        return watch.take_events(), [r.getMessage() for r in caplog.records if "drift on stream" in r.getMessage()]

    events, lines = run(0.94, 0.95)
    assert events and all(abs(e.mean_after - e.mean_before) < LOGGED_SHIFT for e in events) and lines == []
    events, lines = run(0.9, 0.5)
    assert events and lines


class SlowConsumer:
    """An aiokafka consumer's commit surface: commits that never finish (a broker that refuses them)."""

    def __init__(self, hang: bool):
        self.hang, self.commits = hang, []

    def assignment(self):
        return {TopicPartition("rlens.feedback", 0)}

    async def commit(self, offsets):
        if self.hang:
            await asyncio.sleep(3600)
        self.commits.append(offsets)


class Restorer:
    def __init__(self):
        self.restored = 0

    async def restore(self):
        self.restored += 1


def test_commits_follow_checkpoints_and_give_up_on_a_broker_that_hangs(monkeypatch):
    monkeypatch.setattr(batches, "COMMIT_TIMEOUT_S", 0.2)
    core = SimpleNamespace(offsets=Offsets({"rlens.feedback:0": 7}), checkpoints=SimpleNamespace(count=1))

    async def scenario():
        restorer = Restorer()
        commits = Commits(core, restorer)
        good = SlowConsumer(hang=False)
        await commits.after_batch(good, "rlens.feedback")
        await commits.after_batch(good, "rlens.feedback")  # no new checkpoint: nothing to commit again
        assert good.commits == [{TopicPartition("rlens.feedback", 0): 7}]
        core.checkpoints.count = 2
        stuck = SlowConsumer(hang=True)
        started = time.monotonic()
        await commits.after_batch(stuck, "rlens.feedback")
        assert time.monotonic() - started < 5 and restorer.restored == 1
        assert commits.paused_until > time.monotonic()
        await commits.after_batch(good, "rlens.feedback")  # paused: not tried
        assert len(good.commits) == 1
        # past the pause, the hung commit still runs: it was never cancelled (issue 60: a learner stalled after a
        # cancelled commit), and no other is started beside it
        commits.paused_until = 0.0
        await commits.after_batch(good, "rlens.feedback")
        assert len(good.commits) == 1 and commits.pending is not None and not commits.pending.done()
        commits.pending.cancel()  # the broker answers at last (here: the test ends it)
        await asyncio.sleep(0)
        await commits.after_batch(good, "rlens.feedback")
        assert len(good.commits) == 2

    asyncio.run(scenario())


def test_topics_are_made_again_at_most_once_per_pause_each(monkeypatch):
    """Issue 60: a worker whose replies to a topic keep failing makes that topic again once per pause, not once per
    batch; a topic failing for the first time is made at once."""
    made: list[tuple[str, ...]] = []

    async def ensure(settings, partitions=None, extra=()):
        made.append(extra)

    monkeypatch.setattr(kafka, "ensure_topics", ensure)
    clock = [100.0]
    monkeypatch.setattr(kafka.time, "monotonic", lambda: clock[0])
    restorer = kafka.TopicRestorer(Settings(_env_file=None), every_s=5.0)

    async def scenario():
        for _ in range(3):  # three failing batches within the pause
            await restorer.restore(("rlens.replies.a",))
        await restorer.restore(("rlens.replies.b",))  # another gateway's topic fails now
        clock[0] += 5.0
        await restorer.restore(("rlens.replies.a",))
        await restorer.restore()

    asyncio.run(scenario())
    assert made == [("rlens.replies.a",), ("rlens.replies.b",), ("rlens.replies.a",)]


def test_a_batch_subscriber_waits_in_the_clients_poll_and_never_sleeps(monkeypatch):
    """Issue 59: a batch subscriber's poll is aiokafka's ``getmany`` with the subscriber's ``max_records`` (it
    returns as soon as records arrive), its partitions' records in one tuple; an empty poll returns at once, where
    FastStream's own slept ``batch_timeout_ms`` after it."""
    import anyio
    from faststream.kafka import KafkaBroker

    async def no_sleep(*_):
        raise AssertionError("slept after a poll")

    monkeypatch.setattr(anyio, "sleep", no_sleep)  # FastStream's
    subscriber = kafka.woken_by_records(KafkaBroker("x").subscriber("t", batch=True, max_records=7))
    polls = []

    class Consumer:
        def __init__(self, answers):
            self.answers = answers

        async def getmany(self, timeout_ms, max_records):
            polls.append((timeout_ms, max_records))
            return self.answers.pop(0)

    consumer = Consumer([{}, {TopicPartition("t", 0): ["a", "b"], TopicPartition("t", 1): ["c"]}])
    assert asyncio.run(subscriber.get_msg(consumer)) == ()
    assert asyncio.run(subscriber.get_msg(consumer)) == ("a", "b", "c")
    assert polls == [(kafka.POLL_WAIT_MS, 7)] * 2


def test_consumer_lag_adds_up_what_each_assigned_partition_holds_beyond_the_position():
    """Partition 0: end 10, position 4 (6 waiting); 1: end 3, position 3; 2: never fetched (no end known)."""
    from faststream.kafka import KafkaBroker

    ends, positions = {0: 10, 1: 3, 2: None}, {0: 4, 1: 3, 2: 0}

    class Consumer:
        def assignment(self):
            return {TopicPartition("q", p) for p in ends}

        def highwater(self, tp):
            return ends[tp.partition]

        async def position(self, tp):
            return positions[tp.partition]

        async def getmany(self, timeout_ms, max_records):
            return {}

    heard = []
    subscriber = kafka.woken_by_records(KafkaBroker("x").subscriber("q", batch=True), on_lag=heard.append)
    asyncio.run(subscriber.get_msg(Consumer()))
    assert heard == [6]


class ListingConsumer:
    """What a broker says of partition rlens.feedback:0's end: by the last fetch (high watermark) and by listing."""

    def __init__(self, fetched_end, listed_end):
        self.fetched_end, self.listed_end, self.sought = fetched_end, listed_end, []

    def highwater(self, tp):
        return self.fetched_end

    async def end_offsets(self, partitions):
        return {tp: self.listed_end for tp in partitions}

    def seek(self, tp, offset):
        self.sought.append((tp, offset))


@pytest.mark.parametrize(
    ("fetched_end", "listed_end", "new"),
    [
        (3, 2, True),  # both below the 7 read: a new log
        (None, 2, False),  # nothing fetched yet
        (None, 0, True),  # nothing fetched yet, and the broker lists an empty log: it started empty
        (9, 6, False),  # tansu lists its last producer batch's start + 1: the fetch's end is exact
        (5, 8, False),  # a new Kafka leader's high watermark lags: the listing is not below
    ],
)
def test_a_new_log_is_one_whose_fetched_and_listed_ends_are_both_below_the_offset_read(fetched_end, listed_end, new):
    for in_batch in (set(), {"rlens.feedback:0"}):  # a batch in hand holding the new log's records: no seek
        core = SimpleNamespace(offsets=Offsets({"rlens.feedback:0": 7}), found=[])
        core.new_logs = lambda ends, core=core: (core.offsets.new_logs(ends), core.found.extend(ends))
        consumer = ListingConsumer(fetched_end, listed_end)
        records = RecordBatches(core, None, (None, None, None, None), Restorer())
        asyncio.run(records.new_logs(consumer, {"rlens.feedback:0"}, in_batch))
        assert core.found == (["rlens.feedback:0"] if new else [])
        assert core.offsets.read["rlens.feedback:0"] == (0 if new else 7)
        assert consumer.sought == ([(TopicPartition("rlens.feedback", 0), 0)] if new and not in_batch else [])


@pytest.mark.parametrize("keep", [None])
def test_a_watch_without_a_monitor_detects_nothing(keep):
    watch = DriftWatch(None, keep, Dashboard("rl_focal", ["a"]))
    assert not watch.observe("s", {"outcome": 1.0}, "q")
    assert asyncio.run(watch.react("s", None)) is False


def test_a_free_port_is_drawn_below_the_kernels_ephemeral_range_and_is_free():
    """Outgoing connections take their local ports from the ephemeral range: a port chosen there and bound seconds
    later (a service's HTTP side) was once taken meanwhile. Drawn below it, whatever the module generator's seed."""
    import random
    import socket

    from rlens.ports import EPHEMERAL_RANGE, LOWEST, free_port

    state = random.getstate()
    reseeded = []
    for _ in range(3):  # the module generator seeded alike each time: its draws would repeat
        random.seed(0)
        reseeded.append(free_port())
    random.setstate(state)
    assert len(set(reseeded)) > 1
    ports = {free_port() for _ in range(20)}
    if EPHEMERAL_RANGE.is_file():
        assert all(LOWEST <= port < int(EPHEMERAL_RANGE.read_text().split()[0]) for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free


def test_a_process_without_a_broker_says_so_at_once():
    """Issue 54: no broker at the bootstrap address is said first, not "the broker refused an idempotent producer"
    and the real error 22 s later."""
    import asyncio

    from rlens.ports import free_port
    from rlens.service.common.kafka import BrokerRefused, settle_idempotence
    from rlens.settings import Settings

    nowhere = Settings().updated(kafka_bootstrap=f"127.0.0.1:{free_port()}")
    with pytest.raises(BrokerRefused, match="no Kafka broker answers at 127.0.0.1"):
        asyncio.run(settle_idempotence(nowhere))


def test_no_stack_process_outlives_the_process_that_started_it(tmp_path):
    """Issue 54: an interrupted test run left a learner, a worker, redis-servers and tansu running. A process that
    starts a broker and a Redis, then dies by SIGKILL (no cleanup runs): both end within seconds."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "from rlens.local.servers import LocalBroker, LocalRedis\n"
        "import os, sys, time\n"
        "b, r = LocalBroker(), LocalRedis()\n"
        "print(b.process.pid, r.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    children = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(children) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        state = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
        return state != "Z"  # a zombie has ended

    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children)


def test_the_stacks_own_redis_keeps_its_data_in_its_folder(tmp_path):
    """Issue 54: a second `rlens up` on the same folder has the windows of the first (its Redis keeps an append-only
    file in the work folder); one without a folder (the tests') keeps nothing."""
    import time

    from redis import Redis

    from rlens.local.servers import LocalRedis

    first = LocalRedis(data_dir=tmp_path / "redis")
    Redis.from_url(first.url).set("rlens:win:{s}", "kept")
    time.sleep(1.5)  # the append-only file is synced every second
    first.stop()
    second = LocalRedis(data_dir=tmp_path / "redis")  # another port, the same folder
    try:
        assert Redis.from_url(second.url).get("rlens:win:{s}") == b"kept"
    finally:
        second.stop()
    plain = LocalRedis()
    Redis.from_url(plain.url).set("k", "v")
    assert Redis.from_url(plain.url).config_get("hz") == {"hz": "1"}  # its timers once a second: idle, it sleeps
    port = plain.port
    plain.stop()
    again = LocalRedis(port)
    try:
        assert Redis.from_url(again.url).get("k") is None
    finally:
        again.stop()


def test_the_embedded_broker_gets_short_fetch_waits_and_a_real_kafka_kafkas_own(tmp_path):
    """Issue 59: Kafka answers a waiting fetch as soon as data comes, so its clients wait 500 ms (idle, 0.12 of a
    core for the whole stack instead of 0.32 at 20 ms; `rlens up`'s own Apache Kafka 5 s on the request path:
    test_first_hour); the embedded tansu often waits a fetch out, so `rlens up` gives its clients 20 ms on the
    request path and 250 ms off it (the learner's and the policy readers' fetches), and the clients of the stack
    read the first from client.env. A wait the user set is kept. A policy reader waits the longer of the two. Each
    consumer's fetcher looks for work besides its fetch as seldom as the fetch waits (200 ms at least)."""
    from rlens.local.servers import LocalBroker
    from rlens.local.stack import LocalStack, client_settings
    from rlens.service.common.kafka import group_options, policy_reader
    from rlens.service.learner.app import record_options
    from rlens.settings import Settings

    defaults = Settings(_env_file=None).kafka  # type: ignore[call-arg]
    assert defaults.fetch_max_wait_ms == defaults.background_fetch_max_wait_ms == 500
    for update, expected, background in (
        ({}, LocalBroker.FETCH_MAX_WAIT_MS, LocalBroker.BACKGROUND_FETCH_MAX_WAIT_MS),
        ({"kafka_fetch_max_wait_ms": 300, "kafka_background_fetch_max_wait_ms": 900}, 300, 900),
        ({"kafka_fetch_max_wait_ms": 5000, "kafka_background_fetch_max_wait_ms": 500}, 5000, 500),
    ):
        config = Settings().updated(update)
        stack = LocalStack(config, tmp_path / str(expected), partitions=1)
        try:
            assert stack.settings.kafka.fetch_max_wait_ms == expected
            env = stack.env("worker")
            assert env["RLENS_KAFKA_FETCH_MAX_WAIT_MS"] == str(expected)
            assert env["RLENS_KAFKA_BACKGROUND_FETCH_MAX_WAIT_MS"] == str(background)
            assert group_options(stack.settings)["fetch_max_wait_ms"] == expected  # the workers' and the gateway's
            assert record_options(stack.settings)["fetch_max_wait_ms"] == background  # the learner's
            # a policy reader needs neither speed nor batches: the longer wait
            assert policy_reader(stack.settings, "workers")["fetch_max_wait_ms"] == max(expected, background)
            # aiokafka's fetcher looks for work besides its fetch as seldom as the fetch waits, 200 ms at least
            assert group_options(stack.settings)["consumer_timeout_ms"] == max(expected, 200)
            assert record_options(stack.settings)["consumer_timeout_ms"] == max(background, 200)
            assert policy_reader(stack.settings, "learner")["consumer_timeout_ms"] == max(expected, background, 200)
            client = client_settings(stack.workdir)
            assert client is not None and client.kafka.fetch_max_wait_ms == expected
        finally:
            stack.stop()


def test_traces_are_set_up_by_the_otel_sdks_own_variables():
    """Which exporters a process sets up (issue 56): an OTLP endpoint (the SDK's or rlens's) turns OTLP on,
    OTEL_TRACES_EXPORTER overrides it, OTEL_SDK_DISABLED turns everything off, an unknown exporter is an error."""
    from rlens.service.common.tracing import exporters
    from rlens.settings import Settings

    plain, own = (
        Settings.model_validate({"service": {"otel_endpoint": None, "trace_dir": None}}),
        Settings.model_validate({"service": {"otel_endpoint": "http://c:4318/v1/traces", "trace_dir": "/tmp/t"}}),
    )
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert exporters(plain, {}) == []
    assert exporters(plain, endpoint) == ["otlp"]
    assert exporters(plain, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ["otlp"]
    assert exporters(plain, {**endpoint, "OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporters(plain, {"OTEL_TRACES_EXPORTER": "console"}) == ["console"]
    assert exporters(own, {}) == ["otlp", "trace_dir"]
    assert exporters(own, {"OTEL_SDK_DISABLED": "true"}) == []
    with pytest.raises(ValueError, match="unknown exporter"):
        exporters(plain, {"OTEL_TRACES_EXPORTER": "jaeger"})


def test_a_handlers_message_is_resolved_on_the_event_loop_not_in_a_thread():
    """FastStream's ``KafkaMessage`` annotation resolves the message in one of anyio's worker threads, a thread hop
    per batch; the service's handlers declare :data:`kafka.RawMessage`, resolved on the loop. (FastStream's test
    broker: what is tested is its dependency injection, not Kafka.)"""
    import threading

    from faststream.kafka import KafkaBroker, KafkaMessage, TestKafkaBroker

    def workers() -> int:
        return sum(thread.name.startswith("AnyIO worker thread") for thread in threading.enumerate())

    async def threads_after(annotation) -> tuple[int, int]:
        broker, seen = KafkaBroker(), []

        @broker.subscriber("t", **kafka.SUBSCRIBER)
        async def handler(body: bytes, message: annotation) -> None:
            seen.append(message.raw_message.value)

        before = workers()
        async with TestKafkaBroker(broker) as test:
            await test.publish(b"x", "t")
        assert seen == [b"x"]
        return before, workers()

    # fresh loops: anyio's idle worker threads belong to the loop that made them
    before, after = asyncio.run(threads_after(kafka.RawMessage))
    assert after == before
    before, after = asyncio.run(threads_after(KafkaMessage))
    assert after > before  # FastStream's own annotation: the hop this avoids


def test_the_event_loop_is_uvloop_unless_set_to_pythons_own_or_missing(monkeypatch):
    import importlib.util

    from rlens.service.run import uses_uvloop
    from rlens.settings import Settings

    assert uses_uvloop(Settings()) and uses_uvloop(Settings().updated({"event_loop": "uvloop"}))
    assert not uses_uvloop(Settings().updated({"event_loop": "asyncio"}))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "uvloop" else find_spec(name))
    assert not uses_uvloop(Settings())  # auto: Python's own where uvloop is missing
    with pytest.raises(ValueError, match="uvloop is not installed"):
        uses_uvloop(Settings().updated({"event_loop": "uvloop"}))


def test_the_http_server_ticks_once_a_second_and_a_stop_signal_wakes_it_at_once(tmp_path):
    """uvicorn's main loop woke ten times a second, idle (a bare server: 0.002 of a core); the quiet server's ticks each
    refresh the date header (a counter that is a multiple of 10), and SIGTERM ends it without waiting for the next
    tick: with a tick of an hour, only the signal can end it within the test's wait."""
    import select
    import signal
    import subprocess
    import sys

    script = tmp_path / "serve.py"
    script.write_text(
        "import sys, uvicorn\n"
        "from rlens.ports import free_port\n"
        "from rlens.service.common.http_server import QuietServer\n"
        "async def app(scope, receive, send):\n"
        "    pass\n"
        "class Counted(QuietServer):\n"
        "    async def on_tick(self, counter):\n"
        "        print('tick', counter, flush=True)\n"
        "        return await super().on_tick(counter)\n"
        "server = Counted(uvicorn.Config(app, port=free_port(), lifespan='off', log_level='warning'))\n"
        "server.tick_s = float(sys.argv[1])\n"
        "server.run()\n"
    )

    def ticks(tick_s: str, idle_s: float) -> list[int]:
        process = subprocess.Popen(
            [sys.executable, str(script), tick_s], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            assert process.stdout is not None
            assert select.select([process.stdout], [], [], 120.0)[0], "the server never ticked"
            first = process.stdout.readline()  # the first tick: the server started
            time.sleep(idle_s)
            process.send_signal(signal.SIGTERM)
            out, _ = process.communicate(timeout=60)  # a signal that did not wake the server: the timeout
        finally:
            process.kill()
        return [int(line.split()[1]) for line in (first + out).splitlines() if line.startswith("tick ")]

    counted = ticks("0.2", 1.5)
    assert len(counted) >= 2 and all(c % 10 == 0 for c in counted), counted  # uvicorn's: 0, 1, 2, … each 0.1 s
    assert ticks("3600", 0.5) in ([0], [0, 10])  # the first tick, and the one the signal woke
