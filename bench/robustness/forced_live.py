"""A bad policy forced live on a real stack, many times (issue 61's target): how many of its answers go out before
the learner rolls back to the champion it replaced.

    python -m bench.robustness.forced_live [--data DIR] [--seeds 0 ... 9] [--promotions gated holdback]
        [--before 800] [--after 1500] [--rate 60] [--kafka BOOTSTRAP] [--out bench/out/forced_live.json]

Per run: a fresh local stack (its own tansu broker, or topics of their own on the Apache Kafka at ``--kafka``; its
own redis-server; a learner and one worker, engines seeded S) serves the data's models as `replay` backends under
the service's gate (400 / 4,000 events, a look every 50, delta 0.02; RLENS_GATE_SHADOW_CALLS its default) and the
learning of ``bench.robustness.gate`` (20 % explored, 20 % probes, an update every 32 explored joins). ``--before``
queries are played with their feedback; an operator promotes the newest candidate as `rlens policy promote` does,
then forces a bad policy live: the same weights with the Fusion's scores turned upside down, signed and published
as an operator's. ``--after`` more queries follow. Per run: the forced policy's answers (until the roll back, the
queries in flight included), whether it was rolled back, the learner's estimate at the verdict, and the accuracy
served while it was live and over the queries after it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.torch import load as load_safetensors

from bench.common.args import add_out, add_seeds, arguments, write_json
from bench.common.machine import machine_facts
from bench.common.stacks import cycled
from rlens.cli.policy import operator_settings, read_history, set_live
from rlens.local.load import play, queries_of
from rlens.local.stack import LocalStack, write_replay_pool
from rlens.records.dataset import load_dataset
from rlens.service.common.policy import encode_policy
from rlens.service.common.security import policy_signer
from rlens.settings import Settings, settings

LEARNING = {"focal_explore_rate": 0.2, "focal_probe_rate": 0.2, "focal_update_period": 32}


def roll_back_line(workdir: Path) -> str | None:
    """The learner's log line of its first roll back, if any."""
    for path in sorted(workdir.glob("learner*.log")):
        for line in path.read_text().splitlines():
            message = json.loads(line).get("message", "")
            if message.startswith("rolled back"):
                return message
    return None


def promote_then_force_upside_down(operator: Settings, by: str) -> int:
    """As an operator would: promote the newest candidate (`rlens policy promote`), then force its weights live with
    the Fusion's scores turned upside down, signed and published as an operator's policy. The forced version."""
    history = read_history(operator)
    candidates = [p for p in history.policies if p.stage == "candidate"]
    champion = max(candidates or history.policies, key=lambda p: (p.epoch, p.version))
    set_live(operator, history, champion, f"promoted by {by}")  # the champion the bad policy replaces
    history = read_history(operator)
    weights = load_safetensors(base64.b64decode(champion.weights_b64))
    upside_down = {k: -v if k.startswith("fusion.") else v for k, v in weights.items()}
    bad = encode_policy(upside_down, 1, champion.epoch, champion.models, "rl_focal", policy_signer(operator))
    forced = history.next_order()[1]
    set_live(operator, history, bad, f"forced bad by {by}")
    return forced


def forced_run(data: Path, seed: int, promotion: str, args, workdir: Path) -> dict:
    pool = write_replay_pool(data, workdir / "pool.json")
    config = settings().updated(
        {
            "pool_file": pool.resolve(),
            "seed": seed,
            "promotion": promotion,
            "kafka_session_timeout_ms": 2000,
            "kafka_heartbeat_ms": 500,
            "topic_prefix": f"forced-{seed}-{promotion}-{time.time_ns()}.",  # a --kafka broker outlives each run
            **LEARNING,
        }
    )
    stream = queries_of(load_dataset(data), None, f"forced-{seed}")
    before, after = cycled(stream, "before", args.before), cycled(stream[args.before :] + stream, "after", args.after)
    stack = LocalStack(config, workdir, kafka_bootstrap=args.kafka)
    try:
        stack.start_learner()
        stack.start_worker()
        stack.wait_ready(300)
        asyncio.run(play(stack.settings, before, rate=args.rate, idle_timeout_s=60))
        time.sleep(2.0)  # the last feedback reaches the learner, its newest candidate the topic
        forced = promote_then_force_upside_down(operator_settings(workdir), "the benchmark")
        time.sleep(2.0)  # it reaches the worker
        report = asyncio.run(play(stack.settings, after, rate=args.rate, idle_timeout_s=60))
        time.sleep(2.0)
    finally:
        stack.stop()
    versions, ok = report.versions, report.outcomes
    served = [i for i, v in enumerate(versions) if v == forced]
    last = served[-1] + 1 if served else 0
    rolled_back = roll_back_line(workdir)
    return {
        "seed": seed,
        "promotion": promotion,
        "forced_version": forced,
        "forced_served": len(served),
        "rolled_back": rolled_back is not None and bool(served) and versions[-1] != forced,
        "verdict": rolled_back,
        "accuracy_forced": float(np.mean([ok[i] for i in served])) if served else None,
        "accuracy_after": float(np.mean(ok[last:])) if last < len(ok) else None,
        "models_called_forced": float(np.mean([report.models_called[i] for i in served])) if served else None,
        "models_called_after": float(np.mean(report.models_called[last:])) if last < len(ok) else None,
        "answered": report.answered,
        "duplicates": report.duplicates,
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--data", type=Path, default=None, help="recorded dataset (default: the bundled stream)")
    add_seeds(parser, list(range(10)))
    parser.add_argument("--promotions", nargs="+", choices=["gated", "holdback"], default=["gated", "holdback"])
    parser.add_argument("--before", type=int, default=800, help="queries before the operator forces the policy")
    parser.add_argument("--after", type=int, default=1500, help="queries after it")
    parser.add_argument("--rate", type=float, default=60.0, help="queries a second")
    parser.add_argument("--kafka", default=None, help="bootstrap of an Apache Kafka broker to run on (default: tansu)")
    add_out(parser, "bench/out/forced_live.json")
    args = parser.parse_args()
    data = args.data or settings().service.demo_data
    print(machine_facts(), flush=True)
    rows = []
    for seed in args.seeds:
        for promotion in args.promotions:
            with tempfile.TemporaryDirectory() as workdir:
                row = forced_run(data, seed, promotion, args, Path(workdir))
            rows.append(row)
            print(
                f"seed {seed} {promotion:8s}: the forced policy answered {row['forced_served']} queries, "
                + ("rolled back" if row["rolled_back"] else "NOT rolled back")
                + f" ({row['verdict'] or 'no verdict'}); accuracy {row['accuracy_forced']} while forced, "
                f"{row['accuracy_after']} after",
                flush=True,
            )
    for promotion in args.promotions:
        runs = [r for r in rows if r["promotion"] == promotion]
        within = [r for r in runs if r["rolled_back"] and r["forced_served"] <= 1000]
        print(f"{promotion}: rolled back within 1,000 of its answers in {len(within)} of {len(runs)} runs", flush=True)
    settings_used = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write_json(args.out, {"machine": machine_facts(), "data": str(data), "args": settings_used, "rows": rows})


if __name__ == "__main__":
    main()
