"""What one query costs the broker and Redis: the bytes of each record it makes on every topic, and the Redis memory
its stream and its query take, for docs/capacity.md.

    python -m bench.service.message_sizes [--queries 400] [--streams 20] [--out bench/out/message_sizes.json]

A replay stack (tansu, its redis-server, the learner and one worker on the bundled stream's models) answers
``--queries`` queries spread over ``--streams`` stream keys, each with its feedback, at 50 queries/s. Then every
topic is read from its start: records and bytes (key + value + headers) per query, mean and p99 record size. Redis:
``MEMORY USAGE`` of every key under the stack's prefix, by kind of key (windows, calibrations, markers, ...), per
stream and per query.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import defaultdict
from pathlib import Path

from aiokafka import AIOKafkaConsumer

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import machine_facts
from bench.common.stacks import learner_joined, replay_stack
from rlens.local.load import play, queries_of
from rlens.records.dataset import load_dataset
from rlens.redis_clients import sync_redis
from rlens.service.common.kafka import Topics
from rlens.settings import settings


async def topic_bytes(bootstrap: str, topic: str) -> list[int]:
    """The size of every record ``topic`` holds (key + value + headers), read from its start."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    sizes: list[int] = []
    try:
        while True:
            batch = await consumer.getmany(timeout_ms=2000, max_records=1000)
            if not batch:
                return sizes
            for records in batch.values():
                for r in records:
                    headers = sum(len(k) + len(v or b"") for k, v in r.headers or ())
                    sizes.append(len(r.key or b"") + len(r.value or b"") + headers)
    finally:
        await consumer.stop()


def redis_kind(key: str, prefix: str) -> str:
    """A key's kind: its second part (``win``, ``applied``, ``cal``, ``fit``, ``pool``, ``owner``, ...)."""
    return key.removeprefix(prefix + ":").split(":", 1)[0]


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--streams", type=int, default=20)
    add_out(parser, "bench/out/message_sizes.json")
    args = parser.parse_args()
    stack = replay_stack(Path("bench/out/message_sizes"))
    try:
        stack.start_service(workers=1)
        data = load_dataset(settings().service.demo_data)
        traffic = queries_of(data, None, "sizes")[: args.queries]
        traffic = [(q.model_copy(update={"stream": f"s{i % args.streams}"}), o) for i, (q, o) in enumerate(traffic)]
        report = asyncio.run(play(stack.settings, traffic, rate=50, idle_timeout_s=60))
        learner = next(u for name, u in stack.http_urls().items() if name.startswith("learner:"))
        deadline = time.monotonic() + 120
        while learner_joined(learner) < report.answered and time.monotonic() < deadline:
            time.sleep(0.5)
        topics = Topics.from_settings(stack.settings)
        bootstrap = stack.settings.kafka.bootstrap
        per_topic = {}
        for name, topic in (
            ("queries", topics.queries),
            ("answers", topics.answers),
            ("experience", topics.experience),
            ("feedback", topics.feedback),
            ("policy", topics.policy),
        ):
            sizes = asyncio.run(topic_bytes(bootstrap, topic))
            per_topic[name] = {
                "records": len(sizes),
                "mean_bytes": round(statistics.fmean(sizes)) if sizes else 0,
                "p99_bytes": sorted(sizes)[int(0.99 * (len(sizes) - 1))] if sizes else 0,
                "bytes_per_query": round(sum(sizes) / max(report.answered, 1)),
            }
        redis = sync_redis(stack.settings.redis.url.get_secret_value())
        prefix = stack.settings.redis.prefix
        memory: dict[str, int] = defaultdict(int)
        count: dict[str, int] = defaultdict(int)
        for key in redis.scan_iter(f"{prefix}:*", count=1000):
            kind = redis_kind(key.decode(), prefix)
            memory[kind] += redis.memory_usage(key) or 0
            count[kind] += 1
        result = {
            "machine": machine_facts(),
            "queries": report.answered,
            "streams": args.streams,
            "topics": per_topic,
            "redis": {k: {"keys": count[k], "bytes": memory[k]} for k in sorted(memory)},
        }
    finally:
        stack.stop()
    for name, row in per_topic.items():
        print(
            f"{name:11s} {row['records']:6d} records  mean {row['mean_bytes']:7d} B  p99 {row['p99_bytes']:7d} B  "
            f"{row['bytes_per_query']:7d} B per query"
        )
    for kind, row in result["redis"].items():
        print(f"redis {kind:9s} {row['keys']:6d} keys  {row['bytes']:9d} B")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
