"""Fuzz the running service: 10,000 messages on each of ``queries``, ``feedback``, ``experience`` and ``policy``,
then record-header attacks (issue 60: a header without a value or not UTF-8 on every topic, FastStream's ``reply_to``
header on queries and feedback, valid queries between them).

    python -m bench.robustness.poison [--per-topic 10000] [--seed 0] [--kafka HOST:PORT [--restart-kafka]]
        [--out bench/out/poison.json]

Half of each topic's messages are random bytes (0-2,000 of them), half are schema-shaped messages with extreme
values: a valid message of the topic with one field replaced by NaN, infinity, 1e300, 50,000, an empty or
100,001-character string, a list of the wrong length, a forged token, a forged signature, a signed policy of NaNs
(signed by an attacker's key), ... Every feedback and policy message here is bad; a query is valid when it parses
(and neither replies to an unregistered topic nor names a tenant's stream); an experience that parses and fits the pool (a mutation can leave one well formed) is held for its
feedback and dead-lettered only when it expires (``RLENS_PENDING_TTL_S``), so it is counted apart. The stack (tansu, redis-server, 1 learner, 1 worker, replay backends) gets them all,
then 200 legitimate queries with feedback, after their streams' Redis windows got rows that do not parse (deep nesting,
huge numbers, wrong types) and the broker was restarted empty (memory storage; nobody makes the topics again by
hand; on Apache Kafka, ``--kafka``, the broker is restarted empty only with ``--restart-kafka``: one that
``infra/kafka/kafka.sh start PORT`` started, stopped with its data deleted and started again on its port). Among the queries: 30 that reply to topics no gateway registered and 30 on a gateway tenant's stream key
without a gateway's signature, all to be dead-lettered (and no topic made). Reported: whether every process is alive, every valid query answered
exactly once, every bad message dead-lettered (per topic), the reasons' kinds, the seconds from the first message
sent to the last dead letter read, and whether the learner learned from the legitimate traffic afterwards.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.common.machine import machine_facts
from bench.common.stacks import replay_stack
from bench.common.args import add_out, arguments, write_json
from bench.common.stacks import learner_joined, uniform_experience
from rlens.records.dataset import load_dataset
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.messages import Answer, DeadLetter, Experience, Feedback, Query
from rlens.service.common.kafka import Topics
from rlens.local.servers import LocalBroker
from rlens.local.load import play, queries_of
from rlens.service.learner.online import FocalOnlineTrainer
from rlens.service.common.policy import encode_policy
from rlens.service.common.security import PolicySigner, generate_secrets
from rlens.local.stack import LocalStack
from rlens.settings import settings

REPLY_PREFIX = Topics.from_settings(settings()).reply_prefix
EXTREMES = [
    float("nan"),
    float("inf"),
    float("-inf"),
    1e300,
    -1e300,
    50_000,
    -1,
    2**63,
    "",
    "x" * 100_001,
    None,
    [],
    [1] * 70,
    {"a": 1},
    True,
]


def mutate(rng: np.random.Generator, good: dict) -> bytes:
    """``good`` with one to three fields replaced by extreme values (as JSON, NaN and infinities as literals)."""
    message = dict(good)
    for field in rng.choice(list(good), size=int(rng.integers(1, 4)), replace=False):
        message[str(field)] = EXTREMES[int(rng.integers(len(EXTREMES)))]
    return json.dumps(message).encode()


def random_bytes(rng: np.random.Generator) -> bytes:
    return rng.bytes(int(rng.integers(0, 2000)))


def payloads(n: int, seed: int, zoo) -> dict[str, list[bytes]]:
    rng = np.random.default_rng(seed)
    experience = uniform_experience().model_dump(mode="json")
    query = Query(query_id="q", stream="s", prompt="p", choices=["a", "b", "c", "d"], reference_id="0").model_dump(
        mode="json"
    )
    feedback = Feedback(query_id="q", token="0" * 64, label=1).model_dump(mode="json")
    attacker = PolicySigner(generate_secrets()["RLENS_POLICY_SIGNING_KEY"])
    engine = FocalEngine(5, seed=0)  # the pool's shapes, weights from no checkpoint
    state = engine.policy_state()
    policies = [
        encode_policy(state, 2**62, 2**40, zoo.model_names, "rl_focal", attacker),
        encode_policy(
            {k: v.fill_(math.nan) for k, v in engine.policy_state().items()},
            3,
            2**40,
            zoo.model_names,
            "rl_focal",
            attacker,
        ),
    ]
    small_policy = {**policies[0].model_dump(mode="json"), "weights_b64": "AAAA"}  # mutated ones stay small on the wire
    out: dict[str, list[bytes]] = {}
    for topic, good in (
        ("queries", query),
        ("feedback", feedback),
        ("experience", experience),
        ("policy", small_policy),
    ):
        messages = []
        for i in range(n):
            if i % 2:
                messages.append(random_bytes(rng))
            else:
                message = json.loads(mutate(rng, good))
                if "query_id" in message and isinstance(message["query_id"], str) and message["query_id"]:
                    message["query_id"] = f"fuzz-{topic}-{i}"  # distinct ids: each valid query is answered once
                messages.append(json.dumps(message).encode())
        out[topic] = messages
    out["policy"][: len(policies)] = [p.model_dump_json().encode() for p in policies]
    # schema-valid, forged
    out["feedback"][0] = Feedback(query_id="fuzz-0", token="f" * 64, reward=-1).model_dump_json().encode()
    # schema-valid queries that must not be answered: replies to topics no gateway registered (each would have made
    # a topic), and a gateway tenant's stream key without a gateway's signature (it would move the tenant's window)
    spam = Query.model_validate(query)
    out["queries"] += [
        spam.model_copy(update={"query_id": f"spam-{i}", "reply_to": f"{REPLY_PREFIX}spam-{i}"})
        .model_dump_json()
        .encode()
        for i in range(30)
    ] + [
        spam.model_copy(update={"query_id": f"tenant-{i}", "stream": "@acme/support"}).model_dump_json().encode()
        for i in range(30)
    ]
    return out


def poisoned_rows(window_size: int) -> list[bytes]:
    """Window rows written into Redis by hand: deep nesting (json.loads raises RecursionError), huge numbers, wrong
    types; each stream's window must skip them and keep serving (a nested row used to block its stream for a week)."""
    return [
        b"[" * 1000 + b"]" * 1000,
        b"[1," + b"9" * 400 + b",1,1,1,1,1]",
        b"[true,1.0,1,1,1,1,1]",
        b'{"label": 1}',
        b"[1,1e999,1,1,1,1,1]",
    ] * max(1, window_size // 50)


def fits_the_pool(payload: bytes, trainer) -> bool:
    try:
        return trainer.check(Experience.model_validate_json(payload)) is None
    except ValueError:
        return False


def valid_query(payload: bytes) -> str | None:
    """The id of a query the service must answer: it parses, replies to no unregistered topic and is on no gateway
    tenant's stream (an open-ended one is answered too: over the models' samples, here with every model failing,
    since the replay pool has recorded choices, not texts)."""
    try:
        query = Query.model_validate_json(payload)
    except ValueError:
        return None
    answerable = query.reply_to is None and not query.stream.startswith("@")
    return query.query_id if answerable else None


async def flood(stack: LocalStack, sent: dict[str, list[bytes]], valid: set[str], held: int, timeout_s: float) -> dict:
    topics, prefix = Topics.from_settings(stack.settings), stack.settings.kafka.topic_prefix
    names = {
        "queries": topics.queries,
        "feedback": topics.feedback,
        "experience": topics.experience,
        "policy": topics.policy,
    }
    producer = AIOKafkaProducer(
        bootstrap_servers=stack.settings.kafka.bootstrap, linger_ms=20, max_request_size=16 * 2**20
    )
    consumer = AIOKafkaConsumer(
        topics.dead_letter,
        topics.answers,
        bootstrap_servers=stack.settings.kafka.bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
        max_partition_fetch_bytes=16 * 2**20,
    )
    await producer.start()
    await consumer.start()
    started = time.perf_counter()
    refused: Counter[str] = Counter()  # messages the broker did not take (they cannot be dead-lettered)
    for topic, messages in sent.items():
        deliveries = [await producer.send(names[topic], payload) for payload in messages]
        results = await asyncio.gather(*deliveries, return_exceptions=True)
        refused[names[topic]] = sum(isinstance(r, BaseException) for r in results)
    expected = {
        names[t]: len(m) - {"queries": len(valid), "experience": held}.get(t, 0) - refused[names[t]]
        for t, m in sent.items()
    }
    dead: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    last = time.perf_counter()
    while time.perf_counter() - last < timeout_s and (
        any(dead[t] < n for t, n in expected.items()) or len(answers) < len(valid)
    ):
        for tp, records in (await consumer.getmany(timeout_ms=500)).items():
            last = time.perf_counter()
            for record in records:
                if tp.topic == topics.answers:
                    answers[Answer.model_validate_json(record.value).query_id] += 1
                else:
                    letter = DeadLetter.model_validate_json(record.value)
                    dead[letter.topic] += 1
                    reasons[f"{letter.topic.removeprefix(prefix)}: {letter.reason.split(':')[0][:60]}"] += 1
    elapsed = last - started
    await asyncio.sleep(2.0)  # late duplicates, if any
    for records in (await consumer.getmany(timeout_ms=1000)).values():
        for record in records:
            if record.topic == topics.answers:
                answers[Answer.model_validate_json(record.value).query_id] += 1
    await consumer.stop()
    await producer.stop()
    return {
        "sent": {t: len(m) for t, m in sent.items()},
        "valid_queries": len(valid),
        "well_formed_experience_held": held,
        "valid_answered_once": sum(answers[q] == 1 for q in valid),
        "valid_answered_twice_or_more": sum(answers[q] > 1 for q in valid),
        "dead_lettered": {t.removeprefix(prefix): dead[t] for t in expected},
        "expected_dead_letters": {t.removeprefix(prefix): n for t, n in expected.items()},
        "refused_by_the_broker": {t.removeprefix(prefix): n for t, n in refused.items()},
        "seconds": round(elapsed, 1),
        "reasons": dict(reasons.most_common(25)),
    }


async def poison_windows(stack: LocalStack, streams: set[str]) -> None:
    from redis.asyncio import Redis

    from rlens.service.common.windows import RedisWindows

    redis = Redis.from_url(stack.settings.redis.url.get_secret_value())
    windows = RedisWindows(redis, 5, FocalConfig.window, stack.settings.redis.prefix)
    for stream in streams:
        await redis.rpush(windows.window_key(stream), *poisoned_rows(FocalConfig.window))
    await redis.aclose()


async def spam_topics(stack: LocalStack) -> int:
    """Topics named by the spam queries' reply_to (none may exist)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.settings.kafka.bootstrap)
    await consumer.start()
    try:
        return sum(t.startswith(f"{REPLY_PREFIX}spam-") for t in await consumer.topics())
    finally:
        await consumer.stop()


async def readable(stack: LocalStack) -> dict[str, int]:
    """Records of ``experience`` and ``feedback`` that a plain consumer (no group) reads from their start now: what
    the broker serves, beside what the learner joined."""
    topics = Topics.from_settings(stack.settings)
    counts = {}
    for topic in (topics.experience, topics.feedback):
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=stack.settings.kafka.bootstrap, group_id=None, auto_offset_reset="earliest"
        )
        await consumer.start()
        try:
            n, quiet = 0, 0
            while quiet < 4:
                got = sum(len(records) for records in (await consumer.getmany(timeout_ms=500)).values())
                n, quiet = n + got, 0 if got else quiet + 1
            counts[topic.removeprefix(stack.settings.kafka.topic_prefix)] = n
        finally:
            await consumer.stop()
    return counts


HEADER_ATTACKS = 50  # records per topic and kind of bad header


async def header_attacks(stack: LocalStack, zoo, timeout_s: float) -> dict:
    """Issue 60's record-header attacks: on queries, feedback, experience and policy, records whose header has no
    value or is not UTF-8 (each must be dead-lettered alone), FastStream's ``reply_to`` header on queries and
    feedback (no subscriber may write to the topic it names), and valid queries between them (each answered
    once)."""
    topics, prefix = Topics.from_settings(stack.settings), stack.settings.kafka.topic_prefix
    names = [topics.queries, topics.feedback, topics.experience, topics.policy]
    hijack = f"{stack.settings.kafka.topic_prefix}hijacked-by-header"
    bad = [("x-note", None), ("x-note", b"\xff\xfe caf\xe9")]
    valid = [q for q, _ in queries_of(zoo.subset(list(range(100))), None, "headers")]
    producer = AIOKafkaProducer(bootstrap_servers=stack.settings.kafka.bootstrap, linger_ms=5)
    await producer.start()
    sends = []
    for topic in names:
        for i in range(HEADER_ATTACKS):
            for j, header in enumerate(bad):
                payload = valid[i].model_copy(update={"query_id": f"hdr-{j}-{i}"}).model_dump_json().encode()
                sends.append(await producer.send(topic, payload, headers=[header]))
    for i, query in enumerate(valid):
        headers = [("reply_to", hijack.encode())] if i % 2 else []
        sends.append(await producer.send(topics.queries, query.model_dump_json().encode(), headers=headers))
        feedback = Feedback(query_id=query.query_id, token="0" * 64, label=0).model_dump_json().encode()
        sends.append(await producer.send(topics.feedback, feedback, headers=[("reply_to", hijack.encode())]))
    await asyncio.gather(*sends)
    await producer.stop()
    expected = {t: 2 * HEADER_ATTACKS for t in names}
    consumer = AIOKafkaConsumer(
        topics.dead_letter,
        topics.answers,
        bootstrap_servers=stack.settings.kafka.bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=16 * 2**20,
    )
    await consumer.start()
    dead: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    started = time.perf_counter()
    ids = {q.query_id for q in valid}
    while time.perf_counter() - started < timeout_s and (
        any(dead[t] < n for t, n in expected.items()) or len(answers) < len(valid)
    ):
        for tp, records in (await consumer.getmany(timeout_ms=500)).items():
            for record in records:
                if tp.topic == topics.answers:
                    query_id = Answer.model_validate_json(record.value).query_id
                    answers[query_id] += query_id in ids
                else:
                    letter = DeadLetter.model_validate_json(record.value)
                    dead[letter.topic] += "record header" in letter.reason
    made = hijack in await consumer.topics()
    await consumer.stop()
    return {
        "bad_header_records": {t.removeprefix(prefix): n for t, n in expected.items()},
        "dead_lettered_for_their_header": {t.removeprefix(prefix): dead[t] for t in expected},
        "valid_queries": len(valid),
        "valid_answered_once": sum(answers[q] == 1 for q in ids),
        "valid_answered_twice_or_more": sum(answers[q] > 1 for q in ids),
        "topic_made_by_a_reply_to_header": made,
    }


def restart_kafka_empty(bootstrap: str) -> None:
    """Stop the Apache Kafka ``infra/kafka/kafka.sh`` started (its data deleted) and start it again on its port."""
    script = Path(__file__).resolve().parents[2] / "infra" / "kafka" / "kafka.sh"
    port = bootstrap.rsplit(":", 1)[1]
    subprocess.run([str(script), "stop"], check=True)
    subprocess.run([str(script), "start", port], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--per-topic", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kafka", default=None, help="bootstrap of an Apache Kafka broker to run on (default: tansu)")
    parser.add_argument(
        "--restart-kafka",
        action="store_true",
        help="restart the --kafka broker empty before the legitimate traffic (one infra/kafka/kafka.sh started; "
        "its data is deleted)",
    )
    add_out(parser, "bench/out/poison.json")
    args = parser.parse_args()
    if args.restart_kafka and not args.kafka:
        parser.error("--restart-kafka restarts the broker --kafka names: give --kafka too")
    print(f"machine: {machine_facts()}", flush=True)
    zoo = load_dataset(settings().service.demo_data)
    sent = payloads(args.per_topic, args.seed, zoo)
    valid = {qid for qid in map(valid_query, sent["queries"]) if qid}
    trainer = FocalOnlineTrainer(FocalEngine(zoo.n_models, seed=0), zoo.model_names)
    held = sum(fits_the_pool(p, trainer) for p in sent["experience"])
    stack = replay_stack(args.out.parent / "poison-stack", kafka=args.kafka)
    try:
        stack.start_learner()
        stack.start_worker()
        stack.wait_ready(120)
        result = asyncio.run(flood(stack, sent, valid, held, timeout_s=120))
        result["headers"] = asyncio.run(header_attacks(stack, zoo, timeout_s=120))
        after_traffic = queries_of(zoo.subset(list(range(200))), None, "after")
        asyncio.run(poison_windows(stack, {q.stream for q, _ in after_traffic}))
        # a broker restarted empty (memory storage) between the flood and the legitimate traffic: nobody makes the
        # topics again by hand
        if stack.broker is not None:
            port = stack.broker.port
            stack.broker.stop()
            stack.broker = LocalBroker(port)
        elif args.restart_kafka:
            restart_kafka_empty(args.kafka)
        result["broker_restarted_empty"] = stack.broker is not None or args.restart_kafka
        learner = next(u for name, u in stack.http_urls().items() if name.startswith("learner"))
        joined_before = learner_joined(learner)
        after = asyncio.run(play(stack.settings, after_traffic, rate=50, idle_timeout_s=90))
        answered_at = time.monotonic()
        while learner_joined(learner) < joined_before + after.answered and time.monotonic() - answered_at < 180:
            time.sleep(0.5)  # the learner catches up: awaited, not assumed
        result["learner_caught_up_s"] = round(time.monotonic() - answered_at, 1)
        result["readable_after"] = asyncio.run(readable(stack))
        time.sleep(3.0)
        result["topics_made_by_reply_to"] = asyncio.run(spam_topics(stack))
        result["alive"] = all(p.poll() is None for p in stack.processes())
        result["after"] = {
            "answered": after.answered,
            "of": 200,
            "duplicates": after.duplicates,
            "accuracy": round(after.accuracy, 3),
            "policy_versions": sorted(after.policy_versions),
        }
    finally:
        stack.stop()
    state = json.loads(
        (
            stack.settings.learner.checkpoint_dir
            / (stack.settings.learner.checkpoint_dir / "LATEST").read_text()
            / "state.json"
        ).read_text()
    )
    result["learner"] = {
        k: state["stats"][k]
        for k in (
            "joined",
            "updates",
            "forged_feedback",
            "invalid_experience",
            "failed_records",
            "rejected_updates",
            "new_logs",
        )
    }
    write_json(args.out, result, show=True)


if __name__ == "__main__":
    main()
