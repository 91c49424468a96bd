"""The idle stack's CPU by process, and variants of it alternated (issue 59: the idle stack under 0.05 of a core).

    python -m bench.service.idle --kafka 127.0.0.1:19092 [--rounds 3] [--idle-s 45] [--settle-s 15]
        [--variant NAME[:VAR=VALUE[,VAR=VALUE...]] ...] [--out bench/out/idle.json]

The stack of ``bench.gateway.versus_litellm`` (its Redis, the learner, ``--workers`` workers on replay backends, the
gateway; on tansu, or on the running Kafka at ``--kafka``, whose broker counts too when ``infra/kafka/kafka.sh``
started it): started afresh for each variant in each round (the order alternating from round to round), warmed with
``--warm`` requests through the gateway at 20 a second, left ``--settle-s`` to digest them, then measured over
``--idle-s`` with nothing sent: each process's CPU from /proc, in cores. A variant is a name and the environment its
stack's processes start with, e.g. ``--variant before:PYTHONPATH=/tmp/old-tree --variant after`` (a code change, as
a worktree of the older commit) or ``--variant hz10:RLENS_...=...`` (a setting). Printed: each run by role, then each
variant's median by role over the rounds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import machine_facts
from bench.gateway.versus_litellm import Rlens, idle_cores, open_loop
from rlens.numerics import environment


def variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME[:VAR=VALUE[,VAR=VALUE...]]`` → (name, environment)."""
    name, _, assignments = text.partition(":")
    env = {}
    for assignment in filter(None, assignments.split(",")):
        key, sep, value = assignment.partition("=")
        if not sep or not key:
            raise SystemExit(f"--variant {text!r}: {assignment!r} is not VAR=VALUE")
        env[key] = value
    return name, env


def measure(workdir: Path, kafka: str | None, workers: int, env: dict[str, str], args) -> dict[str, float]:
    """One stack with ``env`` set: warmed, settled, its idle CPU by role."""
    with environment(env):  # what the stack's processes start with
        system = Rlens(workdir, kafka, workers)
    try:
        asyncio.run(open_loop(system, 20.0, args.warm))
        time.sleep(args.settle_s)
        return idle_cores(system, args.idle_s)
    finally:
        system.stop()


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--kafka", default=None, help="a running Kafka's bootstrap servers (default: tansu)")
    parser.add_argument("--variant", action="append", default=[], help="NAME[:VAR=VALUE,...]; default: one, 'stack'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=200, help="requests through the gateway before settling")
    parser.add_argument("--settle-s", type=float, default=15.0)
    parser.add_argument("--idle-s", type=float, default=45.0)
    parser.add_argument("--workers", type=int, default=1)
    add_out(parser, "bench/out/idle.json")
    args = parser.parse_args()
    variants = dict(variant(v) for v in args.variant) or {"stack": {}}
    facts = machine_facts()
    print(f"machine: {facts}; broker: {args.kafka or 'tansu'}", flush=True)
    results: dict = {"machine": facts, "broker": args.kafka or "tansu", "variants": variants, "runs": []}
    work = args.out.parent / "idle"
    for round_ in range(args.rounds):
        names = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in names:
            idle = measure(work / name, args.kafka, args.workers, variants[name], args)
            results["runs"].append({"round": round_, "variant": name, "idle_cores": idle})
            print(f"round {round_ + 1} {name}: " + ", ".join(f"{role} {c}" for role, c in idle.items()), flush=True)
            write_json(args.out, results)
    results["median"] = {
        name: {
            role: round(statistics.median(r["idle_cores"][role] for r in results["runs"] if r["variant"] == name), 4)
            for role in results["runs"][0]["idle_cores"]
        }
        for name in variants
    }
    for name, medians in results["median"].items():
        print(f"median {name}: " + ", ".join(f"{role} {c}" for role, c in medians.items()), flush=True)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
