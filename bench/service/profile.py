"""Where the worker's and the learner's time goes at full speed: py-spy samples, grouped by stage.

    python -m bench.service.profile [--queries N] [--rate HZ] [--kafka BOOTSTRAP] [--out bench/out/profile]

On the local stack (tansu, or the Apache Kafka at ``--kafka`` on topics of its own; redis-server; the bundled stream
on ``replay`` backends, as :mod:`bench.service.stack`):
1. Worker: N queries are pre-filled in ``queries``; one worker starts (cold windows, a fresh policy) and answers
   the backlog while ``py-spy`` samples it (``--idle``: time spent waiting on the broker or Redis counts too).
2. Learner: the N answers' feedback (the label, with each answer's token) is pre-filled in ``feedback``; the learner
   starts and joins the N experience records with their feedback (windows applied to Redis, online updates) while
   ``py-spy`` samples it. Joins/s from the learner's readiness to its N-th join (its ``/metrics``).
3. Worker again, on N new queries, now with the windows full and the learner's policy (the steady state); the
   learner is stopped first, so that it does not compete for the cores.

Besides the rates, each phase reports the process's CPU milliseconds per query (or join), from /proc: a cost that
moves less than the rates with what else the machine runs.

Idle threads of a thread pool are left out. A sample whose innermost frame is the event loop's wait is idle; any
other goes to the stage of its innermost frame that names one (:data:`WORKER_STAGES`, :data:`LEARNER_STAGES`), else
to that of its innermost frame in :data:`FALLBACK_STAGES`; the rest is "other". Writes ``<role>.txt`` (py-spy's
collapsed stacks: open them in speedscope or flamegraph.pl), ``profile.json`` (shares and rates) and
``profile.png`` (the breakdown). Needs ``py-spy`` (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

from aiokafka import AIOKafkaConsumer

from bench.service.stack import count_answers, prefill
from bench.common.machine import machine_facts
from bench.common.stacks import learner_joined, replay_stack
from bench.common.args import add_out, arguments, write_json
from rlens.records.dataset import load_dataset
from rlens.messages import Answer, Query
from rlens.service.common.kafka import Topics
from rlens.local.load import feedback_for, queries_of
from rlens.local.stack import LocalStack
from rlens.settings import settings

IDLE_STAGE, IDLE = (
    "idle (waiting on the broker or Redis)",
    # the event loop's wait: Python's selector, or uvloop's (its C loop leaves ``Runner.run`` the innermost frame)
    re.compile(r"^(\w*\.?select \(selectors|BaseEventLoop\._run_once \(|Runner\.run \(asyncio/runners)"),
)
THREAD_WAIT = re.compile(
    r"^(Condition\.wait|Event\.wait|Queue\.get|_worker) \((threading|queue|concurrent/futures/thread)"
)
# (stage, pattern on a frame "function (file:line)"): a sample goes to the stage of its innermost matching frame
COMMON_STAGES = [
    ("metrics (prometheus-client)", r"prometheus_client/|\.count \(rlens/service/worker"),
    ("parse messages (pydantic)", r"(^|\.)parse_or_dead_letter \("),
    ("encode messages (pydantic)", r"(^|\.)model_dump_json \("),
    (
        "publish (aiokafka send, wait for acks)",
        r"^(publish|publish_batch|publish_dead_letters) \(rlens/service/common/kafka|\.reply \(rlens/service/worker",
    ),
    ("Redis round trips (redis-py)", r"redis/asyncio/|redis/_parsers/"),
    ("aiokafka (fetch, produce, commit)", r"aiokafka/"),
]
# where no stage above matches any frame: the innermost of these
FALLBACK_STAGES = [
    ("other rlens code", r"\(rlens/"),
    ("FastStream dispatch", r"faststream/|fast_depends/"),
    ("asyncio (sockets, callbacks)", r"\._run_once \(asyncio/base_events"),
]
WORKER_STAGES = [
    ("window read: rows from JSON", r"\.(_windows|_parse_row) \(rlens/service/common/windows"),
    ("Decider (observation + forward)", r"(^|\.)decide_batch \("),
    ("pool call (replay backends)", r"(^|\.)ask_batch \("),
    ("Fusion (observations + forward)", r"(^|\.)fuse_batch \("),
    ("calibrated votes and evidence (OPE log)", r"^(evidence|shadow_pools) \(rlens/focal|\.calibrated_rows \("),
    ("build answers and experience", r"(^|\.)_outputs \("),
    *COMMON_STAGES,
]
LEARNER_STAGES = [
    ("online update (MAPPO or PPO)", r"\.update \(rlens/service/learner"),
    ("checkpoint", r"\.checkpoint \(rlens/service/learner"),
    ("drift detection (river)", r"river/|\._observe_drift \("),
    ("join (experience + feedback)", r"(^|\.)_join \("),
    *COMMON_STAGES,
]


def breakdown(collapsed: Path, stages: list[tuple[str, str]]) -> dict[str, float]:
    """Share of samples per stage, from py-spy's raw (collapsed) output: one ``frame;frame;...;leaf count`` per line."""
    passes = [[(name, re.compile(pattern)) for name, pattern in group] for group in (stages, FALLBACK_STAGES)]
    counts: Counter[str] = Counter()
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue  # not a "stack count" line
        frames = stack.split(";")
        if frames and frames[0].startswith("thread ("):
            frames = frames[1:]
        if frames[0].startswith("Thread._bootstrap") and THREAD_WAIT.search(frames[-1]):
            continue  # an idle thread of a pool (asyncio.to_thread): not the process's time
        if IDLE.search(frames[-1]):
            stage = IDLE_STAGE
        else:
            stage = next(
                (
                    name
                    for compiled in passes
                    for frame in reversed(frames)
                    for name, pattern in compiled
                    if pattern.search(frame)
                ),
                "other",
            )
        counts[stage] += int(n)
    total = sum(counts.values()) or 1
    return {
        name: counts[name] / total
        for name, _ in [*stages, *FALLBACK_STAGES, ("other", ""), (IDLE_STAGE, "")]
        if counts[name]
    }


class Sampler:
    """``py-spy record`` on one process until :meth:`stop` (py-spy writes its file when interrupted)."""

    def __init__(self, pid: int, out: Path, rate: int):
        self.out = out
        self.process = subprocess.Popen(
            [
                "py-spy",
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(rate),
                "--format",
                "raw",
                "--idle",
                "--nonblocking",
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def stop(self) -> Path:
        self.process.send_signal(signal.SIGINT)
        _, err = self.process.communicate(timeout=60)
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
        return self.out


async def read_answers(bootstrap: str, topic: str, n: int, timeout_s: float = 120) -> list[Answer]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest", fetch_max_wait_ms=20
    )
    await consumer.start()
    answers: dict[str, Answer] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(answers) < n and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for r in records:
                    answer = Answer.model_validate_json(r.value)
                    answers[answer.query_id] = answer
    finally:
        await consumer.stop()
    return list(answers.values())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = [role for role in results if isinstance(results[role], dict)]
    fig, axes = plt.subplots(1, len(roles), figsize=(6.5 * len(roles), 5))
    for ax, role in zip(axes, roles):
        shares = results[role]["shares"]
        names = list(shares)[::-1]
        ax.barh(names, [100 * shares[n] for n in names], color="tab:orange" if role == "learner" else "tab:blue")
        ax.set_xlabel("% of samples")
        ax.set_title(f"{role}: {results[role]['per_s']:.0f} {results[role]['unit']}/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def profile_worker(stack: LocalStack, queries: list[Query], out: Path, rate: int) -> dict:
    """Pre-fill ``queries``, start a worker (the previous one stops first) and sample it until all are answered."""
    for worker in list(stack.workers):  # a graceful stop: it commits and leaves the group
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        stack.workers.remove(worker)
    topics = Topics.from_settings(stack.settings)
    asyncio.run(
        prefill(stack.settings.kafka.bootstrap, topics.queries, [q.model_dump_json().encode() for q in queries])
    )
    worker = stack.start_worker()
    stack.wait_ready(120)  # the import and the group join are not sampled
    sampler, cpu = Sampler(worker.pid, out, rate), cpu_seconds(worker.pid)
    per_s = asyncio.run(
        count_answers(
            stack.settings.kafka.bootstrap, topics.answers, len(queries), queries[0].query_id.split("-")[0].encode()
        )
    )
    cpu_ms = 1000 * (cpu_seconds(worker.pid) - cpu) / len(queries)
    print(f"{out.stem}: {per_s:.0f} queries/s, {cpu_ms:.3f} CPU ms per query", flush=True)
    return {
        "per_s": per_s,
        "unit": "queries",
        "cpu_ms_each": cpu_ms,
        "shares": breakdown(sampler.stop(), WORKER_STAGES),
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--queries", type=int, default=20000)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--kafka", default=None, help="bootstrap of an Apache Kafka broker to run on (default: tansu)")
    add_out(parser, "bench/out/profile")
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        parser.error('py-spy not found: pip install -e ".[bench]" (or pip install py-spy)')
    print(f"machine: {machine_facts()}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    data = settings().service.demo_data
    dataset = load_dataset(data)
    stream = queries_of(dataset, None, "profile")
    traffic = [
        (stream[i % len(stream)][0].model_copy(update={"query_id": f"profile-{i}"}), stream[i % len(stream)][1])
        for i in range(args.queries)
    ]
    labels = {q.query_id: label for q, label in traffic}
    stack = replay_stack(args.out / "stack", kafka=args.kafka)
    topics = Topics.from_settings(stack.settings)
    bootstrap = stack.settings.kafka.bootstrap
    broker = f"Apache Kafka at {args.kafka}" if args.kafka else "tansu (memory storage)"
    results: dict = {"machine": machine_facts(), "broker": broker, "queries": args.queries, "sample_rate_hz": args.rate}
    try:
        results["worker"] = profile_worker(stack, [q for q, _ in traffic], args.out / "worker.txt", args.rate)
        answers = asyncio.run(read_answers(bootstrap, topics.answers, args.queries))
        asyncio.run(
            prefill(
                bootstrap,
                topics.feedback,
                [feedback_for(a, labels[a.query_id]).model_dump_json().encode() for a in answers],
            )
        )
        learner = stack.start_learner()
        stack.wait_ready(120)
        url = next(u for name, u in stack.http_urls().items() if name.endswith(f"-{learner.pid}"))
        sampler, cpu = Sampler(learner.pid, args.out / "learner.txt", args.rate), cpu_seconds(learner.pid)
        started, deadline, before = time.perf_counter(), time.monotonic() + 600, learner_joined(url)
        while (joined := learner_joined(url)) < len(answers) and time.monotonic() < deadline:
            time.sleep(0.2)
        elapsed = time.perf_counter() - started
        per_s, cpu_ms = (joined - before) / elapsed, 1000 * (cpu_seconds(learner.pid) - cpu) / max(joined - before, 1)
        results["learner"] = {
            "per_s": per_s,
            "unit": "joins",
            "joined": joined,
            "cpu_ms_each": cpu_ms,
            "shares": breakdown(sampler.stop(), LEARNER_STAGES),
        }
        print(
            f"learner: {joined:.0f} joined, {per_s:.0f} joins/s while sampled, {cpu_ms:.3f} CPU ms per join", flush=True
        )
        learner.send_signal(signal.SIGTERM)  # the windows stay in Redis; the learner would compete with the next worker
        learner.wait(60)
        stack.learner = None
        warm = [q.model_copy(update={"query_id": f"warm-{q.query_id}"}) for q, _ in traffic]
        results["worker, warm windows"] = profile_worker(stack, warm, args.out / "worker-warm.txt", args.rate)
    finally:
        stack.stop()
    for role in [role for role in results if isinstance(results[role], dict)]:
        print(f"\n{role}, share of samples:")
        for name, share in results[role]["shares"].items():
            print(f"  {100 * share:5.1f} %  {name}")
    write_json(
        args.out / "profile.json",
        results,
    )
    plot(results, args.out / "profile.png")


if __name__ == "__main__":
    main()
