"""What a running local stack is doing, sampled every few seconds from its processes' ``/metrics`` and /proc: the
worker's answers, the learner's reads, joins and pending halves, and each process's share of a core (the service
benchmarks' timelines: does the learner keep up, and who takes the cores while a backlog grows)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common.machine import cpu_seconds
from rlens.local.stack import LocalStack


def scrape(url: str) -> dict[str, float]:
    """Every sample of a process's /metrics summed over its labels except ``kind`` and ``outcome``:
    {name, or name{kind or outcome}: value}."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kept = [sample.labels[label] for label in ("kind", "outcome") if label in sample.labels]
            key = f"{sample.name}{{{kept[0]}}}" if kept else sample.name
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def stack_pids(stack: LocalStack) -> dict[str, list[int]]:
    """The processes of ``stack`` by role; the broker also when it is an external Apache Kafka started by
    ``infra/kafka/kafka.sh`` (its pid files under ``RLENS_KAFKA_RUN``)."""
    pids = {
        "worker": [w.pid for w in stack.workers],
        "learner": [stack.learner.pid] if stack.learner else [],
        "redis": [stack.redis.process.pid] if stack.redis else [],
    }
    if stack.broker:
        pids["broker"] = [stack.broker.process.pid]
    else:
        run = Path(os.environ.get("RLENS_KAFKA_RUN", "/tmp/rlens-kafka"))
        pids["broker"] = [int(p.read_text()) for p in run.glob("node-*/pid")]
    return pids


def sample_stack(stack: LocalStack, feedback_sent: Callable[[], int]) -> dict:
    """One sample: the workers' answers, the learner's records read (experience, feedback), joins, pending halves
    and policy version, and the lags (answers not yet read by the learner as experience; ``feedback_sent()``
    not yet read)."""
    urls = stack.http_urls()
    answers = sum(scrape(url).get("rlens_worker_answers_total", 0.0) for name, url in urls.items() if "worker" in name)
    learner = next((scrape(url) for name, url in urls.items() if name.startswith("learner")), {})
    row = {
        "answers": answers,
        "feedback_sent": feedback_sent(),
        "experience_read": learner.get("rlens_learner_records_total{experience}", 0.0),
        "feedback_read": learner.get("rlens_learner_records_total{feedback}", 0.0),
        "pending": learner.get("rlens_learner_pending{experience}", 0.0)
        + learner.get("rlens_learner_pending{feedback}", 0.0),
        "joined": learner.get("rlens_learner_joined_total", 0.0),
        "updates": learner.get("rlens_learner_updates_total{applied}", 0.0),
        "policy_version": learner.get("rlens_learner_policy_version", 0.0),
    }
    row["experience_lag"] = row["answers"] - row["experience_read"]
    row["feedback_lag"] = row["feedback_sent"] - row["feedback_read"]
    return row


class StackSampler:
    """Samples ``stack`` every ``every_s`` seconds on a thread (:func:`sample_stack` and each role's share of a core
    since the last sample) into ``rows``, printing each; ``with`` starts and stops it."""

    def __init__(self, stack: LocalStack, feedback_sent: Callable[[], int], every_s: float = 10.0) -> None:
        self.stack, self.feedback_sent, self.every_s = stack, feedback_sent, every_s
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        pids = stack_pids(self.stack) | {"load": [os.getpid()]}  # the load generator: this process
        start = time.monotonic()
        cpu, last = {role: cpu_seconds(p) for role, p in pids.items()}, start
        while not self._stop.wait(self.every_s):
            row = {"t": round(time.monotonic() - start, 1), **sample_stack(self.stack, self.feedback_sent)}
            now, at = {role: cpu_seconds(p) for role, p in pids.items()}, time.monotonic()
            row["cpu_share"] = {role: round((now[role] - cpu[role]) / (at - last), 2) for role in pids}
            cpu, last = now, at
            self.rows.append(row)
            print(row, flush=True)


def wait_for_learner(stack: LocalStack, feedback_sent: int, timeout_s: float, within: int = 100) -> float | None:
    """Seconds until the learner has read all but ``within`` of the workers' experience and of ``feedback_sent``
    feedback records (it catches up on a backlog); None when it has not within ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        row = sample_stack(stack, lambda: feedback_sent)
        if row["experience_lag"] <= within and row["feedback_lag"] <= within:
            return time.monotonic() - start
        time.sleep(1.0)
    return None
