"""A Redis master killed under load through the gateway (issue 58): what is lost, what is answered twice, and how long
until answers come again, on a Redis Cluster (6 nodes: 3 masters, 3 replicas) and on a Sentinel set (a master, a
replica, three Sentinels).

    python -m bench.robustness.redis_failover [--topologies cluster sentinel] [--clients 16] [--before-s 15] [--after-s 45]

Per topology, the stack (tansu, the learner, one worker, the gateway; the bundled stream's models as replay backends)
on that Redis. ``--clients`` clients each ask, on one of 100 streams, as soon as their last answer came, and give the
feedback of each answer; ``--before-s`` seconds in, the master holding the first stream's window is killed, and the
load goes on for ``--after-s`` seconds. Each request ends as one of: 200 answered; 503 without a query id (refused
before anything was published: the client may send it again); 504 with its query id, whose answer is then fetched at
``/v1/answers/<id>``; anything else is a defect. Reported: answers a second before and after the kill, the longest
time without an answer, the outcomes, **lost** (a 504 whose answer never came, a 503 after its query was published, an
error), **answered twice** (one query id in two answers), feedback accepted and refused, and the **window rows lost**:
every accepted feedback's outcome makes one row in its stream's window, so what the windows hold short of the accepted
feedback once the learner's writes settled was written to the old master and never reached its replica (replication is
asynchronous: the known limit); and whether every process is still alive.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import machine_facts
from bench.common.stacks import replay_stack
from rlens.local.redis_topologies import LocalRedisCluster, LocalRedisSentinels, wait_until
from rlens.redis_clients import sync_redis

CHOICES = ["A", "B", "C", "D"]
STREAMS = 100  # at the load here each stream's window stays below its 128 rows


class Load:
    """Closed-loop clients through the gateway; every request's outcome with its time."""

    def __init__(self, url: str, key: str):
        self.url, self.headers = url, {"Authorization": f"Bearer {key}"}
        self.outcomes: list[tuple[float, int, str]] = []  # (monotonic time, status (0: an error), query id)
        self.feedback: Counter = Counter()
        self.errors: Counter = Counter()
        self.sent = 0

    async def client(self, http: httpx.AsyncClient, stop: float) -> None:
        while time.monotonic() < stop:
            self.sent += 1
            question = self.sent  # the streams in turn
            body = {
                "model": "rlens-focal",
                "messages": [{"role": "user", "content": f"question {question % 40}"}],
                "rlens": {"choices": CHOICES, "reference_id": str(question % 40)},
                "metadata": {"stream": f"failover-{question % STREAMS}"},
            }
            try:
                reply = await http.post(f"{self.url}/v1/chat/completions", json=body, headers=self.headers)
                data = reply.json()
                qid = data.get("id") or (data.get("error") or {}).get("query_id") or ""
                self.outcomes.append((time.monotonic(), reply.status_code, qid))
            except (httpx.HTTPError, ValueError) as exc:
                self.outcomes.append((time.monotonic(), 0, ""))
                self.errors[type(exc).__name__] += 1
                await asyncio.sleep(0.5)
                continue
            if reply.status_code == 200:
                try:
                    given = await http.post(
                        f"{self.url}/v1/feedback", json={"id": qid, "label": question % 4}, headers=self.headers
                    )
                    self.feedback[given.status_code] += 1
                except httpx.HTTPError as exc:
                    self.feedback[type(exc).__name__] += 1
            elif reply.status_code == 503:
                await asyncio.sleep(0.5)  # refused while Redis is away: a client backs off

    async def late_answers(self, http: httpx.AsyncClient) -> Counter:
        """Each 504's query id asked at /v1/answers (for up to 60 s while it says 202): its final status."""
        late: Counter = Counter()
        for _, status, qid in self.outcomes:
            if status != 504:
                continue
            deadline = time.monotonic() + 60
            while True:
                reply = await http.get(f"{self.url}/v1/answers/{qid}", headers=self.headers)
                if reply.status_code != 202 or time.monotonic() > deadline:
                    late[reply.status_code] += 1
                    break
                await asyncio.sleep(1.0)
        return late


async def run_load(load: Load, clients: int, before_s: float, after_s: float, kill) -> dict:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        started = time.monotonic()
        stop = started + before_s + after_s
        tasks = [asyncio.create_task(load.client(http, stop)) for _ in range(clients)]
        await asyncio.sleep(before_s)
        killed_at = await asyncio.to_thread(kill)
        await asyncio.gather(*tasks)
        late = await load.late_answers(http)
    return {"started": started, "killed_at": killed_at, "late": late}


def window_of(stack, stream: int) -> str:
    return f"{stack.settings.redis.prefix}:win:{{@local/failover-{stream}}}"


def window_rows(url: str, windows: list[str], settle_s: float = 5.0, timeout_s: float = 120.0) -> int:
    """The rows in ``windows`` once their count held still for ``settle_s`` (the learner's writes that waited out the
    failover landed); Redis errors while a client learns of the new master are retried."""
    deadline, last, since = time.monotonic() + timeout_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        try:
            client = sync_redis(url, socket_timeout=5)
            rows = sum(client.llen(window) for window in windows)
        except Exception:
            time.sleep(0.5)
            continue
        if rows != last:
            last, since = rows, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
        time.sleep(0.5)
    return last


def measure(topology: str, workdir: Path, clients: int, before_s: float, after_s: float) -> dict:
    redis_dir = workdir / f"redis-{topology}"
    servers = LocalRedisCluster(redis_dir) if topology == "cluster" else LocalRedisSentinels(redis_dir)
    stack = None
    try:
        stack = replay_stack(workdir / f"stack-{topology}", redis_url=servers.url)
        stack.start_service(workers=1, gateway=True, wait_s=180)
        url = next(u for name, u in stack.http_urls().items() if name.startswith("gateway:"))
        key = stack.gateway_key.read_text().strip() if stack.gateway_key else ""
        window = window_of(stack, 0)

        def kill() -> float:
            servers.kill(servers.master_of(window) if isinstance(servers, LocalRedisCluster) else servers.master())
            return time.monotonic()

        load = Load(url, key)
        run = asyncio.run(run_load(load, clients, before_s, after_s, kill))
        if isinstance(servers, LocalRedisCluster):
            wait_until(servers.healthy, 60, "a replica promoted")
        settled = window_rows(servers.url, [window_of(stack, i) for i in range(STREAMS)])
        alive = all(process.poll() is None for process in stack.processes())
    finally:
        if stack is not None:
            stack.stop()
        servers.stop()
    killed = run["killed_at"]
    answered = [(t, qid) for t, status, qid in load.outcomes if status == 200]
    ids = [qid for _, qid in answered]
    times = sorted([run["started"], killed, *(t for t, _ in answered), run["started"] + before_s + after_s])
    statuses = Counter(status for _, status, _ in load.outcomes)
    published_503 = sum(1 for _, status, qid in load.outcomes if status == 503 and qid)
    lost = sum(n for status, n in run["late"].items() if status != 200) + published_503 + statuses.get(0, 0)
    lost += sum(n for status, n in statuses.items() if status not in (0, 200, 503, 504))
    return {
        "topology": topology,
        "clients": clients,
        "answers_per_s_before": round(sum(1 for t, _ in answered if t < killed) / (killed - run["started"]), 1),
        "answers_per_s_after": round(sum(1 for t, _ in answered if t >= killed) / after_s, 1),
        "first_answer_after_kill_s": round(min((t - killed for t, _ in answered if t >= killed), default=-1.0), 2),
        "longest_gap_s": round(max(b - a for a, b in zip(times, times[1:])), 2),
        "outcomes": {str(k): v for k, v in sorted(statuses.items())},
        "late_answers": {str(k): v for k, v in run["late"].items()},
        "errors": dict(load.errors),
        "lost": lost,
        "answered_twice": len(ids) - len(set(ids)),
        "feedback": {str(k): v for k, v in load.feedback.items()},
        # every accepted feedback's outcome is one window row (100 streams, each below its window's 128 rows): what the
        # windows hold short of it was written to the old master and never reached the replica
        "window_rows": settled,
        "window_rows_lost": load.feedback[202] - settled,
        "every_process_alive": alive,
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--topologies", nargs="+", choices=["cluster", "sentinel"], default=["cluster", "sentinel"])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--before-s", type=float, default=15.0)
    parser.add_argument("--after-s", type=float, default=45.0)
    add_out(parser, "bench/out/redis_failover.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    rows = []
    for topology in args.topologies:
        rows.append(measure(topology, args.out.parent / "redis-failover", args.clients, args.before_s, args.after_s))
        print(rows[-1], flush=True)
    write_json(args.out, {"machine": machine_facts(), "runs": rows})


if __name__ == "__main__":
    main()
