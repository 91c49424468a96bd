"""Learner shards: joins per second with 1, 2 and 4 shards on the same data, through the real path (tansu, a
redis-server, each shard a `rlens learner` process with ``RLENS_LEARNER_ROLE=shard``).

    python -m bench.service.learner_shards [--pairs 20000] [--shards 1 2 4] [--explored 0.05] [--no-behaviour]
        [--rounds 1] [--out bench/out/learner_shards.json]

For each shard count, a fresh stack (its own broker and Redis, 4 partitions, the bundled stream's 5-model pool):
``--pairs`` experience records (5 models, 4 choices, a share ``--explored`` explored, each with its behaviour: the
calibration rows and the OPE log are written; 1,000 streams) and their feedback are published first, keyed by query
id as workers and gateways key them, then the shards start and join them. Each shard's ``/metrics`` is read every
0.1 s. Reported per shard count: the total rate (pairs over the time from the first join to the last), the rate while
every shard runs (the joins of all shards between the last one's first join and the first one's last join, over that
time: what N shards join together, without the time one runs alone because it started later or had less to join),
each shard's own rate (its joins over its time from its first join to its last), and the CPU seconds of the shards, of
the broker and of Redis over the run. No trainer runs beside them: the shards' cost is the join (the token check, the shape
check, the Redis windows, calibration rows and fits, drift, the OPE log, the transitions handed on). After the first
count's shards are done, the trainer alone is started on what they handed on, and its rate reported (MAPPO every 64
explored transitions: with every query explored, an update every 64 transitions; at the default 0.05, every 1,280).
With ``--rounds`` N the shard counts are run N times, in an order that rotates from round to round, and each round's
rates are divided by the same round's first count's: the ratios round by round and their median (a shared VM's
speed drifts between runs of a few seconds each).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaProducer

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import cpu_seconds, machine_facts
from bench.common.stacks import learner_joined, replay_stack, uniform_experience
from rlens.messages import Feedback
from rlens.service.common.kafka import Topics, client_options, ensure_topics
from rlens.service.common.security import feedback_tokens
from rlens.settings import Settings


async def publish_pairs(settings: Settings, pairs: int, explored: float, behaviour: bool) -> None:
    """``pairs`` experience records (one in every 1 / ``explored`` explored; ``behaviour``: each with its logged
    behaviour), then their feedback, keyed by query id."""
    await ensure_topics(settings)
    topics, tokens = Topics.from_settings(settings), feedback_tokens(settings)
    every = max(1, round(1 / explored)) if explored > 0 else pairs + 1
    templates = [uniform_experience(explored=e, behaviour=behaviour) for e in (False, True)]
    producer = AIOKafkaProducer(**client_options(settings), linger_ms=20, max_request_size=2**20)
    await producer.start()
    try:
        for i in range(pairs):
            qid, stream = f"q{i}", f"s{i % 1000}"
            template = templates[i % every == 0]
            body = template.model_copy(update={"query_id": qid, "stream": stream}).model_dump_json().encode()
            await producer.send(topics.experience, body, key=qid.encode())
        for i in range(pairs):
            qid, stream = f"q{i}", f"s{i % 1000}"
            feedback = Feedback(query_id=qid, token=tokens.token(qid, stream), label=i % 4)
            await producer.send(topics.feedback, feedback.model_dump_json().encode(), key=qid.encode())
        await producer.flush()
    finally:
        await producer.stop()


@dataclass
class Joins:
    """What each followed process joined, and when its first and its last join were seen; ``seen``: (time, each
    one's count) at every read."""

    counts: list[float]
    first: list[float]
    last: list[float]
    seen: list[tuple[float, list[float]]] = field(default_factory=list)

    def rate(self, i: int) -> int:
        return round(self.counts[i] / max(self.last[i] - self.first[i], 0.1))

    def rate_all_running(self, least_s: float = 1.0) -> int | None:
        """All the processes' joins per second while every one of them was joining: from the last one's first join to
        the first one's last join; None when that span is under ``least_s``."""
        start, end = max(self.first), min(self.last)
        within = [(t, counts) for t, counts in self.seen if start <= t <= end]
        if end - start < least_s or len(within) < 2:
            return None
        (t0, c0), (t1, c1) = within[0], within[-1]
        return round((sum(c1) - sum(c0)) / (t1 - t0))


def follow(urls: list[str], total: int, timeout_s: float = 1800) -> Joins:
    """Each process's ``rlens_learner_joined_total`` every 0.1 s, until they have joined ``total`` in all."""
    joins = Joins([0.0] * len(urls), [math.inf] * len(urls), [0.0] * len(urls))
    deadline = time.monotonic() + timeout_s
    while sum(joins.counts) < total and time.monotonic() < deadline:
        now = time.monotonic()
        for i, url in enumerate(urls):
            joined = learner_joined(url)
            if joined > 0:
                joins.first[i] = min(joins.first[i], now)
            if joined > joins.counts[i]:
                joins.last[i], joins.counts[i] = now, joined
        joins.seen.append((now, list(joins.counts)))
        time.sleep(0.1)
    return joins


def url_of(stack, pid: int) -> str:
    return next(u for n, u in stack.http_urls().items() if n.endswith(f"-{pid}"))


def trainer_rate(stack, pairs: int) -> int:
    """The trainer started on the transitions the shards handed on: the ones it trains on per second (MAPPO every
    64, the policies signed and published), from its first to its last."""
    stack.start_trainer()
    stack.wait_ready(300)
    return follow([url_of(stack, stack.learner.pid)], pairs).rate(0)


def run(workdir: Path, pairs: int, shards: int, explored: float, behaviour: bool, with_trainer: bool) -> dict:
    stack = replay_stack(workdir, partitions=4)
    try:
        asyncio.run(publish_pairs(stack.settings, pairs, explored, behaviour))
        for shard in range(shards):
            stack.start_shard(shard, shards)
        stack.wait_ready(300)
        infra = [p for p in (stack.broker, stack.redis) if p is not None]
        parts = {
            "shards": {p.pid for p in stack.processes()},
            "broker": {infra[0].process.pid},
            "redis": {infra[1].process.pid},
        }
        cpu_before = {name: cpu_seconds(ids) for name, ids in parts.items()}
        joins = follow([url_of(stack, stack.shards[i].pid) for i in range(shards)], pairs)
        cpu = {name: round(cpu_seconds(ids) - cpu_before[name], 1) for name, ids in parts.items()}
        trained = trainer_rate(stack, pairs) if with_trainer else None
    finally:
        stack.stop()
    elapsed = max(joins.last) - min(joins.first)
    return {
        "trainer_per_s": trained,
        "shards": shards,
        "joined": int(sum(joins.counts)),
        "seconds": round(elapsed, 2),
        "joins_per_s": round(sum(joins.counts) / elapsed),
        "joins_per_s_all_running": joins.rate_all_running(),
        "per_shard_joins_per_s": [joins.rate(i) for i in range(shards)],
        "per_shard_joined": [int(c) for c in joins.counts],
        "cpu_seconds": cpu,
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--pairs", type=int, default=20_000)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--explored", type=float, default=0.05, help="share of explored queries (the service's default: 0.05)"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds over the shard counts, each in a rotated order (ratios per round)"
    )
    parser.add_argument("--workdir", type=Path, default=Path("bench/out/learner_shards"))
    parser.add_argument(
        "--behaviour",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="experiences with their behaviour (calibration rows and fits, the OPE log); --no-behaviour: the join "
        "alone",
    )
    add_out(parser, "bench/out/learner_shards.json")
    args = parser.parse_args()
    results = {
        "machine": machine_facts(),
        "load_1min": os.getloadavg()[0],
        "pairs": args.pairs,
        "explored": args.explored,
        "behaviour": args.behaviour,
        "runs": [],
    }
    for round_ in range(args.rounds):
        order = args.shards[round_ % len(args.shards) :] + args.shards[: round_ % len(args.shards)]
        for shards in order:  # the order rotates from round to round
            result = run(
                args.workdir / f"shards-{shards}",
                args.pairs,
                shards,
                args.explored,
                args.behaviour,
                with_trainer=round_ == 0 and shards == args.shards[0],
            )
            result["round"] = round_
            results["runs"].append(result)
            print(
                f"round {round_ + 1}, {shards} shard(s): {result['joins_per_s']} joins/s in all, "
                f"{result['joins_per_s_all_running']} while all run, per shard "
                f"{result['per_shard_joins_per_s']} ({result['per_shard_joined']} joined), {result['cpu_seconds']} CPU s"
                + (f"; then the trainer: {result['trainer_per_s']} transitions/s" if result["trainer_per_s"] else ""),
                flush=True,
            )
    # each round's rates against the same round's first shard count's
    ratios: dict[int, list[float]] = {shards: [] for shards in args.shards}
    running: dict[int, list[float]] = {shards: [] for shards in args.shards}
    for round_ in range(args.rounds):
        runs = {r["shards"]: r for r in results["runs"] if r["round"] == round_}
        for result in runs.values():
            first = runs[args.shards[0]]
            result["ratio_to_the_first"] = round(result["joins_per_s"] / first["joins_per_s"], 2)
            ratios[result["shards"]].append(result["ratio_to_the_first"])
            if result["joins_per_s_all_running"] and first["joins_per_s_all_running"]:
                result["ratio_all_running"] = round(
                    result["joins_per_s_all_running"] / first["joins_per_s_all_running"], 2
                )
                running[result["shards"]].append(result["ratio_all_running"])
    for name, found in (("", ratios), ("_all_running", running)):
        results[f"ratios_by_shards{name}"] = {str(shards): values for shards, values in found.items()}
        results[f"median_ratio_by_shards{name}"] = {
            str(shards): statistics.median(values) for shards, values in found.items() if values
        }
    print(
        f"ratios to {args.shards[0]} shard(s), round by round: in all {results['ratios_by_shards']}, while all run "
        f"{results['ratios_by_shards_all_running']}",
        flush=True,
    )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
