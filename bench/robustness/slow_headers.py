"""Slow clients against the gateway (issue 60): keyless connections that send their header lines slowly and never
finish them, from one address, while a client with a valid key asks from another.

    python -m bench.robustness.slow_headers [--connections 2100] [--line-every 2] [--asks 23] [--out bench/out/slow_headers.json]

The stack: tansu, redis-server, a learner, a worker and the gateway (replay backends), the gateway with its defaults
(`RLENS_GATEWAY_HEADER_TIMEOUT_S` 10 s, `RLENS_GATEWAY_MAX_CONNECTIONS_PER_ADDRESS` 256, `RLENS_GATEWAY_MAX_CONNECTIONS`
2048). The slow connections come from 127.0.0.2 and each sends a request line, then a header line every
``--line-every`` seconds, reconnecting when the gateway closes it; the valid client asks ``--asks`` times, one
request a second, from 127.0.0.1. Reported: the valid client's statuses and latencies, and what the slow connections
got (503 at once for the address's cap, 408 at the header timeout, or closed).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import machine_facts
from bench.common.stacks import replay_stack


async def slow_client(host: str, port: int, every_s: float, stop: float, outcomes: Counter) -> None:
    """One slow connection after another until ``stop`` (monotonic): each what the gateway answered."""
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
        except OSError:
            outcomes["refused to connect"] += 1
            await asyncio.sleep(every_s)
            continue
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
        answer = b""
        try:
            while time.monotonic() < stop and not answer:
                try:
                    answer = await asyncio.wait_for(reader.read(64), every_s)
                except TimeoutError:
                    writer.write(b"X-Slow: 1\r\n")  # one more header line, never the end of them
                    await writer.drain()
                    continue
                if not answer:
                    break
        except OSError:
            pass
        finally:
            writer.close()
        outcomes[answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"] += 1


async def attack(url: str, key: str, connections: int, every_s: float, asks: int) -> dict:
    parsed = httpx.URL(url)
    outcomes: Counter = Counter()
    stop = time.monotonic() + asks + 15
    slow = [
        asyncio.create_task(slow_client(parsed.host, parsed.port or 80, every_s, stop, outcomes))
        for _ in range(connections)
    ]
    await asyncio.sleep(5.0)  # every slow connection opened
    statuses: Counter = Counter()
    latencies = []
    body = {
        "model": "rlens-focal",
        "messages": [{"role": "user", "content": "question 1"}],
        "rlens": {"choices": ["A", "B", "C", "D"], "reference_id": "1"},
    }
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(asks):
            started = time.perf_counter()
            try:
                response = await client.post(
                    f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
                statuses[str(response.status_code)] += 1
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(1.0)
    await asyncio.gather(*slow)
    latencies.sort()
    return {
        "valid_client": dict(statuses),
        "valid_latency_s": {"p50": round(latencies[len(latencies) // 2], 3), "max": round(latencies[-1], 3)},
        "slow_connections": dict(outcomes),
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--connections", type=int, default=2100)
    parser.add_argument("--line-every", type=float, default=2.0)
    parser.add_argument("--asks", type=int, default=23)
    add_out(parser, "bench/out/slow_headers.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    stack = replay_stack(args.out.parent / "slow-headers-stack")
    try:
        stack.start_service(workers=1, gateway=True)
        url = next(u for name, u in stack.http_urls().items() if name.startswith("gateway:"))
        key = stack.gateway_key.read_text().strip() if stack.gateway_key else ""
        result = asyncio.run(attack(url, key, args.connections, args.line_every, args.asks))
    finally:
        stack.stop()
    write_json(args.out, {"connections": args.connections, "line_every_s": args.line_every, **result}, show=True)


if __name__ == "__main__":
    main()
