"""The gateway's cost and its guarantees under failure, on one stack (tansu, Redis, a learner, 2 workers with
replay backends, the gateway), measured from this process (a second process on loopback).

    python -m bench.gateway.gateway [--rate 50] [--duration 60] [--out bench/out/gateway.json]

1. Overhead, same run: the same ``--rate`` open-loop traffic (--overhead-n queries) published straight to Kafka
   (``rlens load``'s player) and sent through the gateway; p50 / p99 latency of each and the difference.
2. Capacity: closed loops of 16, 64 and 128 concurrent clients through the gateway, 15 s each: requests/s, p50,
   p99, status codes; and the direct-Kafka throughput of the player at an unbounded rate, for scale.
3. Failure: ``--duration`` s of open-loop traffic at ``--rate`` through the gateway, every request with its own
   ``Idempotency-Key`` and retried (same key, backoff) on 429 / 503 / 504 / connection errors; worker 0 is killed
   (SIGKILL) halfway and not restarted. The gateway's timeout (``--timeout`` 5 s) is shorter than the consumer
   group's rebalance, so the queries on the dead worker's partitions time out and their retries are exercised. Then each answer's feedback is sent (retried likewise). Reported: requests
   lost (no answer after all retries), requests answered twice to the client (two ids for one request, or one id
   for two), feedback accepted, and how many the learner joined and applied to the windows (each exactly once).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import time
import uuid
from collections import Counter

import aiohttp
import httpx
import numpy as np

from bench.common.machine import machine_facts
from bench.common.args import add_out, arguments, write_json
from rlens.records.dataset import load_dataset
from rlens.messages import Query
from rlens.local.load import play, queries_of
from rlens.local.stack import LocalStack, write_replay_pool
from rlens.settings import settings

RETRIED = {429, 503, 504}


class Client:
    """The load's HTTP client: aiohttp (httpx's async pool costs this 2-core machine more CPU than the gateway does)."""

    def __init__(self, base_url: str, headers: dict[str, str]):
        self.base_url, self.headers = base_url, headers

    async def __aenter__(self) -> "Client":
        self.session = aiohttp.ClientSession(
            headers=self.headers, connector=aiohttp.TCPConnector(limit=256), timeout=aiohttp.ClientTimeout(total=60)
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def post(self, path: str, json: dict, headers: dict | None = None) -> tuple[int, dict]:
        async with self.session.post(self.base_url + path, json=json, headers=headers) as response:
            return response.status, await response.json(content_type=None)


def request_body(query: Query) -> dict:
    return {
        "model": "rlens-focal",
        "messages": [{"role": "user", "content": query.prompt}],
        "rlens": {"choices": query.choices, "reference_id": query.reference_id},
        "metadata": {"stream": query.stream},
    }


def percentiles(latencies_ms: list[float]) -> dict:
    if not latencies_ms:
        return {"p50_ms": None, "p99_ms": None}
    return {
        "p50_ms": round(float(np.percentile(latencies_ms, 50)), 2),
        "p99_ms": round(float(np.percentile(latencies_ms, 99)), 2),
    }


async def open_loop(client: Client, queries: list[Query], rate: float) -> list[float]:
    """Each query through the gateway at ``rate`` per second (no retries); latencies of the answered ones."""
    latencies: list[float] = []

    async def one(i: int, q: Query) -> None:
        await asyncio.sleep(i / rate)
        started = time.perf_counter()
        status, _ = await client.post("/v1/chat/completions", json=request_body(q))
        if status == 200:
            latencies.append(1000 * (time.perf_counter() - started))

    await asyncio.gather(*(one(i, q) for i, q in enumerate(queries)))
    return latencies


async def closed_loop(client: Client, queries: list[Query], concurrency: int, seconds: float) -> dict:
    codes: Counter = Counter()
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    counter = iter(range(10**9))

    async def client_loop() -> None:
        while time.monotonic() < deadline:
            q = queries[next(counter) % len(queries)]
            started = time.perf_counter()
            try:
                status, _ = await client.post("/v1/chat/completions", json=request_body(q))
                codes[status] += 1
                if status == 200:
                    latencies.append(1000 * (time.perf_counter() - started))
            except (aiohttp.ClientError, TimeoutError) as exc:
                codes[type(exc).__name__] += 1

    started = time.monotonic()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    return {
        "concurrency": concurrency,
        "requests_per_s": round(len(latencies) / elapsed, 1),
        **percentiles(latencies),
        "codes": dict(codes),
    }


async def with_retries(send, attempts: int = 10) -> tuple[tuple[int, dict] | None, int]:
    """``send()`` until it is not a retried status or a connection error (backoff 0.2 s doubling to 5 s)."""
    delay = 0.2
    response = None
    for attempt in range(1, attempts + 1):
        try:
            response = await send()
            if response[0] not in RETRIED:
                return response, attempt
        except (aiohttp.ClientError, TimeoutError):
            response = None
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)
    return response, attempts


async def failure_run(
    client: Client, stack: LocalStack, traffic: list[tuple[Query, int]], rate: float, duration: float
) -> dict:
    n = int(rate * duration)
    outcome: dict[int, dict] = {}
    killed_at: list[float] = []
    start = time.monotonic()

    async def one(i: int) -> None:
        q, label = traffic[i % len(traffic)]
        q = q.model_copy(update={"stream": f"fail-{q.stream}"})
        await asyncio.sleep(i / rate)
        key = {"Idempotency-Key": uuid.uuid4().hex}
        ids: set[str] = set()

        async def send() -> tuple[int, dict]:
            status, body = await client.post("/v1/chat/completions", json=request_body(q), headers=key)
            if status == 200:
                ids.add(body["id"])
            return status, body

        response, attempts = await with_retries(send)
        outcome[i] = {
            "code": response[0] if response is not None else None,
            "ids": ids,
            "attempts": attempts,
            "label": label,
        }

    async def kill_halfway() -> None:
        await asyncio.sleep(duration / 2)
        stack.kill(stack.workers[0])
        killed_at.append(time.monotonic() - start)

    await asyncio.gather(kill_halfway(), *(one(i) for i in range(n)))
    answered = {i: o for i, o in outcome.items() if o["code"] == 200}
    all_ids = [qid for o in answered.values() for qid in o["ids"]]
    feedback: Counter = Counter()

    async def give(o: dict) -> None:
        (qid,) = o["ids"]
        response, _ = await with_retries(lambda: client.post("/v1/feedback", json={"id": qid, "label": o["label"]}))
        feedback[response[1]["status"] if response is not None and response[0] in (200, 202) else "failed"] += 1

    await asyncio.gather(*(give(o) for o in answered.values() if len(o["ids"]) == 1))
    return {
        "requests": n,
        "answered": len(answered),
        "lost": n - len(answered),
        "codes": dict(Counter(o["code"] for o in outcome.values())),
        "retried_requests": sum(o["attempts"] > 1 for o in outcome.values()),
        "max_attempts": max(o["attempts"] for o in outcome.values()),
        "two_ids_for_one_request": sum(len(o["ids"]) > 1 for o in outcome.values()),
        "one_id_for_two_requests": len(all_ids) - len(set(all_ids)),
        "worker_killed_at_s": round(killed_at[0], 1),
        "feedback": dict(feedback),
        "elapsed_s": round(time.monotonic() - start, 1),
    }


def learner_joined(url: str, prefix: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(f'rlens_learner_joined_total{{stream="{prefix}')
        )
    )


def gateway_counters(url: str) -> dict[str, float]:
    """The gateway's counters (replies by outcome, timeouts, idempotent replays, requests by status)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    wanted = (
        "rlens_gateway_replies_total",
        "rlens_gateway_timeouts_total",
        "rlens_gateway_idempotent_replays_total",
        "rlens_gateway_requests_total",
    )
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(wanted)
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s of the overhead and failure runs")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the failure run")
    parser.add_argument("--overhead-n", type=int, default=1000)
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="RLENS_GATEWAY_TIMEOUT_S: shorter than the group's rebalance after the kill, so requests time out and are retried",
    )
    add_out(parser, "bench/out/gateway.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    zoo = load_dataset(settings().service.demo_data)
    workdir = args.out.parent / "gateway-stack"
    shutil.rmtree(workdir, ignore_errors=True)
    pool = write_replay_pool(settings().service.demo_data, workdir / "pool.json")
    config = settings().updated(
        {
            "pool_file": pool,
            "kafka_session_timeout_ms": 6000,
            "kafka_heartbeat_ms": 1000,
            "gateway_port": 0,
            "gateway_id": "bench",
            "gateway_timeout_s": args.timeout,
        }
    )
    stack = LocalStack(config, workdir)
    result: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "rate": args.rate,
        "duration_s": args.duration,
    }
    try:
        stack.start_service(workers=2, gateway=True)
        urls = stack.http_urls()
        gateway = next(u for name, u in urls.items() if name.startswith("gateway:"))
        learner = next(u for name, u in urls.items() if name.startswith("learner:"))
        headers = {"Authorization": f"Bearer {stack.gateway_key.read_text().strip()}"}

        async def run() -> None:
            async with Client(gateway, headers) as client:
                traffic = queries_of(zoo, None, "warm")
                await open_loop(client, [q for q, _ in traffic[:100]], args.rate)  # warm both paths
                direct = await play(
                    stack.settings,
                    [
                        (q.model_copy(update={"query_id": f"direct-{q.query_id}"}), y)
                        for q, y in traffic[: args.overhead_n]
                    ],
                    args.rate,
                )
                through = await open_loop(
                    client,
                    [q.model_copy(update={"query_id": f"gw-{q.query_id}"}) for q, _ in traffic[: args.overhead_n]],
                    args.rate,
                )
                d, g = percentiles(direct.latencies_ms), percentiles(through)
                result["overhead"] = {
                    "n": args.overhead_n,
                    "direct_kafka": d,
                    "gateway": g,
                    "answered_direct": direct.answered,
                    "answered_gateway": len(through),
                    "added_p50_ms": round(g["p50_ms"] - d["p50_ms"], 2),
                    "added_p99_ms": round(g["p99_ms"] - d["p99_ms"], 2),
                }
                print("overhead", result["overhead"], flush=True)
                burst = queries_of(zoo, None, "burst")
                flat_out = await play(stack.settings, burst, rate=100_000, idle_timeout_s=60)
                result["direct_kafka_max_per_s"] = round(flat_out.answered / flat_out.elapsed_s, 1)
                result["capacity"] = []
                for concurrency in (16, 64, 128):
                    result["capacity"].append(await closed_loop(client, [q for q, _ in traffic], concurrency, 15.0))
                    print("capacity", result["capacity"][-1], flush=True)
                failure = await failure_run(client, stack, traffic, args.rate, args.duration)
                deadline = time.monotonic() + 120
                accepted = failure["feedback"].get("accepted", 0)
                while learner_joined(learner, "fail-") < accepted and time.monotonic() < deadline:
                    await asyncio.sleep(1.0)
                await asyncio.sleep(5.0)  # a second application would show by now
                failure["learner_joined"] = learner_joined(learner, "fail-")
                failure["gateway_metrics"] = gateway_counters(gateway)
                result["failure"] = failure
                print("failure", failure, flush=True)

        asyncio.run(run())
    finally:
        stack.stop()
    directory = stack.settings.learner.checkpoint_dir
    state = json.loads((directory / (directory / "LATEST").read_text() / "state.json").read_text())
    result["learner_stats"] = state["stats"]
    write_json(args.out, result, show=True)


if __name__ == "__main__":
    main()
