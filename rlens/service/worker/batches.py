"""One batch of records from ``queries``, start to end: which queries are admitted (the rest dead-lettered with the
reason), the worker's answers, their delivery (experience, answers, the gateways' reply topics) with bounded retries,
and the batch's metrics. :mod:`rlens.service.worker.app` hands it each batch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from faststream.kafka import KafkaBroker
from redis.exceptions import RedisError
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from rlens.messages import TENANT_MARK, Answer, DeadLetter, Query
from rlens.service.common.kafka import (
    Topics,
    TopicRestorer,
    dead_letter,
    parse_or_dead_letter,
    publish_batch,
    publish_dead_letters,
)
from rlens.service.common.metrics import WorkerMetrics, failure_kind
from rlens.service.worker.base import BatchOutput, Worker
from rlens.settings import Settings
from rlens.service.common.logs import query_fields
from rlens.service.common.tracing import context_of, trace_carrier, tracer, tracing

log = logging.getLogger("rlens.worker")
REPLY_TIMEOUT_S = 5.0  # a gateway's reply topic must take an answer within this
REPLY_TOPIC_KNOWN_S = 60.0  # a reply topic found registered is trusted this long without asking Redis again
PUBLISH_TRIES = 5  # a batch whose outputs the broker refuses this many times is dead-lettered
RETRY_PAUSE_S = 0.5  # between two tries of a batch whose outputs the broker refused


class Retries:
    """How often each record was read again after its batch's outputs failed to publish (bounded by the records
    in flight: a record is forgotten once its batch went through or was given up)."""

    def __init__(self, tries: int):
        self.tries = tries
        self._counts: Counter[tuple[str, int, int]] = Counter()

    @staticmethod
    def _keys(records) -> list[tuple[str, int, int]]:
        return [(r.topic, r.partition, r.offset) for r in records]

    def spent(self, records) -> bool:
        """Count one more failed try of these records; True once some record has had ``tries``."""
        keys = self._keys(records)
        self._counts.update(keys)
        return max((self._counts[k] for k in keys), default=0) >= self.tries

    def forget(self, records) -> None:
        for key in self._keys(records):
            self._counts.pop(key, None)


@dataclass
class Admitted:
    """A batch's records sorted: the queries to answer (with their records, by query id) and the dead letters."""

    queries: list[Query] = field(default_factory=list)
    records: dict = field(default_factory=dict)
    dead: list[DeadLetter] = field(default_factory=list)


def admit(records, worker: Worker, topics: Topics, consumer: str) -> Admitted:
    """Parse each record; dead-letter what does not parse, what the worker's strategy rejects, a ``reply_to`` that is
    no reply topic, a tenant's stream without a gateway's signature, and a query id seen before in the batch."""
    batch = Admitted()
    for record in records:
        parsed = parse_or_dead_letter(Query, record, consumer)
        if isinstance(parsed, DeadLetter):
            batch.dead.append(parsed)
            continue
        if reason := worker.rejects(parsed):
            pass
        elif parsed.reply_to is not None and not parsed.reply_to.startswith(topics.reply_prefix):
            reason = f"reply_to {parsed.reply_to!r} is not a reply topic (they start with {topics.reply_prefix!r})"
        elif parsed.stream.startswith(TENANT_MARK) and not worker.tokens.query_signed(parsed):
            reason = f"stream {parsed.stream!r} is a gateway tenant's, and no gateway signed this query"
        elif parsed.query_id in batch.records:
            reason = f"query id {parsed.query_id} appears twice in one batch"
        else:
            batch.queries.append(parsed)
            batch.records[parsed.query_id] = record
            continue
        batch.dead.append(dead_letter(record, reason, consumer))
    return batch


class QueryBatches:
    """The worker's handling of ``queries`` batches. Outputs are published before the batch is acknowledged (its
    offsets committed): experience first, then answers, then the replies to gateways."""

    def __init__(
        self,
        settings: Settings,
        worker: Worker,
        broker: KafkaBroker,
        dead_letters,
        metrics: WorkerMetrics,
        consumer: str,
        call_attributes: dict[str, dict] | None = None,
    ):
        """``call_attributes``: each model's attributes on its call spans (provider, server; the pool's)."""
        self.settings, self.worker, self.broker, self.dead_letters = settings, worker, broker, dead_letters
        self.metrics, self.consumer = metrics, consumer
        self.call_attributes = call_attributes or {}
        self.topics = Topics.from_settings(settings)
        self.restorer = TopicRestorer(settings)
        self.retries = Retries(PUBLISH_TRIES)
        self.known_reply_topics: dict[str, float] = {}  # topic -> when it was last found registered

    async def handle(self, records) -> None:
        """Answer a batch. A broker that refuses the outputs makes this raise (the batch is read again) up to
        PUBLISH_TRIES times; then the batch's queries are dead-lettered with the reason."""
        batch = admit(records, self.worker, self.topics, self.consumer)
        await self.drop_unregistered(batch)
        queries, dead = batch.queries, batch.dead
        began_ns = time.time_ns()
        out = await self.worker.answer(queries) if queries else BatchOutput()
        dead += [dead_letter(batch.records[qid], reason, self.consumer) for qid, reason in out.failed.items()]
        spans = open_spans(out, batch.records, began_ns, self.call_attributes) if tracing() else {}
        if spans:  # each experience names its query's span: the learner's join joins the trace
            carriers = {qid: trace_carrier(set_span_in_context(s)).get("traceparent") for qid, s in spans.items()}
            out.experience = [
                e.model_copy(update={"trace": carriers.get(getattr(e, "query_id", ""))}) for e in out.experience
            ]
        started = time.perf_counter()
        try:
            await self.deliver(queries, out)
        except Exception as exc:  # the broker refused: try again (the batch is read again), within a budget
            await self.restorer.restore()
            if not self.retries.spent(records):
                await asyncio.sleep(RETRY_PAUSE_S)  # no hot loop against a broker that refuses
                raise
            log.error("gave up publishing a batch of %d queries after %d tries: %r", len(queries), PUBLISH_TRIES, exc)
            reason = f"its outputs could not be published in {PUBLISH_TRIES} tries: {type(exc).__name__}: {exc}"
            dead += [dead_letter(batch.records[q.query_id], reason, self.consumer) for q in queries]
            queries, out = [], BatchOutput()
        finally:
            for span in spans.values():
                span.end()
        self.retries.forget(records)
        self.worker.stats.dead_lettered += len(dead)
        await publish_dead_letters(self.dead_letters, dead)
        out.stages["publish"] = time.perf_counter() - started
        if self.settings.metrics.enabled:
            self.metrics.count_batch(queries, out, dead, self.worker)

    async def drop_unregistered(self, batch: Admitted) -> None:
        """Dead-letter the queries whose reply topic no live gateway registered (replying there would make a topic
        per forged name) and those whose id was first asked on another stream (a token for that stream would be
        issued for another's query). One Redis round trip; while Redis is down, known reply topics are trusted and
        ids are not checked (a warning says so)."""
        claims = {q.query_id: q.stream for q in batch.queries}
        unknown, owners = await self.admission({q.reply_to for q in batch.queries if q.reply_to}, claims)
        for q in batch.queries:
            if q.reply_to in unknown:
                reason = f"reply_to {q.reply_to!r} is no live gateway's reply topic (none registered it in Redis)"
            elif owners.get(q.query_id, q.stream) != q.stream:
                reason = f"query id {q.query_id} belongs to another stream (it was first asked there)"
            else:
                continue
            batch.dead.append(dead_letter(batch.records.pop(q.query_id), reason, self.consumer))
        batch.queries = [q for q in batch.queries if q.query_id in batch.records]

    async def admission(self, topics: set[str], claims: dict[str, str]) -> tuple[set[str], dict[str, str]]:
        """The reply topics no live gateway registered, and each query id's stream (:meth:`RedisWindows.admission`).
        Topics found registered in the last REPLY_TOPIC_KNOWN_S are not asked again (nor lost while Redis is down)."""
        now = time.monotonic()
        known = self.known_reply_topics
        ask = {t for t in topics if now - known.get(t, -REPLY_TOPIC_KNOWN_S) >= REPLY_TOPIC_KNOWN_S}
        try:
            found, owners = await self.worker.windows.admission(ask, claims)
        except (RedisError, OSError) as exc:
            log.warning(
                "Redis unreachable (%s): reply topics %s and query ids not confirmed", exc, ", ".join(sorted(ask))
            )
            found, owners = set(), {}
        known.update({t: now for t in found})
        return ask - found, owners

    async def deliver(self, queries: list[Query], out: BatchOutput) -> None:
        """The experience first, then the answers: a retry after a failure in between repeats only experience
        (which the learner joins once), never an answer a client already got. The answers and the gateways'
        replies go together (the producer sends them in one request); a failure of either raises once both ended."""
        reply_to = {q.query_id: q.reply_to for q in queries if q.reply_to}
        # in its key's partition: a learner shard finds a query's feedback under the same partition number
        await publish_batch(self.broker, self.topics.experience, out.experience, by_key=True)
        # a gateway's query, or any on a tenant's stream: its feedback token goes to the gateway's reply topic alone,
        # never to the shared topic
        shared = [
            a.model_copy(update={"feedback_token": ""})
            if a.query_id in reply_to or a.stream.startswith(TENANT_MARK)
            else a
            for a in out.answers
        ]
        for result in await asyncio.gather(
            publish_batch(self.broker, self.topics.answers, shared),
            self.reply(out.answers, reply_to),
            return_exceptions=True,
        ):
            if isinstance(result, BaseException):
                raise result

    async def reply(self, answers: list[Answer], reply_to: dict[str, str]) -> None:
        """Each answer also to its gateway's reply topic. Replies the broker refuses are tried once more after the
        reply topics are made again (a broker restarted empty loses them, and only their gateway makes them
        otherwise); one that still fails within REPLY_TIMEOUT_S is logged and counted (the answer is on
        ``answers`` anyway), so no reply topic can hold the batch."""
        sent = [(self.worker.tokens.sign(a), reply_to[a.query_id]) for a in answers if a.query_id in reply_to]
        failed = await self._send_replies(sent)
        if failed:  # the reply topics made again (at most every 5 s each), then one more try
            await self.restorer.restore(tuple(sorted({t for _, t, _ in failed})))
            failed = await self._send_replies([(a, topic) for a, topic, _ in failed])
        for a, topic, error in failed:
            self.metrics.reply_failures.inc()
            fields = query_fields(a.query_id, a.stream, a.policy_version)
            log.error("could not reply to %s for query %s: %r", topic, a.query_id, error, extra=fields)

    async def _send_replies(self, sent: list[tuple[Answer, str]]) -> list[tuple[Answer, str, BaseException]]:
        """Publish each (answer, reply topic); those that failed within REPLY_TIMEOUT_S, with the error."""
        results = await asyncio.gather(
            *(
                asyncio.wait_for(
                    self.broker.publish(a.model_dump_json().encode(), topic, key=a.query_id.encode()), REPLY_TIMEOUT_S
                )
                for a, topic in sent
            ),
            return_exceptions=True,
        )
        return [(a, topic, r) for (a, topic), r in zip(sent, results) if isinstance(r, BaseException)]


def open_spans(out: BatchOutput, records: dict, began_ns: int, call_attributes: dict[str, dict]) -> dict[str, Span]:
    """Each answer's span, a child of the span in its query record's headers (a gateway request's), from the batch's
    start, and under it one span per model called, as that call ran (its start, duration, tokens and failure); the
    caller ends the answer spans once the batch is delivered."""
    t, spans = tracer(), {}
    for answer in out.answers:
        record = records.get(answer.query_id)
        parent = context_of(getattr(record, "headers", None))
        span = t.start_span(
            "rlens.worker answer",
            context=parent,
            kind=SpanKind.CONSUMER,
            start_time=began_ns,
            attributes={
                "rlens.query_id": answer.query_id,
                "rlens.stream": answer.stream,
                "rlens.strategy": answer.strategy,
                "rlens.policy_version": answer.policy_version,
                "rlens.cost": answer.cost,
                "rlens.chosen_models": answer.chosen_models,
            },
        )
        failed = {f.model: f.reason for f in answer.failures}
        inside = set_span_in_context(span)
        for call in answer.model_calls:
            start = began_ns + int(1e6 * call.offset_ms)
            attributes = {
                "gen_ai.operation.name": "text_completion",
                "gen_ai.request.model": call.model,
                **call_attributes.get(call.model, {}),
                "gen_ai.usage.input_tokens": call.prompt_tokens,
                "gen_ai.usage.output_tokens": call.completion_tokens,
                "rlens.tokens_estimated": call.estimated,
            }
            model_span = t.start_span(
                f"text_completion {call.model}", context=inside, kind=SpanKind.CLIENT, start_time=start
            )
            if call.model in failed:
                attributes["error.type"] = failure_kind(failed[call.model])
                model_span.set_status(Status(StatusCode.ERROR, failed[call.model][:200]))  # the operator's view
            model_span.set_attributes(attributes)
            model_span.end(end_time=start + int(1e6 * call.duration_ms))
        spans[answer.query_id] = span
    return spans
