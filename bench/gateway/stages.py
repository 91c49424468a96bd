"""Where a request's time goes through the gateway, stage by stage, at several loads: the ``Server-Timing`` header of
every answer (``rlens.service.gateway.timing``), on one stack (tansu, or ``--kafka BOOTSTRAP``; Redis, a learner,
2 workers with replay backends, the gateway), open-loop traffic of the bundled stream from this process.

    python -m bench.gateway.stages [--rates 10 50 100] [--seconds 20] [--kafka BOOTSTRAP] [--out bench/out/stages.json]

Per load: p50 and p99 of each stage and of the whole request as the client saw it (ms), and the requests answered.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import machine_facts
from bench.common.stacks import cycled, replay_stack
from bench.gateway.gateway import request_body
from rlens.records.dataset import load_dataset
from rlens.local.load import queries_of
from rlens.messages import Query
from rlens.settings import settings


def server_timing(value: str) -> dict[str, float]:
    """``admit;dur=0.41, state;dur=0.62`` → {"admit": 0.41, "state": 0.62}."""
    return {name.strip(): float(dur.removeprefix("dur=")) for name, dur in (p.split(";") for p in value.split(","))}


async def load(url: str, key: str, queries: list[Query], rate: float) -> list[dict[str, float]]:
    """Each query at ``rate`` per second; the stages of each answered one, with the client's own total."""
    answered: list[dict[str, float]] = []
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=256)) as session:

        async def one(i: int, query: Query) -> None:
            await asyncio.sleep(i / rate)
            started = time.perf_counter()
            async with session.post(f"{url}/v1/chat/completions", json=request_body(query)) as response:
                await response.read()
                if response.status == 200:
                    stages = server_timing(response.headers["Server-Timing"])
                    answered.append({**stages, "client": 1000 * (time.perf_counter() - started)})

        await asyncio.gather(*(one(i, q) for i, q in enumerate(queries)))
    return answered


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 50.0, 100.0])
    parser.add_argument("--seconds", type=float, default=20.0, help="of traffic per load")
    parser.add_argument("--kafka", default=None, help="a running Kafka's bootstrap servers (default: tansu)")
    add_out(parser, "bench/out/stages.json")
    args = parser.parse_args()
    facts = machine_facts()
    print(f"machine: {facts}", flush=True)
    stack = replay_stack(
        args.out.parent / "stages-stack", partitions=4, kafka=args.kafka, fast_failover=False, gateway_port=0
    )
    results: dict = {"machine": facts, "broker": args.kafka or "tansu", "loads": []}
    traffic = queries_of(load_dataset(settings().service.demo_data), None, "stages")
    try:
        stack.start_service(workers=2, gateway=True)
        url = next(u for name, u in stack.http_urls().items() if name.startswith("gateway:"))
        assert stack.gateway_key is not None  # the stack's own key (no keys file was configured)
        key = stack.gateway_key.read_text().strip()
        asyncio.run(load(url, key, [q for q, _ in traffic[:100]], 20.0))  # warm every path
        for n, rate in enumerate(args.rates):
            count = int(rate * args.seconds)
            queries = [q for q, _ in cycled(traffic, f"r{n}", count)]
            answered = asyncio.run(load(url, key, queries, rate))
            split = {
                stage: {
                    "p50_ms": round(float(np.percentile([a[stage] for a in answered], 50)), 2),
                    "p99_ms": round(float(np.percentile([a[stage] for a in answered], 99)), 2),
                }
                for stage in answered[0]
            }
            results["loads"].append({"rate": rate, "sent": count, "answered": len(answered), "stages": split})
            cells = "  ".join(f"{s} {v['p50_ms']:.1f}/{v['p99_ms']:.1f}" for s, v in split.items())
            print(f"{rate:g}/s ({len(answered)} of {count} answered), p50/p99 ms: {cells}", flush=True)
    finally:
        stack.stop()
    write_json(args.out, results)


if __name__ == "__main__":
    main()
