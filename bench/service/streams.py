"""A million stream keys: what one stream costs in Redis and in the learner, and how long a lookup takes, as the
number of streams grows (issue 58's target: flat within 10 % from 10,000 to 1,000,000).

    python -m bench.service.streams [--steps 10000 100000 1000000] [--outcomes 1] [--out bench/out/streams.json]

A redis-server of its own (no persistence). Streams are added up to each step, each with ``--outcomes`` outcomes
written through the learner's path (``RedisWindows.apply_many``: the window row, the once-per-query marker, each
called model's calibration row and the joint row, 256 outcomes a pipeline) and published fits (those of a stream
with 64 labelled queries, as the learner's refit saves them). At each step:

* Redis: what the streams added at the step grew ``used_memory`` and the key count by, per stream;
* the worker's read of a batch of 32 random streams (each window, last pool and published fits: one
  ``load_with_pools`` round trip), p50 and p99 over 300 batches; beside it, alternated, the same read with an empty
  cache of restored calibrations (the worker keeps the newest 1,024 streams': among 10,000 random streams some hit,
  among 1,000,000 almost none) and the round trip alone (nothing restored); and the learner's write of 256 outcomes
  to random streams (``apply_many``), p50 over 50 pipelines;
* the learner: 5,000 joins (``LearnerCore``, experience + feedback with behaviour: windows, calibration rows,
  drift, the dashboard) on random streams among all, its joins per second and its resident memory, whose
  per-stream parts (drift detectors, dashboard series, calibration bookkeeping) are bounded by count.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time
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


async def lookups(windows: RedisWindows, streams: int, rng: random.Random) -> dict:
    """Per batch of 32 random streams, alternately: the worker's read (``load_with_pools``, its cache of restored
    calibrations warm from the batches before), the same with an empty cache (a fresh ``RedisWindows``: every
    stream's fits parsed), and the round trip alone (the same commands in one pipeline, nothing restored)."""
    reads: dict[str, list[float]] = {"read": [], "cold": [], "redis": []}
    for i in range(300):
        batch = [f"s{rng.randrange(streams)}" for _ in range(32)]
        kinds = list(reads)
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
            reads[kind].append(time.perf_counter() - started)
    writes = []
    for i in range(50):
        batch = [outcome(f"s{rng.randrange(streams)}", f"w{streams}-{i}-{k}", rng) for k in range(BATCH)]
        started = time.perf_counter()
        await windows.apply_many(batch)
        writes.append(time.perf_counter() - started)
    return {
        "read_32_streams_ms_p50": round(1000 * float(np.percentile(reads["read"], 50)), 3),
        "read_32_streams_ms_p99": round(1000 * float(np.percentile(reads["read"], 99)), 3),
        "read_32_streams_cold_ms_p50": round(1000 * float(np.percentile(reads["cold"], 50)), 3),
        "redis_round_trip_32_streams_ms_p50": round(1000 * float(np.percentile(reads["redis"], 50)), 3),
        "write_256_outcomes_ms_p50": round(1000 * float(np.percentile(writes, 50)), 3),
    }


async def learner_joins(core: LearnerCore, tokens: FeedbackTokens, streams: int, n: int, rng: random.Random) -> float:
    """``n`` joins on random streams among ``streams``; joins per second."""
    templates = [uniform_experience(explored=e, behaviour=True) for e in (False, True)]
    started = time.perf_counter()
    for i in range(n):
        qid, stream = f"j{streams}-{i}", f"s{rng.randrange(streams)}"
        experience = templates[i % 20 == 0].model_copy(update={"query_id": qid, "stream": stream})
        await core.on_experience(experience, Record("rlens.experience", i, b"x" * 2500))
        feedback = Feedback(query_id=qid, token=tokens.token(qid, stream), label=rng.randrange(CHOICES))
        await core.on_feedback(feedback, Record("rlens.feedback", i, b"x" * 180))
        if i % BATCH == BATCH - 1:
            await core.apply_windows()
    await core.apply_windows()
    return n / (time.perf_counter() - started)


async def measure(url: str, steps: list[int], outcomes: int, joins: int) -> list[dict]:
    rng = random.Random(0)
    redis = Redis.from_url(url)
    engine = FocalEngine(MODELS, seed=0)
    windows = RedisWindows(redis, MODELS, 128, calibration_rows=200, joint_rows=4000)
    secrets = generate_secrets()
    tokens = FeedbackTokens(secrets["RLENS_FEEDBACK_SECRET"])
    models = [f"m{i}" for i in range(MODELS)]
    core = LearnerCore(
        FocalOnlineTrainer(engine, models),
        models,
        RedisWindows(Redis.from_url(url), MODELS, 128, calibration_rows=200, joint_rows=4000),
        CheckpointStore(Path(tempfile.mkdtemp())),
        PolicySigner(secrets["RLENS_POLICY_SIGNING_KEY"]),
        tokens,
    )
    fits = await fitted_state(windows, rng)
    rows, added = [], 0
    for step in steps:
        started = time.perf_counter()
        memory, keys = (await redis.info("memory"))["used_memory"], await redis.dbsize()
        await add_streams(windows, added, step, outcomes, fits, rng)
        memory = (await redis.info("memory"))["used_memory"] - memory
        keys = await redis.dbsize() - keys
        row = {
            "streams": step,
            "fill_s": round(time.perf_counter() - started, 1),
            # what the streams added at this step cost (the earlier steps' lookups and joins wrote to old streams)
            "redis_bytes_per_stream": round(memory / (step - added)),
            "redis_keys_per_stream": round(keys / (step - added), 2),
            **await lookups(windows, step, rng),
        }
        added = step
        row["learner_joins_per_s"] = round(await learner_joins(core, tokens, step, joins, rng))
        row["learner_rss_mb"] = round(rss_mb(os.getpid()))
        rows.append(row)
        print(row, flush=True)
    await redis.aclose()
    return rows


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--steps", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--outcomes", type=int, default=1)
    parser.add_argument("--joins", type=int, default=5000)
    add_out(parser, "bench/out/streams.json")
    args = parser.parse_args()
    server = LocalRedis()
    try:
        rows = asyncio.run(measure(server.url, args.steps, args.outcomes, args.joins))
    finally:
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
            "steps": rows,
        },
    )


if __name__ == "__main__":
    main()
