"""What exactly-once would cost: a bare consume → produce loop with and without Kafka transactions.

    python -m bench.service.transactions --kafka 127.0.0.1:19092 [--queries 3000] [--reps 2] [--batch 32]

Exactly-once for the worker means its answers, its experience and its consumer offsets in one Kafka transaction
per batch, and readers that see only committed records. Its floor is what a transaction per batch costs a loop
that does nothing else: N query-sized messages pre-filled in a topic, read in batches of ``--batch`` and answered
one message each, (a) with an idempotent ``acks=all`` producer and the offsets committed after the batch's sends
are confirmed (at-least-once, as the worker does), (b) with a transactional producer, each batch's sends and
offsets in one transaction, the consumer reading committed records only. Alternated ``--reps`` times on fresh
topics; messages/s from the first record read to the last one done. Needs Apache Kafka (tansu has no
transactions).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import machine_facts
from bench.common.stacks import cycled
from bench.service.stack import prefill
from rlens.records.dataset import load_dataset
from rlens.local.load import queries_of
from rlens.settings import settings

REPLY_BYTES = 700  # an Answer of the bundled stream is about this many bytes


async def pipe(bootstrap: str, source: str, sink: str, n: int, batch: int, transactional: bool) -> float:
    """Messages/s of one consume → produce loop over the ``n`` messages of ``source``."""
    group = f"tx-bench-{uuid.uuid4().hex[:8]}"
    consumer = AIOKafkaConsumer(
        source,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_records=batch,
        fetch_max_wait_ms=20,
        isolation_level="read_committed" if transactional else "read_uncommitted",
    )
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        linger_ms=2,
        acks="all",
        enable_idempotence=True,
        transactional_id=group if transactional else None,
    )
    await consumer.start()
    await producer.start()
    reply, done, start = b"x" * REPLY_BYTES, 0, None
    try:
        while done < n:
            for tp, records in (await consumer.getmany(timeout_ms=200, max_records=batch)).items():
                start = start or time.perf_counter()
                offsets = {TopicPartition(tp.topic, tp.partition): records[-1].offset + 1}
                if transactional:
                    async with producer.transaction():
                        for r in records:
                            await producer.send(sink, reply, key=r.key)
                        await producer.send_offsets_to_transaction(offsets, group)
                else:
                    await asyncio.gather(*[await producer.send(sink, reply, key=r.key) for r in records])
                    await consumer.commit(offsets)
                done += len(records)
    finally:
        await consumer.stop()
        await producer.stop()
    assert start is not None
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--kafka", required=True, help="bootstrap of an Apache Kafka broker")
    parser.add_argument("--queries", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=2, help="alternations of the two loops")
    parser.add_argument("--batch", type=int, default=settings().worker.batch, help="records per batch (the worker's)")
    add_out(parser, "bench/out/transactions.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    stream = queries_of(load_dataset(settings().service.demo_data), None, "tx")
    payloads = [q.model_dump_json().encode() for q, _ in cycled(stream, "tx", args.queries)]
    rates: dict[str, list[float]] = {"at_least_once": [], "transactional": []}
    for rep in range(args.reps):
        for mode in rates:
            prefix = f"txbench{uuid.uuid4().hex[:8]}"
            asyncio.run(prefill(args.kafka, f"{prefix}.in", payloads))
            rate = asyncio.run(
                pipe(args.kafka, f"{prefix}.in", f"{prefix}.out", len(payloads), args.batch, mode == "transactional")
            )
            rates[mode].append(rate)
            print(f"rep {rep}, {mode}: {rate:.0f} msgs/s", flush=True)
    ratio = sum(rates["transactional"]) / sum(rates["at_least_once"])
    print(f"transactional / at-least-once: {ratio:.3f}")
    write_json(args.out, {"kafka": args.kafka, "queries": args.queries, "batch": args.batch, **rates, "ratio": ratio})


if __name__ == "__main__":
    main()
