"""What the Kafka client costs a hop: a bare consume → produce → commit loop on aiokafka (what rlens's processes
use, through FastStream) and on confluent-kafka (librdkafka: the protocol in C, in its own threads), alone and
bridged to an event loop as a service whose work is asynchronous would need it.

    python -m bench.service.kafka_clients --kafka 127.0.0.1:19092 [--rates 10 200] [--seconds 30] [--queries 20000]
    python -m bench.service.kafka_clients --kafka <tansu's address> --fetch-wait-ms 20
    python -m bench.service.kafka_clients --kafka 127.0.0.1:19092 --clients aiokafka faststream confluent-thread

A service process per client reads a topic in a consumer group and answers each record on a second topic (an
answer-sized record, ``acks=all``, the batch's sends confirmed before its offsets are committed: a worker's hop
with nothing else in it). The clients (``--clients``): ``aiokafka`` (on uvloop), ``confluent`` (a plain loop, no event
loop), ``confluent-asyncio`` (a consumer thread and a delivery thread hand batches and deliveries to an event loop),
``confluent-thread`` (one thread does all of Kafka, the event loop the batch's work), ``faststream`` (FastStream on
aiokafka as rlens's processes use it: the hop with FastStream's subscriber, acknowledgement and publisher around it)
and ``faststream-confluent`` (FastStream's own librdkafka broker). **Light load**: a driver
(aiokafka, the same for all) sends the bundled stream's queries at each ``--rates`` a second for ``--seconds`` and
reads the answers; reported: the service's CPU a message, the round trip's p50 / p99, and the service's idle CPU
(``--idle-s`` with nothing sent). **Saturation**: ``--queries`` messages written first, then read in batches of
``--batch``: messages/s from the first answer to the last (the yardstick of `bench.service.stack`'s "worker ÷ raw
loop"). The clients alternate ``--reps`` times, each run on topics of its own. Needs the `bench` extra
(confluent-kafka).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import cpu_seconds, machine_facts
from bench.common.stacks import cycled
from bench.service.stack import prefill
from rlens.records.dataset import load_dataset
from rlens.local.kafka import LocalKafka
from rlens.local.load import queries_of
from rlens.settings import settings

CLIENTS = ("aiokafka", "confluent", "confluent-asyncio", "confluent-thread", "faststream", "faststream-confluent")
REPLY = b"x" * 700  # an Answer of the bundled stream is about this many bytes
POLL_S = 0.5  # how long the service's poll waits before it polls again (it returns as soon as a record comes)


async def serve_aiokafka(bootstrap: str, source: str, sink: str, group: str, batch: int, wait_ms: int) -> None:
    consumer = AIOKafkaConsumer(
        source,
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=wait_ms,
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    await consumer.start()
    await producer.start()
    print("ready", flush=True)
    while True:
        batches = await consumer.getmany(timeout_ms=int(1000 * POLL_S), max_records=batch)
        records = [r for rs in batches.values() for r in rs]
        if records:
            await asyncio.gather(*[await producer.send(sink, REPLY, key=r.key) for r in records])
            await consumer.commit()


def confluent_clients(bootstrap: str, source: str, group: str, wait_ms: int) -> tuple[Any, Any]:
    """A consumer of ``source`` in ``group`` (offsets committed by hand) and a producer, as the loops use them."""
    from confluent_kafka import Consumer, Producer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": wait_ms,
        }
    )
    consumer.subscribe([source])
    return consumer, Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0})


def next_batch(consumer: Any, batch: int) -> list:
    """Waits up to POLL_S for the first record, then takes what else has come, up to ``batch``."""
    first = consumer.poll(POLL_S)
    records = [first, *consumer.consume(batch - 1, timeout=0)] if first is not None else []
    return [r for r in records if r.error() is None]


def serve_confluent(bootstrap: str, source: str, sink: str, group: str, batch: int, wait_ms: int) -> None:
    consumer, producer = confluent_clients(bootstrap, source, group, wait_ms)
    print("ready", flush=True)
    while True:
        records = next_batch(consumer, batch)
        if records:
            for r in records:
                producer.produce(sink, REPLY, key=r.key())
            producer.flush(30)
            consumer.commit(asynchronous=False)


async def serve_confluent_asyncio(bootstrap: str, source: str, sink: str, group: str, batch: int, wait_ms: int) -> None:
    """librdkafka behind an event loop, as a service whose work is asynchronous (Redis, the models) would need it: a
    thread waits in the consumer's poll and hands each batch to the loop; the loop produces, and awaits deliveries a
    second thread hears in the producer's poll; the consumer's thread commits once the loop says the batch is done."""
    import threading

    from confluent_kafka import KafkaException

    loop = asyncio.get_running_loop()
    consumer, producer = confluent_clients(bootstrap, source, group, wait_ms)
    batches: asyncio.Queue = asyncio.Queue()

    def consume() -> None:
        while True:
            records = next_batch(consumer, batch)
            if records:
                done = threading.Event()
                loop.call_soon_threadsafe(batches.put_nowait, (records, done))
                done.wait()
                consumer.commit(asynchronous=False)

    def deliveries() -> None:
        while True:
            producer.poll(POLL_S)

    def delivered(future: asyncio.Future) -> object:
        def on_delivery(error: object, _: object) -> None:
            if not future.done():  # the loop's side of the future, set from its own thread
                result = KafkaException(error) if error is not None else None
                loop.call_soon_threadsafe(future.set_exception if result else future.set_result, result)

        return on_delivery

    threading.Thread(target=consume, daemon=True).start()
    threading.Thread(target=deliveries, daemon=True).start()
    print("ready", flush=True)
    while True:
        records, done = await batches.get()
        futures = [loop.create_future() for _ in records]
        for r, future in zip(records, futures):
            producer.produce(sink, REPLY, key=r.key(), on_delivery=delivered(future))
        await asyncio.gather(*futures)
        done.set()


async def serve_confluent_thread(bootstrap: str, source: str, sink: str, group: str, batch: int, wait_ms: int) -> None:
    """librdkafka in one thread of its own beside the event loop: the thread polls, hands each batch to the loop and
    waits for what the loop makes of it, then produces it, waits for the deliveries (``flush``) and commits. Two
    hand-overs a batch (to the loop and back), where :func:`serve_confluent_asyncio` has four."""
    import concurrent.futures
    import threading

    loop = asyncio.get_running_loop()
    consumer, producer = confluent_clients(bootstrap, source, group, wait_ms)

    async def work(records: list) -> list[tuple[bytes, bytes]]:  # a service's asynchronous work on the batch
        return [(REPLY, r.key()) for r in records]

    def kafka() -> None:
        while True:
            records = next_batch(consumer, batch)
            if records:
                made: concurrent.futures.Future = asyncio.run_coroutine_threadsafe(work(records), loop)
                for value, key in made.result():
                    producer.produce(sink, value, key=key)
                producer.flush(30)
                consumer.commit(asynchronous=False)

    threading.Thread(target=kafka, daemon=True).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


def faststream_batches(group: str, batch: int, wait_ms: int) -> dict[str, Any]:
    """A FastStream batch subscriber's options, on either client: the group, batches of at most ``batch``, each
    acknowledged (its offsets committed) once its handler returns."""
    from faststream import AckPolicy

    return {
        "group_id": group,
        "batch": True,
        "max_records": batch,
        "auto_offset_reset": "earliest",
        "fetch_max_wait_ms": wait_ms,
        "ack_policy": AckPolicy.NACK_ON_ERROR,
    }


async def serve_faststream(bootstrap: str, source: str, sink: str, group: str, batch: int, wait_ms: int) -> None:
    """The same hop through FastStream on aiokafka as rlens's processes use it: a batch subscriber with the service's
    parser, decoder and poll (``SUBSCRIBER``, :func:`woken_by_records`), its message resolved on the loop
    (``RawMessage``), acknowledged (its offsets committed) once the handler returns; the batch's answers in one
    ``publish_batch``."""
    from faststream.kafka import KafkaBroker, KafkaResponse

    from rlens.service.common.kafka import SUBSCRIBER, RawMessage, woken_by_records

    # a batch's answers fit one producer batch (rlens's ``publish_batch`` cuts larger ones into chunks instead)
    broker = KafkaBroker(bootstrap, acks=-1, max_batch_size=1 << 20, logger=None)
    subscriber = broker.subscriber(source, **faststream_batches(group, batch, wait_ms), **SUBSCRIBER)

    @woken_by_records(subscriber)
    async def on_batch(bodies: list[bytes], message: RawMessage) -> None:
        await broker.publish_batch(*[KafkaResponse(REPLY, key=r.key) for r in message.raw_message], topic=sink)

    await broker.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def serve_faststream_confluent(
    bootstrap: str, source: str, sink: str, group: str, batch: int, wait_ms: int
) -> None:
    """FastStream's own librdkafka broker (``faststream.confluent``), a batch subscriber as FastStream gives it: each
    poll is a ``consume`` in a thread pool that returns when ``max_records`` came or its polling interval (0.1 s)
    ended, and its producer is polled every 0.1 s from a thread."""
    from faststream import Context
    from faststream.confluent import KafkaBroker, KafkaResponse

    broker = KafkaBroker(bootstrap, acks="all", linger_ms=0, logger=None)

    @broker.subscriber(source, **faststream_batches(group, batch, wait_ms))
    async def on_batch(_: Any, message: Any = Context()) -> None:  # the bodies as FastStream decodes them: unused
        await broker.publish_batch(*[KafkaResponse(REPLY, key=r.key()) for r in message.raw_message], topic=sink)

    await broker.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def make_topics(bootstrap: str, *topics: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, 1, 1) for t in topics])
    finally:
        await admin.close()


def start_service(client: str, bootstrap: str, source: str, sink: str, batch: int, wait_ms: int) -> subprocess.Popen:
    group = f"clients-{uuid.uuid4().hex[:8]}"
    service = subprocess.Popen(
        [sys.executable, "-m", "bench.service.kafka_clients", "--serve", client, bootstrap, source, sink, group],
        stdout=subprocess.PIPE,
        env={**os.environ, "BENCH_BATCH": str(batch), "BENCH_WAIT_MS": str(wait_ms)},
    )
    assert service.stdout is not None and service.stdout.readline().strip() == b"ready", f"{client} did not start"
    return service


async def light(
    bootstrap: str, client: str, payloads: list[bytes], rate: float, seconds: float, idle_s: float, wait_ms: int
) -> dict:
    """The service's CPU a message and the round trip at ``rate``, then its idle CPU."""
    prefix = f"clients{uuid.uuid4().hex[:8]}"
    source, sink = f"{prefix}.in", f"{prefix}.out"
    await make_topics(bootstrap, source, sink)
    service = start_service(client, bootstrap, source, sink, 32, wait_ms)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    consumer = AIOKafkaConsumer(
        sink, bootstrap_servers=bootstrap, auto_offset_reset="latest", fetch_max_wait_ms=wait_ms
    )
    await producer.start()
    await consumer.start()
    sent: dict[bytes, float] = {}
    back: list[float] = []

    async def read() -> None:
        while True:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                back.extend(time.perf_counter() - sent[r.key] for r in records if r.key in sent)

    async def send(n: int) -> None:
        began = time.perf_counter()
        for i in range(n):
            await asyncio.sleep(max(0.0, began + i / rate - time.perf_counter()))
            key = uuid.uuid4().hex.encode()
            sent[key] = time.perf_counter()
            await producer.send(source, payloads[i % len(payloads)], key=key)

    reader = asyncio.create_task(read())
    try:
        await send(int(rate * 3))  # warm: until the service has joined its group and answers (20 s on tansu)
        deadline = time.monotonic() + 120
        while not back and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if not back:
            raise RuntimeError(f"{client}: no answer to the warm-up within 120 s")
        await asyncio.sleep(2)
        back.clear()
        sent.clear()  # an answer of the warm-up that comes late is not counted
        n = int(rate * seconds)
        cpu = cpu_seconds([service.pid])
        await send(n)
        deadline = time.monotonic() + 30
        while len(back) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        cpu = cpu_seconds([service.pid]) - cpu
        if not back:
            raise RuntimeError(f"{client}: none of {n} answers came back within 30 s of the last query")
        idle = cpu_seconds([service.pid])
        await asyncio.sleep(idle_s)
        idle = (cpu_seconds([service.pid]) - idle) / idle_s
    finally:
        reader.cancel()
        service.kill()
        service.wait()
        await producer.stop()
        await consumer.stop()
    return {
        "client": client,
        "rate": rate,
        "sent": n,
        "answered": len(back),
        "cpu_ms_per_message": round(1000 * cpu / max(len(back), 1), 3),
        "p50_ms": round(1000 * float(np.percentile(back, 50)), 2),
        "p99_ms": round(1000 * float(np.percentile(back, 99)), 2),
        "idle_cores": round(idle, 4),
    }


async def saturated(bootstrap: str, client: str, payloads: list[bytes], batch: int, wait_ms: int) -> dict:
    """Messages/s of the loop over ``payloads`` written first, from its first answer to its last."""
    prefix = f"clients{uuid.uuid4().hex[:8]}"
    source, sink = f"{prefix}.in", f"{prefix}.out"
    await make_topics(bootstrap, source, sink)
    await prefill(bootstrap, source, payloads)
    consumer = AIOKafkaConsumer(sink, bootstrap_servers=bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=100)
    await consumer.start()
    service = start_service(client, bootstrap, source, sink, batch, wait_ms)
    first = last = None
    done = 0
    try:
        deadline = time.monotonic() + 600
        while done < len(payloads) and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                first = first or time.perf_counter()
                done += len(records)
                last = time.perf_counter()
    finally:
        service.kill()
        service.wait()
        await consumer.stop()
    assert first is not None and last is not None and done == len(payloads), f"{client}: {done} answered"
    return {"client": client, "messages": done, "messages_per_s": round(done / (last - first), 1)}


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        client, bootstrap, source, sink, group = sys.argv[2:7]
        batch, wait_ms = int(os.environ["BENCH_BATCH"]), int(os.environ["BENCH_WAIT_MS"])
        if client == "confluent":
            serve_confluent(bootstrap, source, sink, group, batch, wait_ms)
            return
        import uvloop  # on the loop rlens's service processes run on (``rlens.service.run.run_app``)

        serve = {
            "aiokafka": serve_aiokafka,
            "confluent-asyncio": serve_confluent_asyncio,
            "confluent-thread": serve_confluent_thread,
            "faststream": serve_faststream,
            "faststream-confluent": serve_faststream_confluent,
        }[client]
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(bootstrap, source, sink, group, batch, wait_ms))
        return
    parser = arguments(__doc__)
    parser.add_argument("--kafka", required=True, help="a broker's bootstrap (Apache Kafka or tansu)")
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 200.0])
    parser.add_argument("--seconds", type=float, default=30.0, help="of traffic at each rate")
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--queries", type=int, default=20000, help="for the saturated loop (0: none)")
    parser.add_argument("--batch", type=int, default=settings().worker.batch, help="the saturated loop's batches")
    parser.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    parser.add_argument("--reps", type=int, default=2, help="alternations of the clients")
    parser.add_argument(
        "--fetch-wait-ms",
        type=int,
        default=LocalKafka.FETCH_MAX_WAIT_MS,
        help="the fetches' wait for data (default: what `rlens up` gives the request path on Apache Kafka; tansu, which "
        "often waits it out: 20)",
    )
    add_out(parser, "bench/out/kafka_clients.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    stream = queries_of(load_dataset(settings().service.demo_data), None, "clients")
    payloads = [q.model_dump_json().encode() for q, _ in cycled(stream, "clients", max(args.queries, 1000))]
    rows: list[dict] = []
    for rep in range(args.reps):
        for client in args.clients if rep % 2 == 0 else args.clients[::-1]:
            for rate in args.rates:
                run = light(args.kafka, client, payloads, rate, args.seconds, args.idle_s, args.fetch_wait_ms)
                rows.append(asyncio.run(run))
                print(rows[-1], flush=True)
            if args.queries:
                run = saturated(args.kafka, client, payloads[: args.queries], args.batch, args.fetch_wait_ms)
                rows.append(asyncio.run(run))
                print(rows[-1], flush=True)
    write_json(args.out, {"kafka": args.kafka, "machine": machine_facts(), "rows": rows})


if __name__ == "__main__":
    main()
