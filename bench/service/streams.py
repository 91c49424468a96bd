"""A million stream keys: what one stream costs in Redis and in the learner, and how long a lookup takes, as the
number of streams grows (issue 58's target: flat within 10 % from 10,000 to 1,000,000).

    python -m bench.service.streams [--steps 10000 100000 1000000] [--rounds 10] [--out bench/out/streams.json]

Each step (a number of streams) gets a redis-server of its own (no persistence), filled first: every stream with
``--outcomes`` outcomes written through the learner's path (``RedisWindows.apply_many``: the window row, the
once-per-query marker, each called model's calibration row and the joint row, 256 outcomes a pipeline) and published
fits (those of a stream with 64 labelled queries, as the learner's refit saves them); what the fill grew
``used_memory`` and the key count by, per stream. Then ``--rounds`` rounds, each visiting every step, in an order
that rotates from round to round, so that what the machine does meanwhile falls on every step alike:

* the worker's read of a batch of 32 random streams (each window, last pool and published fits: one
  ``load_with_pools`` round trip), ``--batches`` times; beside it, alternated, the same read with an empty cache of
  restored calibrations (the worker keeps the newest 1,024 streams': among 10,000 random streams some hit, among
  1,000,000 almost none) and the round trip alone (nothing restored); then the learner's write of 256 outcomes to
  random streams (``apply_many``);
* ``--joins`` learner joins (a ``LearnerCore`` per step, experience + feedback with behaviour: windows, calibration
  rows, drift, the dashboard) on random streams of the step; their per-stream parts (drift detectors, dashboard
  series, calibration bookkeeping) are bounded by count.

p50 and p99 over every round; the learners' joins a second, the median over the rounds; the process's resident
memory at the end (the three learners' cores).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from redis.asyncio import Redis

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import machine_facts, rss_mb
from bench.common.stacks import uniform_experience
from bench.service.learner import Record
from rlens.checkpoint import CheckpointStore
from rlens.focal.engine import FocalEngine
from rlens.local.servers import LocalRedis
from rlens.messages import Feedback
from rlens.service.common.security import FeedbackTokens, PolicySigner, generate_secrets
from rlens.service.common.windows import CalibrationRows, RedisWindows
from rlens.service.learner.core import LearnerCore
from rlens.service.learner.online import FocalOnlineTrainer

MODELS = 5
CHOICES = 4
BATCH = 256  # outcomes a pipeline, as the learner writes them


def outcome(stream: str, query_id: str, rng: random.Random) -> tuple:
    """One outcome as the learner queues it: the row and the called models' calibration rows."""
    label = rng.randrange(CHOICES)
    called = sorted(rng.sample(range(MODELS), 3))
    log_probs = {m: [round(float(v), 6) for v in np.log(rng_probs(rng))] for m in called}
    rows = CalibrationRows(CHOICES, label, log_probs, tuple(called))
    predictions = [rng.randrange(CHOICES) if m in called else -1 for m in range(MODELS)]
    return (stream, query_id, predictions, label, rng.choice([1.0, -1.0]), rows)


def rng_probs(rng: random.Random) -> list[float]:
    values = [rng.random() + 0.05 for _ in range(CHOICES)]
    return [v / sum(values) for v in values]


async def fitted_state(windows: RedisWindows, rng: random.Random) -> str:
    """The published fits of a stream with 64 labelled queries (every model fitted), as the learner saves them: what
    each stream gets (a refit per stream would cost the fill 30 ms a stream)."""
    await windows.apply_many([outcome("template", f"t{k}", rng) for k in range(64)])
    calibration = await windows.load_calibration("template", joint=True)
    calibration.fit_all()
    return json.dumps(calibration.state(), separators=(",", ":"))


async def add_streams(
    windows: RedisWindows, start: int, stop: int, outcomes: int, fits: str, rng: random.Random
) -> None:
    """Streams ``start`` .. ``stop - 1``, each with ``outcomes`` outcomes and published fits."""
    queue: list[tuple] = []
    for s in range(start, stop):
        queue += [outcome(f"s{s}", f"q{s}-{k}", rng) for k in range(outcomes)]
        if len(queue) >= BATCH:
            await windows.apply_many(queue)
            queue = []
    if queue:
        await windows.apply_many(queue)
    for first in range(start, stop, 1000):
        async with windows.redis.pipeline(transaction=False) as pipe:
            for s in range(first, min(first + 1000, stop)):
                pipe.set(windows.fit_key(f"s{s}"), fits, ex=windows.window_ttl_s)
            await pipe.execute()


@dataclass
class Step:
    """One number of streams, in a redis-server of its own, with a learner's core over it, and what was measured."""

    streams: int
    windows: RedisWindows
    core: LearnerCore
    row: dict = field(default_factory=dict)
    reads: dict[str, list[float]] = field(default_factory=lambda: {"read": [], "cold": [], "redis": []})
    writes: list[float] = field(default_factory=list)
    joins_per_s: list[float] = field(default_factory=list)


async def lookups(step: Step, batches: int, rng: random.Random) -> None:
    """Per batch of 32 random streams, alternately: the worker's read (``load_with_pools``, its cache of restored
    calibrations warm from the batches before), the same with an empty cache (a fresh ``RedisWindows``: every
    stream's fits parsed), and the round trip alone (the same commands in one pipeline, nothing restored); then
    ``batches // 6`` writes of 256 outcomes."""
    windows = step.windows
    for i in range(batches):
        batch = [f"s{rng.randrange(step.streams)}" for _ in range(32)]
        kinds = list(step.reads)
        for kind in kinds[i % 3 :] + kinds[: i % 3]:  # the order rotates from batch to batch
            reader = windows if kind != "cold" else RedisWindows(windows.redis, MODELS, 128, calibration_rows=200)
            started = time.perf_counter()
            if kind == "redis":
                async with windows.redis.pipeline(transaction=False) as pipe:
                    for stream in batch:
                        pipe.lrange(windows.window_key(stream), 0, -1)
                        pipe.get(windows.pool_key(stream))
                        pipe.get(windows.fit_key(stream))
                    await pipe.execute()
            else:
                await reader.load_with_pools(batch, pools=True, fits=True)
            step.reads[kind].append(time.perf_counter() - started)
    for i in range(max(1, batches // 6)):
        queued = [outcome(f"s{rng.randrange(step.streams)}", f"w{len(step.writes)}-{k}", rng) for k in range(BATCH)]
        started = time.perf_counter()
        await windows.apply_many(queued)
        step.writes.append(time.perf_counter() - started)


async def learner_joins(step: Step, tokens: FeedbackTokens, n: int, rng: random.Random) -> None:
    """``n`` joins on random streams among the step's; their rate."""
    templates = [uniform_experience(explored=e, behaviour=True) for e in (False, True)]
    first = len(step.joins_per_s) * n
    started = time.perf_counter()
    for i in range(first, first + n):
        qid, stream = f"j{i}", f"s{rng.randrange(step.streams)}"
        experience = templates[i % 20 == 0].model_copy(update={"query_id": qid, "stream": stream})
        await step.core.on_experience(experience, Record("rlens.experience", i, b"x" * 2500))
        feedback = Feedback(query_id=qid, token=tokens.token(qid, stream), label=rng.randrange(CHOICES))
        await step.core.on_feedback(feedback, Record("rlens.feedback", i, b"x" * 180))
        if i % BATCH == BATCH - 1:
            await step.core.apply_windows()
    await step.core.apply_windows()
    step.joins_per_s.append(n / (time.perf_counter() - started))


def learner_core(url: str, secrets: dict[str, str], tokens: FeedbackTokens) -> LearnerCore:
    models = [f"m{i}" for i in range(MODELS)]
    return LearnerCore(
        FocalOnlineTrainer(FocalEngine(MODELS, seed=0), models),
        models,
        RedisWindows(Redis.from_url(url), MODELS, 128, calibration_rows=200, joint_rows=4000),
        CheckpointStore(Path(tempfile.mkdtemp())),
        PolicySigner(secrets["RLENS_POLICY_SIGNING_KEY"]),
        tokens,
    )


def ms_at(values: list[float], q: float = 50) -> float:
    return round(1000 * float(np.percentile(values, q)), 3)


async def measure(servers: dict[int, LocalRedis], outcomes: int, rounds: int, batches: int, joins: int) -> list[dict]:
    """Fill each step's Redis, then ``rounds`` rounds, each visiting every step in a rotating order (so what the
    machine does meanwhile falls on every step alike)."""
    rng = random.Random(0)
    secrets = generate_secrets()
    tokens = FeedbackTokens(secrets["RLENS_FEEDBACK_SECRET"])
    steps = [
        Step(
            streams,
            RedisWindows(Redis.from_url(server.url), MODELS, 128, calibration_rows=200, joint_rows=4000),
            learner_core(server.url, secrets, tokens),
        )
        for streams, server in servers.items()
    ]
    for step in steps:
        redis = step.windows.redis
        fits = await fitted_state(step.windows, rng)
        started = time.perf_counter()
        memory, keys = (await redis.info("memory"))["used_memory"], await redis.dbsize()
        await add_streams(step.windows, 0, step.streams, outcomes, fits, rng)
        step.row = {
            "streams": step.streams,
            "fill_s": round(time.perf_counter() - started, 1),
            "redis_bytes_per_stream": round(((await redis.info("memory"))["used_memory"] - memory) / step.streams),
            "redis_keys_per_stream": round((await redis.dbsize() - keys) / step.streams, 2),
        }
        print(step.row, flush=True)
    for r in range(rounds):
        for step in steps[r % len(steps) :] + steps[: r % len(steps)]:
            await lookups(step, batches, rng)
            await learner_joins(step, tokens, joins, rng)
        print(
            f"round {r + 1} of {rounds}: read p50 " + " / ".join(f"{ms_at(s.reads['read'])}" for s in steps), flush=True
        )
    for step in steps:
        step.row |= {
            "read_32_streams_ms_p50": ms_at(step.reads["read"]),
            "read_32_streams_ms_p99": ms_at(step.reads["read"], 99),
            "read_32_streams_cold_ms_p50": ms_at(step.reads["cold"]),
            "redis_round_trip_32_streams_ms_p50": ms_at(step.reads["redis"]),
            "write_256_outcomes_ms_p50": ms_at(step.writes),
            "learner_joins_per_s": round(float(np.median(step.joins_per_s))),
        }
        await step.windows.redis.aclose()
    return [step.row for step in steps]


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--steps", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--outcomes", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10, help="rounds over the steps, each in a rotated order")
    parser.add_argument("--batches", type=int, default=30, help="reads of 32 streams a step a round")
    parser.add_argument("--joins", type=int, default=500, help="learner joins a step a round")
    add_out(parser, "bench/out/streams.json")
    args = parser.parse_args()
    servers: dict[int, LocalRedis] = {}
    try:
        for streams in args.steps:
            servers[streams] = LocalRedis()
        rows = asyncio.run(measure(servers, args.outcomes, args.rounds, args.batches, args.joins))
    finally:
        for server in servers.values():
            server.stop()
    first = rows[0]
    for row in rows:
        for name in (
            "redis_bytes_per_stream",
            "read_32_streams_ms_p50",
            "read_32_streams_cold_ms_p50",
            "redis_round_trip_32_streams_ms_p50",
            "write_256_outcomes_ms_p50",
        ):
            row[f"{name}_to_the_first"] = round(row[name] / first[name], 2)
    write_json(
        args.out,
        {
            "machine": machine_facts(),
            "load_1min": os.getloadavg()[0],
            "outcomes_per_stream": args.outcomes,
            "learner_rss_mb": round(rss_mb(os.getpid())),
            "steps": rows,
        },
    )


if __name__ == "__main__":
    main()
