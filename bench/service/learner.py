"""The learner's sustained joins per second, without Kafka: experience + feedback pairs through ``LearnerCore``
(parsing, token check, shape check, the join, the Redis window updates on a real redis-server in pipelined
batches of 256, MAPPO every 64 explored answers,
the signed policy of each update encoded as JSON), with a given number of torch threads.

    python -m bench.service.learner [--pairs 3200] [--threads 1 2] [--out bench/out/learner.json]
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import torch
from redis.asyncio import Redis

from bench.common.machine import cpu_name
from bench.common.args import add_out, arguments, write_json
from bench.common.stacks import uniform_experience
from rlens.checkpoint import CheckpointStore
from rlens.focal.engine import FocalEngine
from rlens.messages import Experience, Feedback
from rlens.service.learner.core import LearnerCore
from rlens.local.servers import LocalRedis
from rlens.service.learner.online import FocalOnlineTrainer
from rlens.service.common.security import FeedbackTokens, PolicySigner, generate_secrets
from rlens.service.common.windows import RedisWindows


class Record:
    def __init__(self, topic: str, offset: int, value: bytes):
        self.topic, self.partition, self.offset, self.key, self.value, self.timestamp = (
            topic,
            0,
            offset,
            b"k",
            value,
            int(time.time() * 1000),
        )


def pairs(n: int, tokens: FeedbackTokens) -> tuple[list[bytes], list[bytes]]:
    template = uniform_experience(explored=True)
    experience = [
        template.model_copy(update={"query_id": f"q{i}", "stream": f"s{i % 1000}"}).model_dump_json().encode()
        for i in range(n)
    ]
    feedback = [
        Feedback(query_id=f"q{i}", token=tokens.token(f"q{i}", f"s{i % 1000}"), label=i % 4).model_dump_json().encode()
        for i in range(n)
    ]
    return experience, feedback


async def joins_per_second(redis_url: str, n: int) -> float:
    secrets = generate_secrets()
    signer, tokens = PolicySigner(secrets["RLENS_POLICY_SIGNING_KEY"]), FeedbackTokens(secrets["RLENS_FEEDBACK_SECRET"])
    models = [f"m{i}" for i in range(5)]
    engine = FocalEngine(5, seed=0)
    core = LearnerCore(
        FocalOnlineTrainer(engine, models),
        models,
        RedisWindows(Redis.from_url(redis_url), 5, 128, calibration_rows=engine.cfg.calibration_rows),
        CheckpointStore(Path(tempfile.mkdtemp())),
        signer,
        tokens,
    )
    experience, feedback = pairs(n, tokens)
    start = time.perf_counter()
    for i in range(n):
        await core.on_experience(
            Experience.model_validate_json(experience[i]), Record("rlens.experience", i, experience[i])
        )
        policy, _ = await core.on_feedback(
            Feedback.model_validate_json(feedback[i]), Record("rlens.feedback", i, feedback[i])
        )
        if policy is not None:
            policy.model_dump_json()
    await core.apply_windows()  # what the app does after each batch of records (the core applies every 256 on its own)
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--pairs", type=int, default=3200)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    add_out(parser, "bench/out/learner.json")
    args = parser.parse_args()
    server = LocalRedis()
    results = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "load_1min": os.getloadavg()[0],
        "pairs": args.pairs,
        "joins_per_s": {},
    }
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            results["joins_per_s"][threads] = round(asyncio.run(joins_per_second(server.url, args.pairs)))
            print(f"{threads} torch thread(s): {results['joins_per_s'][threads]} joins/s", flush=True)
    finally:
        server.stop()
    write_json(
        args.out,
        results,
    )


if __name__ == "__main__":
    main()
