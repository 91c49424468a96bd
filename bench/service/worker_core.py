"""The ``rl_focal`` worker's own cost per query, without Kafka: ``FocalWorker.handle`` on batches of 32 queries plus
the JSON encoding of its answers and experience, with the windows in a real redis-server.

    python -m bench.service.worker_core [--passes 3] [--batch 32] [--out bench/out/worker_core.json]

The bundled stream (replay backends, 5 models) in stream order, on one torch thread. Two states: *cold* (empty
windows, a fresh policy: every model is called) and *warm* (each stream's window full, ``window`` rows from the
dataset's own outcomes, in Redis). Prints queries/s and microseconds per query for each stage of the batch
(window read, Decider, pool call, Fusion, building the messages, JSON encoding), and, as a yardstick timed in the
same run, a raw Redis round trip (PING) with the window read of a batch in those units. This is the part of the
worker's time that is the service's own code; the broker client's part is in ``bench.service.stack``.

Every state but the last runs the default configuration: each stream's calibrations
(``RLENS_FOCAL_CALIBRATION_ROWS=200``: fits of each task's last 200 questions published in Redis, read with the
windows; the greedy answers vote with them, and each called model's calibrated distribution is logged). What
off-policy evaluation costs (issue 35), in the same run: *warm* logs each query's behaviour (propensity, greedy pool
and answer, every called model's distribution and calibration) as the service does; *warm, no logging* leaves it out
(``RLENS_OPE_LOGGING=false``, which needs no calibrations: there it runs with them all the same, to isolate the
logging); *warm, shadow* also scores a candidate policy in shadow (gated promotion). *warm, no calibrations* runs
``RLENS_FOCAL_CALIBRATION_ROWS=0``: what the calibrations cost. Each state's passes are interleaved with the
others', so load drifts hit all alike, after a garbage collection each.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time

import numpy as np
import torch
from redis.asyncio import Redis

from bench.common.machine import machine_facts
from bench.common.args import add_out, arguments
from rlens.backends.replay import ReplayBackend
from rlens.records.dataset import load_dataset
from rlens.focal.calibration import StreamCalibration
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.local.load import queries_of
from rlens.local.servers import LocalRedis
from rlens.service.common.policy import encode_policy
from rlens.service.common.security import FeedbackTokens, PolicySigner, PolicyVerifier, generate_secrets
from rlens.service.common.windows import RedisWindows
from rlens.service.worker.core import FocalWorker
from rlens.settings import settings


async def fill_windows(windows: RedisWindows, dataset, size: int) -> None:
    """Each task's window: its last ``size`` questions' outcomes (every model's prediction, the label)."""
    outcomes = []
    for task in np.unique(dataset.task):
        for i in np.flatnonzero(dataset.task == task)[-size:]:
            valid = np.flatnonzero(dataset.choice_mask[i])
            # choice positions
            predictions = [int(dataset.probs[i, m, valid].argmax()) for m in range(dataset.n_models)]
            outcomes.append(
                (dataset.task_name(task), f"fill-{i}", predictions, int(np.searchsorted(valid, dataset.labels[i])), 1.0)
            )
    await windows.apply_many(outcomes)


async def redis_round_trip_us(redis_url: str, calls: int = 2000) -> float:
    """Microseconds per PING on the same redis-server and client library, the best of 5 runs of ``calls`` (a
    yardstick in the same run: the window read of a batch is one pipelined round trip plus the parsing)."""
    redis = Redis.from_url(redis_url)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            await redis.ping()
        best = min(best, (time.perf_counter() - started) / calls)
    await redis.aclose()
    return 1e6 * best


STATES = ("cold", "warm", "warm, no logging", "warm, shadow", "warm, no calibrations")
CALIBRATION_ROWS = 200


async def publish_calibrations(windows: RedisWindows, dataset) -> None:
    """Each task's calibrations, fitted on its last rows (every model called), published as the learner does."""
    for task in np.unique(dataset.task):
        calibration = StreamCalibration(dataset.n_models, CALIBRATION_ROWS)
        for i in np.flatnonzero(dataset.task == task)[-CALIBRATION_ROWS:]:
            valid = np.flatnonzero(dataset.choice_mask[i])
            label = int(np.searchsorted(valid, dataset.labels[i]))
            calibration.push(dataset.probs[i][:, valid], np.ones(dataset.n_models, dtype=bool), label)
        calibration.fit_all()
        await windows.save_calibration(dataset.task_name(task), calibration)


async def make_worker(state: str, redis: Redis, data) -> FocalWorker:
    names = data.model_names
    rows = 0 if state == "warm, no calibrations" else CALIBRATION_ROWS
    engine = FocalEngine(data.n_models, data.model_costs, FocalConfig(calibration_rows=rows), seed=0)
    windows = RedisWindows(
        redis, len(names), engine.cfg.window, prefix=f"rlens-{STATES.index(state)}", calibration_rows=rows
    )
    if state != "cold":
        await fill_windows(windows, data, engine.cfg.window)
    if rows and state != "cold":
        await publish_calibrations(windows, data)
    secrets = generate_secrets()
    worker = FocalWorker(
        engine,
        names,
        {name: ReplayBackend(data, m) for m, name in enumerate(names)},
        windows,
        PolicyVerifier(secrets["RLENS_POLICY_VERIFY_KEY"]),
        FeedbackTokens(secrets["RLENS_FEEDBACK_SECRET"]),
        ope_logging=state != "warm, no logging",
    )
    if state == "warm, shadow":
        signer = PolicySigner(secrets["RLENS_POLICY_SIGNING_KEY"])
        other = FocalEngine(data.n_models, data.model_costs, seed=1).policy_state()
        candidate = encode_policy(other, 1, 1, names, "rl_focal", signer, "candidate")
        assert worker.receive_policy(candidate) is None
    return worker


async def measure(redis_url: str, passes: int, batch: int) -> dict[str, dict]:
    data = load_dataset(settings().service.demo_data)
    redis = Redis.from_url(redis_url)
    await redis.flushdb()
    workers = {state: await make_worker(state, redis, data) for state in STATES}
    stream = [q for q, _ in queries_of(data, None, "core")]
    totals = {state: {"stages": {}, "answered": 0, "bytes": 0, "seconds": 0.0} for state in STATES}
    for done in range(passes + 1):  # the first pass warms every worker up and is not counted
        for state, worker in workers.items():
            t: dict = totals[state] if done else {"stages": {}, "answered": 0, "bytes": 0, "seconds": 0.0}
            gc.collect()  # the garbage of one state is not collected on another's time
            started = time.perf_counter()
            for at in range(0, len(stream), batch):
                out = await worker.handle(stream[at : at + batch])
                lap = time.perf_counter()
                t["bytes"] += sum(len(m.model_dump_json().encode()) for m in [*out.answers, *out.experience])
                out.stages["encode"] = time.perf_counter() - lap
                for name, seconds in out.stages.items():
                    t["stages"][name] = t["stages"].get(name, 0.0) + seconds
                t["answered"] += len(out.answers)
            t["seconds"] += time.perf_counter() - started
    await redis.aclose()
    return {
        state: {
            "queries_per_s": t["answered"] / t["seconds"],
            "us_per_query": {name: 1e6 * s / t["answered"] for name, s in t["stages"].items()},
            "us_per_query_total": 1e6 * t["seconds"] / t["answered"],
            "bytes_per_query": t["bytes"] / t["answered"],
        }
        for state, t in totals.items()
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--passes", type=int, default=3, help="passes over the bundled stream per state")
    parser.add_argument("--batch", type=int, default=32)
    add_out(parser, "bench/out/worker_core.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    torch.set_num_threads(1)
    server = LocalRedis()
    try:
        results = asyncio.run(measure(server.url, args.passes, args.batch))
        round_trip = asyncio.run(redis_round_trip_us(server.url))
    finally:
        server.stop()
    print(f"raw Redis round trip (PING, redis-py asyncio): {round_trip:.0f} µs")
    for state, r in results.items():
        parts = ", ".join(f"{name} {us:.0f}" for name, us in r["us_per_query"].items())
        r["window_read_round_trips_per_batch"] = r["us_per_query"]["window_read"] * args.batch / round_trip
        print(
            f"{state}: {r['queries_per_s']:.0f} queries/s; µs per query: {r['us_per_query_total']:.0f} in all ({parts}); "
            f"a batch's window read costs {r['window_read_round_trips_per_batch']:.1f} raw round trips; "
            f"{r['bytes_per_query']:.0f} bytes of messages per query"
        )
    plain, logged, shadow = (results[s]["queries_per_s"] for s in ("warm, no logging", "warm", "warm, shadow"))
    print(
        f"off-policy logging costs {100 * (1 - logged / plain):.1f} % of the warm worker's throughput, logging and "
        f"shadow scoring {100 * (1 - shadow / plain):.1f} %; messages grow by "
        f"{results['warm']['bytes_per_query'] - results['warm, no logging']['bytes_per_query']:.0f} bytes per query "
        f"(+{results['warm, shadow']['bytes_per_query'] - results['warm']['bytes_per_query']:.0f} with the shadow)"
    )
    bare = results["warm, no calibrations"]
    print(
        f"calibrations cost {100 * (1 - logged / bare['queries_per_s']):.1f} % of the warm worker's throughput; "
        f"messages grow by {results['warm']['bytes_per_query'] - bare['bytes_per_query']:.0f} bytes per query"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": machine_facts(), "redis_round_trip_us": round_trip, **results}, indent=1)
    )


if __name__ == "__main__":
    main()
