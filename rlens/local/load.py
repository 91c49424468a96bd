"""``rlens load``: play a recorded dataset or open-ended tasks as live traffic and measure the service from the outside.

Multiple-choice traffic (:func:`queries_of`, for ``rl_focal``): queries in stream order (stream key = task name,
``reference_id`` = question index, so the ``replay`` backend can answer them; prompt and choices from
``questions.jsonl`` when the dataset has it); an answer is correct when it picks the label; a dataset of recorded
samples gives open-ended queries with their references instead. Open-ended traffic (:func:`open_ended_queries`,
for ``rlae`` or ``rl_focal``): prompts without choices (stream key = task family); an answer is correct when its
text is exactly the reference. Queries go out at ``rate`` per second.
When a query's first answer arrives, its feedback (the label, or the reference text, with the answer's feedback
token) is sent ``feedback_delay_s`` later.
Answers are read from the end of ``answers`` as it was when the play started, and counted once per query id
(duplicates are counted apart). The run ends when every query is answered
and every feedback sent, or when no answer came for ``idle_timeout_s``. A query or feedback the broker refuses (tansu
restarted empty refuses a record now and then) is sent again, :data:`SEND_TRIES` times in all; one refused every
time is counted (``send_failures``) and logged, never dropped unseen.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from rlens.records.recorded import RecordedDataset
from rlens.messages import Answer, Feedback, Query
from rlens.service.common.kafka import Topics, settle_idempotence
from rlens.settings import Settings
from rlens.zoo.tasks import GenerationTask, exact_match

Outcome = int | str  # the correct choice's position, or the reference text of an open-ended query
SEND_TRIES = 5  # tries of a record the broker refuses, 0.2 s apart and doubling
log = logging.getLogger("rlens.load")


@dataclass
class LoadReport:
    sent: int = 0
    answered: int = 0
    correct: int = 0
    duplicates: int = 0
    no_answer: int = 0  # answers with failures and nothing answered
    feedback_sent: int = 0
    send_failures: int = 0  # queries and feedback the broker refused SEND_TRIES times (logged)
    latencies_ms: list[float] = field(default_factory=list)  # send -> answer received
    answered_at: list[float] = field(default_factory=list)  # seconds from the start of play to each answer
    outcomes: list[bool] = field(default_factory=list)  # in arrival order
    query_ids: list[str] = field(default_factory=list)  # each answer's query, in arrival order
    streams: list[str] = field(default_factory=list)  # each answer's stream, in arrival order
    versions: list[int] = field(default_factory=list)  # each answer's policy version, in arrival order
    models_called: list[int] = field(default_factory=list)  # each answer's models called, in arrival order
    per_task: dict[str, list[int]] = field(default_factory=dict)  # task -> [correct, answered]
    elapsed_s: float = 0.0
    gc_pauses_ms: list[float] = field(default_factory=list)  # this process's own garbage collections during play

    @property
    def policy_versions(self) -> set[int]:
        return set(self.versions)

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.answered, 1)

    def recent_accuracy(self, last: int = 200) -> float:
        window = self.outcomes[-last:]
        return sum(window) / max(len(window), 1)

    def latency_percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    def count(self, answer: Answer, correct: bool, stream: str, latency_ms: float, at_s: float) -> None:
        """One query's first answer."""
        self.answered += 1
        self.correct += correct
        self.no_answer += not answer.answered_models
        self.outcomes.append(correct)
        self.query_ids.append(answer.query_id)
        self.streams.append(stream)
        self.versions.append(answer.policy_version)
        self.models_called.append(len(answer.called_models))
        task = self.per_task.setdefault(stream, [0, 0])
        task[0] += correct
        task[1] += 1
        self.latencies_ms.append(latency_ms)
        self.answered_at.append(at_s)


def queries_of(
    dataset: RecordedDataset, prompts: list[tuple[str, list[str]]] | None, run_id: str
) -> list[tuple[Query, Outcome]]:
    """(query, label position among its choices) for every question, in stream order; for an open-ended dataset
    (recorded samples), (open-ended query, reference)."""
    if dataset.sampled is not None:
        return [
            (
                Query(
                    query_id=f"{run_id}-{i}",
                    stream=dataset.task_name(dataset.task[i]),
                    prompt=task.prompt,
                    reference_id=str(i),
                ),
                task.reference,
            )
            for i, task in enumerate(dataset.sampled)
        ]
    out: list[tuple[Query, Outcome]] = []
    for i in range(dataset.n_questions):
        valid = np.flatnonzero(dataset.choice_mask[i])
        prompt, choices = (
            prompts[i]
            if prompts
            else (f"question {i}", [chr(ord("A") + k) if k < 26 else f"choice {k}" for k in range(len(valid))])
        )
        query = Query(
            query_id=f"{run_id}-{i}",
            stream=dataset.task_name(dataset.task[i]),
            prompt=prompt,
            choices=choices,
            reference_id=str(i),
        )
        out.append((query, int(np.searchsorted(valid, dataset.labels[i]))))
    return out


def open_ended_queries(tasks: list[GenerationTask], run_id: str) -> list[tuple[Query, Outcome]]:
    """(query, reference) for every open-ended task, in order; the stream key is the task's family."""
    return [
        (Query(query_id=f"{run_id}-{i}", stream=t.family, prompt=t.prompt), t.reference) for i, t in enumerate(tasks)
    ]


def is_correct(answer: Answer, outcome: Outcome) -> bool:
    return exact_match(answer.answer, outcome) if isinstance(outcome, str) else answer.answer_index == outcome


def feedback_for(answer: Answer, outcome: Outcome) -> Feedback:
    """The feedback of ``answer`` (its query id and token) with the correct ``outcome``."""
    common = {"query_id": answer.query_id, "token": answer.feedback_token}
    return Feedback(**common, reference=outcome) if isinstance(outcome, str) else Feedback(**common, label=outcome)


async def send_surely(
    producer: AIOKafkaProducer,
    topic: str,
    value: bytes,
    key: bytes,
    report: LoadReport,
    first_error: BaseException | None = None,
) -> bool:
    """One record, tried until the broker has it (SEND_TRIES in all; ``first_error``: the first try failed already).
    False, logged and counted in ``report``, when every try failed."""
    for attempt in range(1 if first_error else 0, SEND_TRIES):
        await asyncio.sleep(0.2 * 2 ** (attempt - 1) if attempt else 0)
        try:
            await producer.send_and_wait(topic, value, key=key)
            return True
        except KafkaError as exc:
            first_error = exc
    report.send_failures += 1
    log.warning("%s: record %s refused %d times: %r", topic, key.decode(), SEND_TRIES, first_error)
    return False


async def play(
    settings: Settings,
    traffic: list[tuple[Query, Outcome]],
    rate: float,
    feedback_delay_s: float = 0.0,
    idle_timeout_s: float = 60.0,
    on_answer: Callable[[LoadReport], None] = lambda report: None,
    before_send: Callable[[int], Awaitable[None]] | None = None,
    max_in_flight: int | None = None,
    duration_s: float | None = None,
) -> LoadReport:
    """Play ``traffic`` at ``rate`` queries/s (see the module); ``before_send(i)``, if given, is awaited before the
    i-th query goes out (a closed loop: e.g. until the service has applied the previous query's feedback).
    ``max_in_flight``: never more than that many queries sent and not yet answered (with a high ``rate``, the
    service always has that backlog: its maximum rate). ``duration_s``: stop sending after that many seconds, and
    wait for the answers of what was sent."""
    settings = await settle_idempotence(settings)  # as the service's own processes do
    player = _Player(settings, traffic, feedback_delay_s, on_answer)
    await player.producer.start()
    await player.consumer.start()
    await player.skip_earlier_answers()
    player.start = time.perf_counter()
    sender = asyncio.create_task(player.send_queries(rate, before_send, max_in_flight, duration_s))
    gc.freeze()  # the traffic lives to the end: no full collection scans it (0.5 s each for 450,000 queries)
    gc.callbacks.append(pauses := GcPauses(player.report.gc_pauses_ms))
    try:
        await player.read_answers(sender, idle_timeout_s)
        await sender
        await asyncio.gather(*player.feedback_tasks, *player.resends)
    finally:
        gc.callbacks.remove(pauses)
        gc.unfreeze()
        sender.cancel()
        await player.consumer.stop()
        await player.producer.stop()
    player.report.elapsed_s = time.perf_counter() - player.start
    return player.report


class _Player:
    """One :func:`play`: its producer (queries and feedback) and its consumer of ``answers``, what was sent when,
    and the report."""

    def __init__(
        self,
        settings: Settings,
        traffic: list[tuple[Query, Outcome]],
        feedback_delay_s: float,
        on_answer: Callable[[LoadReport], None],
    ):
        self.topics, self.traffic = Topics.from_settings(settings), traffic
        self.feedback_delay_s, self.on_answer = feedback_delay_s, on_answer
        self.report = LoadReport()
        self.outcomes = {q.query_id: (outcome, q.stream) for q, outcome in traffic}
        self.sent_at: dict[str, float] = {}
        self.answered: set[str] = set()
        self.feedback_tasks: set[asyncio.Task] = set()  # those not done yet
        self.resends: set[asyncio.Task] = set()  # queries the broker refused, being sent again
        self.start = time.perf_counter()
        self.producer = AIOKafkaProducer(
            bootstrap_servers=settings.kafka.bootstrap,
            linger_ms=5,
            acks=-1 if settings.kafka.acks == "all" else 1,  # as the service's own producers
            enable_idempotence=settings.kafka.idempotence,
        )
        self.consumer = AIOKafkaConsumer(
            self.topics.answers,
            bootstrap_servers=settings.kafka.bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=settings.kafka.fetch_max_wait_ms,
        )

    async def skip_earlier_answers(self) -> None:
        """Read ``answers`` from its end as it is now, before the first query goes out (so none of this play's
        answers is missed): read from the start, a topic that holds an earlier run's answers (a benchmark's
        saturation: hundreds of thousands) was parsed and skipped while this play's answers waited behind them."""
        partitions = list(self.consumer.assignment())
        for partition in partitions:  # the start's own reset (to the earliest) done first: it would undo the seek
            await self.consumer.position(partition)
        for partition, end in (await self.consumer.end_offsets(partitions)).items() if partitions else ():
            self.consumer.seek(partition, end)

    async def send_queries(
        self,
        rate: float,
        before_send: Callable[[int], Awaitable[None]] | None,
        max_in_flight: int | None,
        duration_s: float | None,
    ) -> None:
        for i, (query, _) in enumerate(self.traffic):
            if duration_s is not None and time.perf_counter() - self.start >= duration_s:
                break
            if before_send is not None:
                await before_send(i)
            while max_in_flight is not None and i - self.report.answered >= max_in_flight:
                await asyncio.sleep(0.005)
            delay = self.start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.time()
            self.sent_at[query.query_id] = time.perf_counter()
            body, key = query.model_copy(update={"sent_at": now}).model_dump_json().encode(), query.query_id.encode()
            sent = await self.producer.send(self.topics.queries, body, key=key)  # not awaited: the producer batches
            sent.add_done_callback(functools.partial(self._resend_if_refused, self.topics.queries, body, key))
            self.report.sent += 1
        await self.producer.flush()

    def _resend_if_refused(self, topic: str, value: bytes, key: bytes, sent: asyncio.Future) -> None:
        if not sent.cancelled() and isinstance(error := sent.exception(), KafkaError):
            task = asyncio.ensure_future(send_surely(self.producer, topic, value, key, self.report, error))
            self.resends.add(task)
            task.add_done_callback(self.resends.discard)

    async def read_answers(self, sender: asyncio.Task, idle_timeout_s: float) -> None:
        """Every query's first answer, until every query sent is answered (all of them while ``sender`` still
        sends) or none came for ``idle_timeout_s``; a failed ``sender`` raises here."""
        last_progress = time.perf_counter()
        while (
            len(self.answered) < (self.report.sent if sender.done() else len(self.traffic))
            and time.perf_counter() - last_progress < idle_timeout_s
        ):
            batch = await self.consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for record in records:
                    if self._take(record.value):
                        last_progress = time.perf_counter()
            if sender.done() and (error := sender.exception()) is not None:
                raise error

    def _take(self, value: bytes) -> bool:
        """Count a record of ``answers``, and send its feedback; False when it is no first answer of this play."""
        try:
            answer = Answer.model_validate_json(value)
        except ValidationError:
            return False
        if answer.query_id not in self.outcomes:
            return False  # another run's answer
        if answer.query_id in self.answered:
            self.report.duplicates += 1
            return False
        self.answered.add(answer.query_id)
        outcome, stream = self.outcomes[answer.query_id]
        now = time.perf_counter()
        latency_ms = 1000 * (now - self.sent_at.get(answer.query_id, now))
        self.report.count(answer, is_correct(answer, outcome), stream, latency_ms, now - self.start)
        if answer.feedback_token:  # an answer with no model behind it has nothing to rate
            task = asyncio.create_task(self._send_feedback(answer, outcome))
            self.feedback_tasks.add(task)
            task.add_done_callback(self.feedback_tasks.discard)
        self.on_answer(self.report)
        return True

    async def _send_feedback(self, answer: Answer, outcome: Outcome) -> None:
        await asyncio.sleep(self.feedback_delay_s)
        body = feedback_for(answer, outcome).model_dump_json().encode()
        if await send_surely(self.producer, self.topics.feedback, body, answer.query_id.encode(), self.report):
            self.report.feedback_sent += 1


class GcPauses:
    """A ``gc.callbacks`` entry that appends each collection's duration (ms) to a list: a load generator's own
    pauses delay the answers it reads, and so count in the latencies it measures."""

    def __init__(self, pauses_ms: list[float]):
        self.pauses_ms, self.started = pauses_ms, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.pauses_ms.append(1000 * (time.perf_counter() - self.started))


class BrokerUnreachable(RuntimeError):
    """No Kafka broker answers at the configured address."""


async def probe_broker(settings: Settings) -> None:
    """Connect to the broker once; :class:`BrokerUnreachable` with what to do when none answers."""
    from aiokafka.errors import KafkaConnectionError

    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap, request_timeout_ms=5000)
    quiet = logging.getLogger("aiokafka")
    level, quiet.level = quiet.level, logging.CRITICAL  # its own "Unable connect" line would precede ours
    try:
        await producer.start()
    except (KafkaConnectionError, OSError):
        raise BrokerUnreachable(
            f"no Kafka broker answers at {settings.kafka.bootstrap}: start the service with `rlens up` (it prints the address to use), "
            "or point RLENS_KAFKA_BOOTSTRAP at a running one"
        ) from None
    finally:
        quiet.setLevel(level)
        await producer.stop()


def new_run_id() -> str:
    return uuid.uuid4().hex[:8]


class TrafficError(ValueError):
    """The traffic to play cannot be read (a dataset or a task file), in one line."""


def traffic_of(data: Path, tasks: str | None, limit: int | None) -> tuple[str, list[tuple[Query, Outcome]]]:
    """(name, traffic): open-ended ``tasks`` (a JSON-lines task file, or ``zoo``: the zoo's generation stream, 8
    blocks of 50 with task switches), else the multiple-choice questions of the dataset ``data``; the first ``limit``."""
    from rlens.records.dataset import load_dataset
    from rlens.records.recorded import DatasetError
    from rlens.rlae.tasks import TaskFileError, read_tasks
    from rlens.zoo.record import QUESTIONS_FILE, read_questions
    from rlens.zoo.tasks import GENERATION_FAMILIES, generation_stream

    if tasks is not None:
        try:
            open_ended = (
                generation_stream(GENERATION_FAMILIES, 8, 50, seed=7) if tasks == "zoo" else read_tasks(Path(tasks))
            )
        except TaskFileError as exc:
            raise TrafficError(str(exc)) from None
        name = "zoo generation stream" if tasks == "zoo" else tasks
        return name, open_ended_queries(open_ended, new_run_id())[:limit]
    try:
        dataset = load_dataset(data)
    except DatasetError as exc:
        raise TrafficError(str(exc)) from None
    questions = data / QUESTIONS_FILE
    prompts = [(q.prompt, q.choices) for q in read_questions(questions)] if questions.is_file() else None
    return dataset.name, queries_of(dataset, prompts, new_run_id())[:limit]
