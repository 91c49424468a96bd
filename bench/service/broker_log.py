"""Does the local broker (tansu, memory storage) slow down as one topic's log grows?

    python -m bench.service.broker_log [--records 600000] [--every 50000] [--partitions 1 4] [--max-batch-bytes 1048576]

For each partition count: a fresh broker and one topic; records of 600 bytes are written round robin over the
partitions (the producer packs them into batches of at most ``--max-batch-bytes``). After every ``--every``
records, 2,000 more are produced and then read by a consumer that follows the log's end, and both rates are printed.
A rate that falls as the log grows is what the service's long runs suggest (BENCHMARKS.md, issue 17).
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.common.machine import machine_facts
from bench.common.args import arguments
from rlens.local.servers import LocalBroker

PROBE, VALUE = 2_000, b"x" * 600


async def produce(producer: AIOKafkaProducer, n: int, partitions: int) -> None:
    sent = [await producer.send("log", VALUE, partition=i % partitions) for i in range(n)]
    await asyncio.gather(*sent)


async def probe(records: int, every: int, partitions: int, max_batch_bytes: int) -> None:
    broker = LocalBroker()
    try:
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic("log", partitions, 1)])
        await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=0, max_batch_size=max_batch_bytes)
        consumer = AIOKafkaConsumer(
            "log",
            bootstrap_servers=broker.bootstrap,
            auto_offset_reset="latest",
            fetch_max_wait_ms=5,
            enable_auto_commit=False,
        )
        await producer.start()
        await consumer.start()
        await consumer.getmany(timeout_ms=500)
        written = 0
        while written < records:
            await produce(producer, every - PROBE, partitions)
            while await consumer.getmany(timeout_ms=50, max_records=100_000):  # catch up with the log's end
                pass
            started = time.perf_counter()
            await produce(producer, PROBE, partitions)
            produced, read = time.perf_counter(), 0
            while read < PROBE:
                read += sum(map(len, (await consumer.getmany(timeout_ms=1_000, max_records=100_000)).values()))
            written += every
            print(
                f"partitions {partitions}, log {written:9,d} records: produce {PROBE / (produced - started):9,.0f} "
                f"records/s, consume {PROBE / (time.perf_counter() - produced):9,.0f} records/s",
                flush=True,
            )
        await producer.stop()
        await consumer.stop()
    finally:
        broker.stop()


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--records", type=int, default=600_000)
    parser.add_argument("--every", type=int, default=50_000)
    parser.add_argument("--partitions", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-batch-bytes", type=int, default=1 << 20)
    args = parser.parse_args()
    if args.every <= PROBE:
        parser.error(f"--every must be above {PROBE}")
    print(f"machine: {machine_facts()}", flush=True)
    for partitions in args.partitions:
        asyncio.run(probe(args.records, args.every, partitions, args.max_batch_bytes))


if __name__ == "__main__":
    main()
