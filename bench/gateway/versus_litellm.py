"""rlens's gateway beside LiteLLM's proxy on the same machine, alternated, at several loads (issue 59).

    python -m bench.gateway.versus_litellm --litellm ../litellm-venv/bin/litellm [--rates 10 50] [--seconds 30]
        [--rounds 2] [--kafka BOOTSTRAP] [--out bench/out/versus-litellm.json]

LiteLLM: its proxy from PyPI in a venv of its own (its pins are not rlens's:
``python3 -m venv ../litellm-venv && ../litellm-venv/bin/pip install 'litellm[proxy]'``), one worker, a master
key, no database, in front of an instant OpenAI-compatible upstream (``bench.common.upstream``, a process of its
own, not counted). rlens: a fresh ``rlens up``-like stack (tansu or ``--kafka``, its Redis, the learner,
``--workers`` workers on replay backends whose models answer in about 0.2 ms, the gateway).

Each round starts one system alone, warms it (``--warm`` requests), measures it, stops it, then does the same with
the other (the order alternates from round to round). Measured, the same client for both (aiohttp, this process):
- open-loop traffic at each of ``--rates`` for ``--seconds``: the client's latency, the overhead each system says it
  added (``x-litellm-overhead-duration-ms``, ``x-rlens-overhead-duration-ms``) and the client's latency less the
  models' time (the upstream's, about 0.1 ms, for LiteLLM; ``x-rlens-model-duration-ms`` for rlens), p50 / p99 ms;
  CPU per answered request (ms; every process of the system, /proc), in all and by role: LiteLLM's proxy; rlens's
  gateway, workers, learner, Redis and broker (tansu, or the Apache Kafka ``infra/kafka/kafka.sh`` started: its pid
  files under ``RLENS_KAFKA_RUN``, default /tmp/rlens-kafka);
- capacity: ``--clients`` closed-loop clients for ``--capacity-s``: answered requests/s;
- idle: the system's CPU over ``--idle-s`` with nothing sent (cores), in all and by role, once ``--settle-s`` have
  passed since the capacity phase (its backlog digested: the learner's joins and checkpoint, the broker's flushes).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import aiohttp

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import cpu_seconds, machine_facts, process_tree
from bench.common.sampling import stack_pids
from bench.common.stacks import replay_stack
from bench.gateway.gateway import percentiles, request_body
from rlens.records.dataset import load_dataset
from rlens.local.load import queries_of
from rlens.local.servers import LocalProcess
from rlens.ports import free_port
from rlens.settings import settings

LITELLM_KEY = "sk-bench-litellm"


class System:
    """One gateway under test: where to send, what to send, its processes, how it reports its overhead."""

    name: str
    url: str
    headers: dict[str, str]
    overhead_header: str

    def body(self, i: int) -> dict:
        raise NotImplementedError

    def models_ms(self, response: aiohttp.ClientResponse) -> float:
        raise NotImplementedError

    def roles(self) -> dict[str, list[int]]:
        """The system's processes by role (the CPU a request is split by them)."""
        raise NotImplementedError

    def pids(self) -> list[int]:
        return [pid for pids in self.roles().values() for pid in pids]

    def stop(self) -> None:
        raise NotImplementedError


class LiteLLM(System):
    name, overhead_header = "litellm", "x-litellm-overhead-duration-ms"

    def __init__(self, binary: str, upstream: str, workdir: Path, prompts: list[str]):
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            "  - model_name: bench\n"
            "    litellm_params: {model: openai/bench, api_base: " + upstream + "/v1, api_key: sk-upstream}\n"
            f"general_settings: {{master_key: {LITELLM_KEY}}}\n"
        )
        port = free_port()
        self.proxy = LocalProcess(
            [binary, "--config", str(config), "--port", str(port), "--num_workers", "1"],
            port,
            "LiteLLM",
            300.0,
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"},  # offline; quiet
        )
        self.url, self.prompts = f"http://127.0.0.1:{port}", prompts
        self.headers = {"Authorization": f"Bearer {LITELLM_KEY}"}

    def body(self, i: int) -> dict:
        return {"model": "bench", "messages": [{"role": "user", "content": self.prompts[i % len(self.prompts)]}]}

    def models_ms(self, response: aiohttp.ClientResponse) -> float:
        return 0.0  # the upstream answers at once (about 0.1 ms, included in the overhead: in LiteLLM's favour)

    def roles(self) -> dict[str, list[int]]:
        return {"proxy": process_tree(self.proxy.process.pid)}

    def stop(self) -> None:
        self.proxy.stop()


class Rlens(System):
    name, overhead_header = "rlens", "x-rlens-overhead-duration-ms"

    def __init__(self, workdir: Path, kafka: str | None, workers: int):
        self.stack = replay_stack(workdir, partitions=4, kafka=kafka, fast_failover=False, gateway_port=0)
        try:
            self.stack.start_service(workers=workers, gateway=True, wait_s=600.0)
        except BaseException:
            self.stack.stop()
            raise
        self.url = next(u for name, u in self.stack.http_urls().items() if name.startswith("gateway:"))
        assert self.stack.gateway_key is not None  # the stack's own key (no keys file was configured)
        self.headers = {"Authorization": f"Bearer {self.stack.gateway_key.read_text().strip()}"}
        self.traffic = [q for q, _ in queries_of(load_dataset(settings().service.demo_data), None, "versus")]
        self.run, self.sent = uuid.uuid4().hex[:8], 0

    def body(self, i: int) -> dict:
        self.sent += 1  # every request a query id of its own: rlens answers a repeated id from its record
        query = self.traffic[i % len(self.traffic)]
        return request_body(query.model_copy(update={"query_id": f"versus-{self.run}-{self.sent}"}))

    def models_ms(self, response: aiohttp.ClientResponse) -> float:
        return float(response.headers.get("x-rlens-model-duration-ms", 0.0))

    def roles(self) -> dict[str, list[int]]:
        """The gateway, workers, learner, Redis and the broker: tansu, or an Apache Kafka that ``infra/kafka/kafka.sh``
        started (:func:`stack_pids`; its CPU is rlens's too)."""
        return {"gateway": [self.stack.gateway.pid] if self.stack.gateway else []} | stack_pids(self.stack)

    def stop(self) -> None:
        self.stack.stop()


async def open_loop(system: System, rate: float, n: int) -> dict:
    """``n`` requests at ``rate`` per second: latency, overheads and CPU per answered request."""
    client, header, overhead, codes = [], [], [], Counter()
    async with aiohttp.ClientSession(
        headers=system.headers, connector=aiohttp.TCPConnector(limit=512), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:

        async def one(i: int) -> None:
            await asyncio.sleep(i / rate)
            started = time.perf_counter()
            try:
                async with session.post(f"{system.url}/v1/chat/completions", json=system.body(i)) as response:
                    await response.read()
                    codes[response.status] += 1
                    if response.status == 200:
                        total = 1000 * (time.perf_counter() - started)
                        client.append(total)
                        overhead.append(total - system.models_ms(response))
                        header.append(float(response.headers[system.overhead_header]))
            except (aiohttp.ClientError, TimeoutError) as exc:
                codes[type(exc).__name__] += 1

        roles, started = system.roles(), time.perf_counter()
        before = {role: cpu_seconds(pids) for role, pids in roles.items()}
        await asyncio.gather(*(one(i) for i in range(n)))
        by_role = {role: cpu_seconds(pids) - before[role] for role, pids in roles.items()}
        cpu, elapsed = sum(by_role.values()), time.perf_counter() - started
    return {
        "rate": rate,
        "sent": n,
        "answered": len(client),
        "answered_per_s": round(len(client) / elapsed, 1),
        "codes": dict(codes),
        "client": percentiles(client),
        "overhead_header": percentiles(header),
        "overhead_client": percentiles(overhead),
        "cpu_ms_per_request": round(1000 * cpu / max(len(client), 1), 2),
        "cpu_ms_per_request_by_role": {role: round(1000 * s / max(len(client), 1), 2) for role, s in by_role.items()},
    }


async def closed_loop(system: System, clients: int, seconds: float) -> dict:
    """``clients`` clients each sending its next request when the last is answered, for ``seconds``."""
    answered, codes, counter = [], Counter(), iter(range(10**9))
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(
        headers=system.headers, connector=aiohttp.TCPConnector(limit=512), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:

        async def loop() -> None:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    async with session.post(f"{system.url}/v1/chat/completions", json=system.body(next(counter))) as r:
                        await r.read()
                        codes[r.status] += 1
                        if r.status == 200:
                            answered.append(1000 * (time.perf_counter() - started))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    codes[type(exc).__name__] += 1

        started = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(clients)))
        elapsed = time.monotonic() - started
    return {
        "clients": clients,
        "answered_per_s": round(len(answered) / elapsed, 1),
        "codes": dict(codes),
        **percentiles(answered),
    }


def idle_cores(system: System, seconds: float) -> dict[str, float]:
    """The system's CPU with nothing sent for ``seconds``, in cores: each role's, and ``all``."""
    roles = system.roles()
    before, started = {role: cpu_seconds(pids) for role, pids in roles.items()}, time.perf_counter()
    time.sleep(seconds)
    elapsed = time.perf_counter() - started
    by_role = {role: (cpu_seconds(pids) - before[role]) / elapsed for role, pids in roles.items()}
    return {"all": round(sum(by_role.values()), 4)} | {role: round(c, 4) for role, c in by_role.items()}


def measure(system: System, args) -> dict:
    asyncio.run(open_loop(system, 20.0, args.warm))  # every path warm
    loads = []
    for rate in args.rates:
        loads.append(asyncio.run(open_loop(system, rate, int(rate * args.seconds))))
        row = loads[-1]
        print(
            f"  {system.name} {rate:g}/s: {row['answered']} of {row['sent']} answered; overhead p50/p99 header "
            f"{row['overhead_header']['p50_ms']}/{row['overhead_header']['p99_ms']} ms, client "
            f"{row['overhead_client']['p50_ms']}/{row['overhead_client']['p99_ms']} ms; "
            f"CPU {row['cpu_ms_per_request']} ms a request ("
            + ", ".join(f"{role} {ms}" for role, ms in row["cpu_ms_per_request_by_role"].items())
            + ")",
            flush=True,
        )
    capacity = asyncio.run(closed_loop(system, args.clients, args.capacity_s))
    time.sleep(args.settle_s)
    idle = idle_cores(system, args.idle_s)
    print(
        f"  {system.name}: capacity {capacity['answered_per_s']} requests/s; idle {idle['all']} of a core ("
        + ", ".join(f"{role} {cores}" for role, cores in idle.items() if role != "all")
        + ")",
        flush=True,
    )
    return {"system": system.name, "loads": loads, "capacity": capacity, "idle_cores": idle}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--litellm", default=shutil.which("litellm"), help="LiteLLM's CLI (default: on PATH)")
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 50.0])
    parser.add_argument("--seconds", type=float, default=30.0, help="of open-loop traffic per rate")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm", type=int, default=100, help="requests before measuring")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients for capacity")
    parser.add_argument("--capacity-s", type=float, default=15.0)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--settle-s", type=float, default=20.0, help="after the capacity phase, before idle")
    parser.add_argument("--workers", type=int, default=1, help="rlens workers")
    parser.add_argument("--kafka", default=None, help="a running Kafka's bootstrap servers (default: tansu)")
    add_out(parser, "bench/out/versus-litellm.json")
    args = parser.parse_args()
    if not args.litellm or not Path(args.litellm).exists():
        sys.exit(
            "LiteLLM's proxy was not found: python3 -m venv ../litellm-venv && "
            "../litellm-venv/bin/pip install 'litellm[proxy]', then pass --litellm ../litellm-venv/bin/litellm"
        )
    version = subprocess.run([args.litellm, "--version"], capture_output=True, text=True).stdout.strip()
    facts = machine_facts()
    print(f"machine: {facts}; LiteLLM: {version}", flush=True)
    prompts = [q.prompt for q, _ in queries_of(load_dataset(settings().service.demo_data), None, "versus")]
    upstream_port = free_port()
    upstream = LocalProcess(
        [sys.executable, "-m", "bench.common.upstream", "--port", str(upstream_port)], upstream_port, "the upstream"
    )
    work = args.out.parent / "versus-litellm"
    starts = {
        "litellm": lambda: LiteLLM(args.litellm, f"http://127.0.0.1:{upstream_port}", work / "litellm", prompts),
        "rlens": lambda: Rlens(work / "rlens", args.kafka, args.workers),
    }
    results: dict = {"machine": facts, "litellm": version, "broker": args.kafka or "tansu", "rounds": []}
    try:
        for round_ in range(args.rounds):
            order = ["litellm", "rlens"] if round_ % 2 == 0 else ["rlens", "litellm"]
            runs = []
            for name in order:
                print(f"round {round_ + 1}: {name} (load {os.getloadavg()[0]:.2f})", flush=True)
                system = starts[name]()
                try:
                    runs.append(measure(system, args))
                finally:
                    system.stop()
            results["rounds"].append(runs)
            write_json(args.out, results)
    finally:
        upstream.stop()


if __name__ == "__main__":
    main()
