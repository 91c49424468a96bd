"""Kafka plumbing shared by the worker, the learner and the load generator (FastStream on aiokafka).

- :func:`make_broker`: a ``KafkaBroker`` from the settings (bootstrap, SASL / TLS passthrough, quiet logs).
- :class:`Topics`: every topic name, from one prefix.
- :func:`keep_bytes`: a decoder that hands handlers the raw bytes, so that parsing (and dead-lettering what does
  not parse) is the service's own, never FastStream's; :func:`checked_records`: the parser in front of it, so that
  no record header can make FastStream drop a batch, and :data:`SUBSCRIBER` what every subscriber passes (no reply
  from a subscriber to a ``reply_to`` header: FastStream's RPC is not rlens's).
- :func:`parse_or_dead_letter`: bytes → a typed message, or a :class:`DeadLetter` with the reason (its coordinates,
  the first :data:`DEAD_LETTER_VALUE_BYTES` bytes, the size and SHA-256 of the whole value).
- :func:`typed_publisher` / :func:`publish`: messages out (documented with their schema), confirmed by the broker
  (``acks=all`` by default) before :func:`publish` returns; :func:`publish_batch` sends many as producer batches.
  :func:`publish_dead_letters` never raises: a dead letter the broker refuses is logged with its coordinates and
  reason instead, so it cannot block the consumer.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import math
import ssl
import time
import uuid
from dataclasses import dataclass, fields
from itertools import chain
from typing import Annotated, Any, Callable, Literal, Sequence, TypeVar, cast

from aiokafka.structs import ConsumerRecord
from faststream import AckPolicy, Context
from faststream.kafka import KafkaBroker, KafkaResponse
from faststream.kafka.message import KafkaMessage
from pydantic import ValidationError

from rlens.messages import DeadLetter, Message
from rlens.settings import Settings

M = TypeVar("M", bound=Message)
# policies are large (RLAE-MAPPO over 4 models: 1.8 to 3.3 MB): the policy topic is made to take this much
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# what the per-query topics are made to take: a query, answer or experience at the bounds of its fields
MAX_RECORD_BYTES = 4 * 1024 * 1024
# a producer batch of :func:`publish_batch` stays under a broker's default message limit (1 MB)
BATCH_BYTES = 512 * 1024
DEAD_LETTER_VALUE_BYTES = 4096  # a dead letter keeps this much of the value (its size and hash say the rest)
UNKNOWN_TOPIC = 3  # Kafka's error code UNKNOWN_TOPIC_OR_PARTITION
log = logging.getLogger("rlens.kafka")


@dataclass(frozen=True)
class Topics:
    queries: str
    answers: str
    feedback: str
    experience: str
    policy: str
    dead_letter: str
    drift: str
    spending: str
    transitions: str  # learner shards → the trainer

    @property
    def reply_prefix(self) -> str:
        """Every gateway replica's reply topic starts with this (a query's ``reply_to`` must)."""
        return self.queries.removesuffix("queries") + "replies."

    def replies(self, gateway_id: str) -> str:
        return self.reply_prefix + gateway_id

    @classmethod
    def from_settings(cls, settings: Settings) -> "Topics":
        p = settings.kafka.topic_prefix
        return cls(
            f"{p}queries",
            f"{p}answers",
            f"{p}feedback",
            f"{p}experience",
            f"{p}policy",
            f"{p}dead-letter",
            f"{p}drift",
            f"{p}spending",
            f"{p}transitions",
        )


def make_broker(settings: Settings, log_level: int = logging.WARNING) -> KafkaBroker:
    """A broker for ``settings.kafka_bootstrap``, with SASL / TLS when the settings ask for them."""
    from faststream.security import SASLPlaintext, SASLScram256, SASLScram512

    security = None
    protocol = settings.kafka.security_protocol.upper()
    context = (
        ssl.create_default_context(cafile=str(settings.kafka.ssl_cafile) if settings.kafka.ssl_cafile else None)
        if "SSL" in protocol
        else None
    )
    if protocol.startswith("SASL"):
        mechanism = {"PLAIN": SASLPlaintext, "SCRAM-SHA-256": SASLScram256, "SCRAM-SHA-512": SASLScram512}.get(
            (settings.kafka.sasl_mechanism or "PLAIN").upper()
        )
        if mechanism is None:
            raise ValueError(f"unsupported RLENS_KAFKA_SASL_MECHANISM {settings.kafka.sasl_mechanism!r}")
        password = settings.kafka.sasl_password.get_secret_value() if settings.kafka.sasl_password else ""
        security = mechanism(username=settings.kafka.sasl_username or "", password=password, ssl_context=context)
    elif protocol == "SSL":
        from faststream.security import BaseSecurity

        security = BaseSecurity(ssl_context=context)
    logger = logging.getLogger("rlens.kafka")
    logger.setLevel(log_level)
    return KafkaBroker(
        bootstrap_servers(settings),  # a list: FastStream takes a string for one address
        security=security,
        logger=logger,
        log_level=logging.DEBUG,
        # what it gathers per partition: room for a publish_batch chunk and its records' overhead, under Kafka's
        # default topic limit (1 MB); a larger record goes alone
        max_batch_size=2 * BATCH_BYTES,
        max_request_size=MAX_MESSAGE_BYTES,
        acks=-1 if settings.kafka.acks == "all" else 1,
        enable_idempotence=settings.kafka.idempotence is True,  # "auto" that no one settled: off
    )


def bootstrap_servers(settings: Settings) -> list[str]:
    """``RLENS_KAFKA_BOOTSTRAP``'s comma-separated addresses."""
    return [address.strip() for address in settings.kafka.bootstrap.split(",") if address.strip()]


def client_options(settings: Settings) -> dict[str, Any]:
    """aiokafka's connection arguments for ``settings`` (bootstrap, SASL / TLS), for a plain client beside the
    processes' FastStream brokers (:func:`make_broker`)."""
    protocol = settings.kafka.security_protocol.upper()
    options: dict[str, Any] = {"bootstrap_servers": bootstrap_servers(settings), "security_protocol": protocol}
    if "SSL" in protocol:
        cafile = str(settings.kafka.ssl_cafile) if settings.kafka.ssl_cafile else None
        options["ssl_context"] = ssl.create_default_context(cafile=cafile)
    if protocol.startswith("SASL"):
        options["sasl_mechanism"] = (settings.kafka.sasl_mechanism or "PLAIN").upper()
        options["sasl_plain_username"] = settings.kafka.sasl_username or ""
        password = settings.kafka.sasl_password
        options["sasl_plain_password"] = password.get_secret_value() if password else ""
    return options


async def read_topic(settings: Settings, topic: str, timeout_s: float = 30.0) -> list[Any]:
    """Every record of a one-partition ``topic``, from its start to its end when called (no consumer group)."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    consumer = AIOKafkaConsumer(
        **client_options(settings), enable_auto_commit=False, fetch_max_bytes=2 * MAX_MESSAGE_BYTES
    )
    await consumer.start()
    try:
        partition = TopicPartition(topic, 0)
        consumer.assign([partition])
        await consumer.seek_to_beginning(partition)
        end = (await consumer.end_offsets([partition]))[partition]
        records: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while await consumer.position(partition) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"read {len(records)} records of {topic} in {timeout_s:.0f} s, not its {end}")
            batch = await consumer.getmany(partition, timeout_ms=1000)
            records.extend(batch.get(partition, []))
        return records
    finally:
        await consumer.stop()


def app_logger() -> logging.Logger:
    """The logger of a worker's or learner's FastStream app: FastStream's own start and stop banners (coloured, with
    "press CTRL+C") stay out of service logs; the processes log their own "ready" lines."""
    logger = logging.getLogger("rlens.faststream")
    logger.setLevel(logging.WARNING)
    return logger


async def keep_bytes(message: Any) -> Any:
    """FastStream decoder: the raw body (a list of bodies for batch subscribers)."""
    return message.body


HEADER_EXCERPT_BYTES = 64  # what a dead letter's reason quotes of a bad header
# FastStream's own RPC headers: a subscriber never answers them (its replies are rlens's messages, sent by rlens)
RPC_HEADERS = ("reply_to", "correlation_id")


@dataclass
class CheckedRecord(ConsumerRecord):
    """A consumer record whose headers were checked: only those with a UTF-8 value are kept (FastStream's RPC headers
    never), and ``header_problem`` says why the record must be dead-lettered (a header without a value, or not UTF-8)."""

    header_problem: str | None = None


def check_record(record: Any) -> CheckedRecord:
    """``record`` with its headers checked (:class:`CheckedRecord`); the first bad header is the record's problem."""
    kept, problem = [], None
    for key, value in record.headers or ():
        if value is None:
            problem = problem or f"record header {key[:HEADER_EXCERPT_BYTES]!r} has no value"
            continue
        try:
            value.decode()
        except (UnicodeDecodeError, AttributeError):
            excerpt = bytes(value[:HEADER_EXCERPT_BYTES]) if isinstance(value, (bytes, bytearray)) else b""
            problem = problem or (
                f"record header {key[:HEADER_EXCERPT_BYTES]!r} is not UTF-8 ({len(value)} bytes, starting {excerpt!r})"
            )
            continue
        if key not in RPC_HEADERS:
            kept.append((key, value))
    values = {f.name: getattr(record, f.name) for f in fields(ConsumerRecord)}
    return CheckedRecord(**{**values, "headers": tuple(kept)}, header_problem=problem)


async def checked_records(message: Any, original: Any) -> Any:
    """FastStream parser: FastStream's own, over the records with their headers checked (:func:`check_record`), so
    that a header that is null or not UTF-8 costs its own record (dead-lettered by :func:`parse_or_dead_letter`), never
    its batch, and no header is logged whole."""
    if isinstance(message, tuple):
        return await original(tuple(check_record(r) for r in message))
    return await original(check_record(message))


# what every subscriber of the service passes: checked headers, raw bytes, and no FastStream reply
SUBSCRIBER: dict[str, Any] = {"parser": checked_records, "decoder": keep_bytes, "no_reply": True}


class _OnTheLoop(type(Context())):  # type: ignore[misc]  # the class behind FastStream's Context()
    """FastStream's ``Context``, resolved on the event loop: fast_depends runs a custom field's synchronous ``use``
    in a worker thread (anyio's ``to_thread``), a thread hop and two handovers of the GIL for a dictionary lookup,
    on every message or batch."""

    async def use(self, /, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return super().use(**kwargs)


# what a handler declares to get its message (a batch's records: ``message.raw_message``); FastStream's
# ``KafkaMessage`` annotation would resolve it in a thread
RawMessage = Annotated[KafkaMessage, _OnTheLoop("message")]

# how long a batch subscriber's poll waits for records before it polls again (it returns as soon as any arrive, and a
# stop cancels it): how often an idle subscriber wakes
POLL_WAIT_MS = 5000


def woken_by_records(subscriber: Any, on_lag: Callable[[int], None] | None = None) -> Any:
    """A FastStream batch subscriber whose poll waits in aiokafka's ``getmany``, which returns as soon as records
    arrive. FastStream's own polls for ``batch_timeout_ms`` and, when that comes back empty, sleeps as long again: a
    record arriving in the sleep waited for its end (up to 20 ms a hop at light load), and an idle subscriber woke
    25 times a second. A busy subscriber's batches are what they were: whatever has arrived, up to
    ``max_records``. ``on_lag`` hears, after each poll, the records of its partitions not yet taken (their high
    watermarks minus its positions, as of the last fetch): what an autoscaler reads as consumer lag."""

    async def get_msg(consumer: Any) -> tuple:
        records = await consumer.getmany(timeout_ms=POLL_WAIT_MS, max_records=subscriber.max_records)
        if on_lag is not None:
            on_lag(await consumer_lag(consumer))
        return tuple(chain.from_iterable(records.values()))

    subscriber.get_msg = get_msg
    return subscriber


async def holds_nothing(consumer: Any, topic: str) -> bool:
    """Whether ``topic`` has never held a record (every partition's end offset 0); False when its partitions are not
    known (never publish over what may be there)."""
    from aiokafka.structs import TopicPartition

    partitions = consumer.partitions_for_topic(topic) or set()
    if not partitions:
        return False
    ends = await consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
    return all(end == 0 for end in ends.values())


async def consumer_lag(consumer: Any) -> int:
    """The records of ``consumer``'s assigned partitions beyond its positions, by the last fetch's high watermarks
    (a partition not fetched yet counts 0)."""
    lag = 0
    for tp in consumer.assignment():
        end = consumer.highwater(tp)
        if end is not None:
            lag += max(end - await consumer.position(tp), 0)
    return lag


def parse_or_dead_letter(model: type[M], record: Any, consumer: str) -> M | DeadLetter:
    """Parse one consumer record's value as ``model``; what does not parse (or has a bad header) becomes a dead
    letter with the reason."""
    if problem := getattr(record, "header_problem", None):
        return dead_letter(record, problem, consumer)
    value: bytes = record.value or b""
    try:
        return model.model_validate_json(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        reason = (
            f"invalid JSON: {first['msg']}"
            if first["type"] == "json_invalid"
            else f"not a valid {model.__name__}: {where}: {first['msg']}"
        )
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        reason = f"unreadable {model.__name__}: {exc}"
    return dead_letter(record, reason, consumer)


def dead_letter(record: Any, reason: str, consumer: str) -> DeadLetter:
    """A dead letter for a consumer record (anything with topic, partition, offset, key and value); its size is
    bounded whatever the record's."""
    value: bytes = record.value or b""
    return DeadLetter(
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key_b64=base64.b64encode(record.key[:256]).decode() if record.key is not None else None,
        value_b64=base64.b64encode(value[:DEAD_LETTER_VALUE_BYTES]).decode(),
        value_bytes=len(value),
        value_sha256=hashlib.sha256(value).hexdigest(),
        value_truncated=len(value) > DEAD_LETTER_VALUE_BYTES,
        reason=reason[:2000],
        consumer=consumer,
        at=time.time(),
    )


def group_options(settings: Settings, background: bool = False) -> dict[str, Any]:
    """A consumer group member's timings from the settings (every subscriber in a group); ``background``: a consumer
    off the request path, whose fetches may wait longer for data (``background_fetch_max_wait_ms``)."""
    kafka = settings.kafka
    return {
        "session_timeout_ms": kafka.session_timeout_ms,
        "heartbeat_interval_ms": kafka.heartbeat_ms,
        **fetch_wait(kafka.background_fetch_max_wait_ms if background else kafka.fetch_max_wait_ms),
    }


def fetch_wait(wait_ms: int) -> dict[str, int]:
    """A consumer's fetches waiting up to ``wait_ms`` for data, and its fetcher as patient: aiokafka's fetcher
    wakes when a fetch comes back or a rebalance, a seek or a paused partition needs it, and besides every
    ``consumer_timeout_ms`` (200 by default: five times a second for an idle consumer with nothing to do)."""
    return {"fetch_max_wait_ms": wait_ms, "consumer_timeout_ms": max(wait_ms, 200)}


def policy_reader(settings: Settings, role: Literal["workers", "learner"]) -> dict[str, Any]:
    """The subscriber options of a process that reads the whole ``policy`` topic: a consumer group of its own (its
    role's group, ``-policy-`` and a random suffix) that never commits. It starts at the topic's start and keeps
    its position while its group lives; a broker that restarted empty loses the group, and the consumer re-joins
    with no committed offset, so it reads the new log from its start. (A consumer without a group kept its old
    position, past the new log's first policies: tansu answers a fetch past a log's end with nothing. A committing
    group commits its old position on re-joining.) Reading the topic again is harmless: a policy not newer than
    the one in hand is ignored. Its fetches wait the longer of the two waits: it needs neither a record within
    milliseconds nor full batches (`rlens up`'s Apache Kafka, which answers a waiting fetch at once: the request
    path's 5 s; its tansu, which waits a fetch out: the background's 250 ms)."""
    kafka = settings.kafka
    return {
        "group_id": f"{settings.group(role)}-policy-{uuid.uuid4().hex[:12]}",
        "auto_offset_reset": "earliest",
        "ack_policy": AckPolicy.MANUAL,
        **group_options(settings, background=True),
        **fetch_wait(max(kafka.fetch_max_wait_ms, kafka.background_fetch_max_wait_ms)),
    }


def typed_publisher(broker: KafkaBroker, topic: str, model: type[Message], role: str, description: str) -> Any:
    """A publisher whose payload schema (the pydantic model) appears in the AsyncAPI document as ``topic:role``."""
    return broker.publisher(topic, schema=model, title=f"{topic}:{role}", description=description)


async def publish(publisher: Any, messages: Sequence[Message]) -> None:
    """Publish every message, keyed by its query id where it has one, and wait until the broker confirmed them all."""
    await asyncio.gather(*(publisher.publish(m.model_dump_json().encode(), key=_key(m)) for m in messages))


async def publish_batch(broker: KafkaBroker, topic: str, messages: Sequence[Message], by_key: bool = False) -> None:
    """Publish ``messages`` to ``topic`` in producer batches of at most :data:`BATCH_BYTES` (each message keyed by
    its query id) and wait until the broker confirmed them all: one send per batch instead of one per message (the
    worker's answers and experience). A batch goes to one partition: the partitioner's choice, or with ``by_key``
    its messages' key partition (:func:`key_partitions`: the experience, which a learner shard joins with the
    feedback of the same partition number)."""
    groups: dict[int | None, list[Message]] = {None: list(messages)}
    if by_key and messages:
        groups = await key_partitions(broker, topic, messages)
    sends = []
    for partition, group in groups.items():
        chunks: list[list[KafkaResponse]] = [[]]
        size = 0
        for m in group:
            body = m.model_dump_json().encode()
            if chunks[-1] and size + len(body) > BATCH_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(KafkaResponse(body, key=_key(m)))
            size += len(body)
        sends += [broker.publish_batch(*chunk, topic=topic, partition=partition) for chunk in chunks if chunk]
    await asyncio.gather(*sends)


async def key_partitions(
    broker: KafkaBroker, topic: str, messages: Sequence[Message]
) -> dict[int | None, list[Message]]:
    """``messages`` by the partition of ``topic`` that Kafka's default partitioner gives their key (murmur2, as
    every client's default puts a keyed record: the gateway's feedback, a Java producer's), from the partitions the
    broker's producer knows of the topic."""
    from aiokafka.partitioner import DefaultPartitioner

    producer = cast(Any, broker.config.producer)._producer.producer  # the aiokafka producer FastStream publishes with
    partitions, partitioner = sorted(await producer.partitions_for(topic)), DefaultPartitioner()
    groups: dict[int | None, list[Message]] = {}
    for m in messages:
        key = _key(m)
        partition = partitioner(key, partitions, partitions) if key is not None else None
        groups.setdefault(partition, []).append(m)
    return groups


async def publish_dead_letters(publisher: Any, letters: list[DeadLetter]) -> None:
    """Publish dead letters; one the broker refuses is logged (coordinates and reason) instead."""
    results = await asyncio.gather(
        *(publisher.publish(d.model_dump_json().encode(), key=_key(d)) for d in letters), return_exceptions=True
    )
    for letter, result in zip(letters, results):
        if isinstance(result, BaseException):
            log.error(
                "could not publish the dead letter of %s:%d@%d (%s): %s",
                letter.topic,
                letter.partition,
                letter.offset,
                letter.reason,
                result,
            )


def _key(message: Message) -> bytes | None:
    query_id = getattr(message, "query_id", None)
    return query_id.encode() if query_id else None


def topic_configs(
    policy: bool, replication: int, policy_keep_bytes: int = 2**30, compacted: bool = False
) -> dict[str, str]:
    """A topic's settings on a real cluster: the records it must take (a policy, or a message at its bounds; Kafka's
    default is 1 MB), the policy topic's history (by size, never by age), a compacted topic's (the spending: each
    record key's last record, kept for good), and with replication, acknowledged writes on at least two replicas."""
    configs = {"max.message.bytes": str(MAX_MESSAGE_BYTES if policy else MAX_RECORD_BYTES)}
    if compacted:
        configs |= {"cleanup.policy": "compact", "retention.ms": "-1"}
    if policy:
        configs |= {"retention.bytes": str(policy_keep_bytes), "retention.ms": "-1", "segment.bytes": str(32 * 2**20)}
    if replication > 1:
        configs["min.insync.replicas"] = str(min(2, replication))
    return configs


async def missing_topics(admin: Any, names: Sequence[str]) -> set[str]:
    """Which of ``names`` the cluster lacks, from a metadata request for those topics alone that may not make them.
    A whole cluster's metadata (``list_topics``: every team's topics) costs its size at every look; aiokafka's
    ``describe_topics`` lets a broker with ``auto.create.topics.enable`` (Kafka's default) make a missing topic with
    its own defaults. aiokafka's admin client has no public call for this request (``_send_request``, pinned in
    constraints.txt)."""
    from aiokafka.protocol.metadata import MetadataRequest

    response = await admin._send_request(MetadataRequest(sorted(set(names)), allow_auto_topic_creation=False))
    return {t["topic"] for t in response.to_object()["topics"] if t["error_code"] == UNKNOWN_TOPIC}


async def ensure_topics(settings: Settings, partitions: int | None = None, extra: tuple[str, ...] = ()) -> None:
    """Create the service's topics and the ``extra`` ones (one partition each: a gateway's reply topic).

    The per-query topics (queries, answers, feedback, experience, transitions, dead letters) get ``partitions`` partitions (the
    settings' ``kafka.partitions`` unless given): workers share the queries, and the local broker's reads slow down
    sharply as one partition's log holds more small batches (BENCHMARKS.md, issue 17). The policy, drift and
    spending topics keep one partition, so their order holds. Topics that existed already with fewer partitions,
    smaller records or a spending topic not compacted are named (a warning, once per process)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    topics = Topics.from_settings(settings)
    partitions = settings.kafka.partitions if partitions is None else partitions
    one_partition = (topics.policy, topics.drift, topics.spending, *extra)
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        names = (*vars(topics).values(), *extra)
        existing = set(names) - await missing_topics(admin, names)
        replication = settings.kafka.replication
        wanted = [
            NewTopic(
                t,
                1 if t in one_partition else partitions,
                replication,
                topic_configs=topic_configs(
                    t == topics.policy, replication, settings.learner.policy_keep_bytes, t == topics.spending
                ),
            )
            for t in names
            if t not in existing
        ]
        if wanted:
            try:
                await admin.create_topics(wanted)
            except TopicAlreadyExistsError:
                pass
        found = [t for t in names if t in existing]
        await _check_partitions(admin, [t for t in found if t not in one_partition], partitions)
        await _check_limits(admin, found, topics.policy, topics.spending)
    finally:
        await admin.close()


async def partition_counts(admin: Any, names: Sequence[str], wait_s: float = 30.0) -> dict[str, int]:
    """Each topic's partition count (0: not described), once the broker describes them all or after ``wait_s``: a
    broker learns of a topic the controller has just made a moment later, and one that is starting answers before it
    has the cluster's metadata (KAFKA-10206); until then it describes the topic as unknown."""
    deadline = time.monotonic() + wait_s
    while True:
        described = await admin.describe_topics(list(names))
        counts = {t["topic"]: len(t.get("partitions") or []) for t in described if t.get("error_code") == 0}
        if all(counts.get(n) for n in names) or time.monotonic() > deadline:
            return {n: counts.get(n, 0) for n in names}
        await asyncio.sleep(0.2)


async def shard_topics(settings: Settings) -> int:
    """The partition count of ``experience`` and ``feedback`` (made first if need be), which learner shards split
    between them; a clear error when the two differ (a query's halves would not meet in one shard)."""
    from aiokafka.admin import AIOKafkaAdminClient

    await ensure_topics(settings)
    topics = Topics.from_settings(settings)
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        counts = await partition_counts(admin, (topics.experience, topics.feedback))
    finally:
        await admin.close()
    if len(set(counts.values())) != 1 or not all(counts.values()):
        raise BrokerRefused(
            f"learner shards need {topics.experience} and {topics.feedback} with the same number of partitions (a "
            f"query's two halves, keyed by its id, then share a partition number); the broker has {counts}"
        )
    partitions = counts[topics.experience]
    if partitions < settings.learner.shards:
        log.warning(
            "%d learner shards for %d partitions: shards %d and above join nothing (RLENS_KAFKA_PARTITIONS)",
            settings.learner.shards,
            partitions,
            partitions,
        )
    return partitions


_warned: set[tuple[str, str]] = set()  # (topic, what): each found wrong once per process, not at every look


def _warn_once(topic: str, what: str, line: str, *args: Any) -> None:
    if (topic, what) not in _warned:
        _warned.add((topic, what))
        log.warning(line, *args)


async def _check_partitions(admin: Any, names: list[str], partitions: int) -> None:
    """Warn about per-query topics that existed already with fewer partitions than rlens makes them with: a worker
    beyond their count takes no queries. A broker that lost its topics makes them again, on a producer's first
    record, with its own default (Apache Kafka's ``num.partitions`` is 1)."""
    if not names:
        return
    try:
        described = await admin.describe_topics(names)
    except Exception as exc:  # an ACL without Describe
        log.debug("topic partitions not checked: %s", exc)
        return
    for topic in described:
        count = len(topic.get("partitions") or [])
        if topic.get("error_code") == 0 and 0 < count < partitions:
            _warn_once(
                topic["topic"],
                "partitions",
                "topic %s has %d partition(s), fewer than the %d rlens makes (RLENS_KAFKA_PARTITIONS): workers beyond "
                "%d take no queries (a broker that lost its topics makes them again, on a producer's first record, "
                "with its own default); raise them: kafka-topics.sh --alter --topic %s --partitions %d",
                topic["topic"],
                count,
                partitions,
                count,
                topic["topic"],
                partitions,
            )


async def _check_limits(admin: Any, names: list[str], policy: str, spending: str) -> None:
    """Warn about topics that existed already and take smaller records than rlens sends (a real cluster's default
    is 1 MB; RLAE-MAPPO policies are up to 3.3 MB), and about a spending topic that is not compacted (its records
    would be deleted with age, and with them what API keys spent). Brokers that do not describe topic settings are
    not checked."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    if not names:
        return
    try:
        described = await admin.describe_configs(
            [
                ConfigResource(ConfigResourceType.TOPIC, n, configs={"max.message.bytes": None, "cleanup.policy": None})
                for n in names
            ]
        )
    except Exception as exc:  # tansu, or an ACL without DescribeConfigs
        log.debug("topic settings not checked: %s", exc)
        return
    for response in described:
        for _, _, _, name, entries in response.resources:
            values = {key: value for key, value, *_ in entries}
            limit = int(values["max.message.bytes"]) if values.get("max.message.bytes") else None
            needed = MAX_MESSAGE_BYTES if name == policy else MAX_RECORD_BYTES
            if limit is not None and limit < needed:
                _warn_once(
                    name,
                    "max.message.bytes",
                    "topic %s takes records of at most %d bytes; rlens sends up to %d there: raise its max.message.bytes",
                    name,
                    limit,
                    needed,
                )
            if name == spending and values.get("cleanup.policy") not in (None, "compact"):
                _warn_once(
                    name,
                    "cleanup.policy",
                    "topic %s is not compacted (cleanup.policy=%s): what API keys spent is deleted with age; set "
                    "cleanup.policy=compact and retention.ms=-1",
                    name,
                    values["cleanup.policy"],
                )


class TopicRestorer:
    """After a publish or commit failed: ensure the service's topics (and the ``extra`` one-partition topics: a
    gateway's reply topic) again, since a broker restarted empty (memory storage, a lost cluster) has none and would
    refuse every record on them. At most once every ``every_s`` for each topic (an unwritable reply topic costs an
    admin round trip per ``every_s``, not per batch)."""

    def __init__(self, settings: Settings, every_s: float = 5.0, extra: tuple[str, ...] = ()):
        self.settings, self.every_s, self.extra = settings, every_s, extra
        self._last: dict[str, float] = {}  # topic ("" for the service's own) -> when it was last ensured

    async def restore(self, extra: tuple[str, ...] = ()) -> None:
        """Ensure the topics, and ``extra`` one-partition topics of this failure (a worker's reply topics), unless
        each was ensured within ``every_s``."""
        now = time.monotonic()
        names = ("", *self.extra, *extra)
        if all(now - self._last.get(name, -math.inf) < self.every_s for name in names):
            return
        self._last.update(dict.fromkeys(names, now))
        try:
            await ensure_topics(self.settings, extra=names[1:])
        except Exception as exc:  # the broker is down: the next failure tries again
            log.warning("could not ensure the topics: %s", exc)


async def keep_topics(
    settings: Settings,
    names: tuple[str, ...],
    extra: tuple[str, ...] = (),
    every_s: float = 2.0,
    check_every_s: float = 60.0,
) -> None:
    """A task: every ``every_s``, whether ``names`` (and the ``extra`` one-partition topics) still exist; when one is
    gone (a broker restarted empty), the service's topics and the ``extra`` ones are made again, so a process that
    only reads its own topic (a gateway's reply topic) or publishes to one is not left waiting on a topic nobody
    makes. Every ``check_every_s`` the topics are ensured anyway, which names any a producer's first record made
    again with the broker's defaults (fewer partitions, smaller records: :func:`ensure_topics`)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin: AIOKafkaAdminClient | None = None
    checked = time.monotonic()
    try:
        while True:
            await asyncio.sleep(every_s)
            try:
                if admin is None:
                    admin = AIOKafkaAdminClient(**client_options(settings))
                    await admin.start()
                missing = await asyncio.wait_for(missing_topics(admin, names + extra), every_s * 5)
                if missing:
                    log.warning(
                        "topics %s are gone (the broker restarted empty?): making them again",
                        ", ".join(sorted(missing)),
                    )
                if missing or time.monotonic() - checked >= check_every_s:
                    checked = time.monotonic()
                    await ensure_topics(settings, extra=extra)
            except Exception as exc:  # the broker is down: the next look tries again
                log.debug("topics not checked: %r", exc)
                if admin is not None:
                    await admin.close()
                admin = None
    finally:
        if admin is not None:
            await admin.close()


class BrokerRefused(ValueError):
    """The broker does not offer what the settings ask for, or no broker answers (one line saying which, and what
    to set)."""


async def send_one(settings: Settings, topic: str, value: bytes) -> None:
    """One record to ``topic`` from a producer of its own, acknowledged by every in-sync replica (an operator's
    command, not a service)."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(**client_options(settings), acks="all", max_request_size=MAX_MESSAGE_BYTES)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value)
    finally:
        await producer.stop()


async def settle_idempotence(settings: Settings) -> Settings:
    """``settings`` with ``kafka_idempotence`` true or false: "auto" becomes whether the broker accepts one idempotent
    producer (Apache Kafka does; tansu refuses its InitProducerId), and true is checked the same way, so that a
    process fails at its start, saying why, instead of at its first publish."""
    if settings.kafka.idempotence is False:
        return settings
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaConnectionError, KafkaError

    producer = AIOKafkaProducer(**client_options(settings), enable_idempotence=True, acks="all")
    quiet = logging.getLogger("aiokafka")
    level, quiet.level = quiet.level, logging.CRITICAL  # its own line would precede ours
    try:
        await producer.start()
    except KafkaConnectionError:  # no broker answered: that, not idempotence, is what to say
        raise BrokerRefused(
            f"no Kafka broker answers at {settings.kafka.bootstrap}: start one, or set RLENS_KAFKA_BOOTSTRAP "
            "(`rlens up` runs one of its own)"
        ) from None
    except KafkaError as exc:
        if settings.kafka.idempotence == "auto":
            log.info("the broker refused an idempotent producer (%s): producers are not idempotent", type(exc).__name__)
            return settings.updated({"kafka_idempotence": False})
        raise BrokerRefused(
            f"the broker at {settings.kafka.bootstrap} refused an idempotent producer ({type(exc).__name__}): it does "
            "not support them (tansu does not); set RLENS_KAFKA_IDEMPOTENCE=auto or false"
        ) from None
    finally:
        quiet.setLevel(level)
        await producer.stop()
    return settings.updated({"kafka_idempotence": True})
