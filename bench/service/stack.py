"""Service throughput and latency on the local stack (tansu broker, redis-server, replay backends).

    python -m bench.service.stack [--queries N] [--workers W] [--kafka BOOTSTRAP] [--out bench/out/service.json]

``--kafka``: on that Apache Kafka broker instead of tansu (e.g. `infra/kafka/kafka.sh start`), every phase on
topics and consumer groups of its own, the yardstick (1) included.

1. Raw aiokafka consume → produce: N query-sized messages pre-filled in a topic; one consumer-group member reads
   them in batches and produces one answer-sized message per input (commit after the batch's sends are confirmed,
   as the worker does). Messages/s from the first record read to the last send confirmed.
2. The worker: the same N queries (the bundled stream, replay backends) pre-filled in the queries topic, then W
   workers start; queries/s from the first answer to the N-th (startup excluded). Ratio to (1).
   Then, in the same run, the worker with its metrics off and on (``RLENS_METRICS_ENABLED``), alternately,
   ``--metrics-reps`` times each on N fresh queries: the ratio of the two throughputs. With ``--evidence-reps``, the
   same alternation without off-policy evidence (``RLENS_OPE_LOGGING=false``), with it, and with it and a candidate
   scored in shadow: what logging and shadow scoring cost the whole worker (:func:`evidence_phase`).
3. Latency, on a fresh stack (its own broker and Redis, so the learner has no earlier phase's records to read):
   learner + W workers. First the stack's own maximum: for ``--saturate-s`` seconds the load generator keeps 2,000
   queries unanswered (the learner, the broker and the load generator share the machine with the workers, so this is
   below (2)), and how long the learner then takes to read what the saturation left it: the stack's sustained maximum
   is the queries answered over the time from the first answer to the learner's catching up (a rate the workers
   answer but the learner cannot learn from only grows its lag). The learner caught up with the workers idle, so
   ``--probe-s`` seconds at that rate follow (:func:`probe_learner`), measured the same way (queries over the time to
   the learner's catching up): where that falls short of the rate, another probe runs at it, up to ``--probes``; the
   last rate the stack kept up with (or its last measure) is the sustained maximum. Then ``--load-s`` seconds of
   traffic at ``--load-share`` (default 0.8) of the sustained maximum, feedback sent as each answer arrives: p50 /
   p99 from sending a query to receiving its answer, over the answers after the phase's first 5 s and per 10 s, the
   accuracy served, and the load generator's own garbage-collection pauses (longest and total), which count in the
   latencies it measures. The wait for the learner (at most ``--catch-up-s``) also starts the latency phase from a
   stack that keeps up; every 10 s of that phase the bench samples the learner's lag and each process's share of a
   core (:class:`bench.common.sampling.StackSampler`); the phase over time is printed in one line and plotted beside
   ``--out`` (the same name, ``.png``). ``--load-s 0`` skips this phase, ``--queries 0`` phases 1 and 2.
   ``--without-learner``: the same with no learner (no updates taking the cores): whether the p99 is the learner's.
   ``--learner-nice N``: the learner lowers its priority by N (``RLENS_LEARNER_NICE``).
   ``--rate R``: no saturation and no probes: the ``--load-s`` seconds at R queries/s on the fresh stack (a given
   load, where the sustained maximum's measure moves from run to run).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.common.machine import cpu_seconds, machine_facts
from bench.common.sampling import StackSampler, wait_for_learner
from bench.common.stacks import cycled, replay_stack
from bench.common.args import add_out, arguments, write_json
from rlens.records.dataset import load_dataset
from rlens.service.common.kafka import Topics
from rlens.local.load import LoadReport, play, queries_of
from rlens.settings import settings


async def prefill(bootstrap: str, topic: str, payloads: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=10, max_batch_size=1 << 20)
    await producer.start()
    for i, payload in enumerate(payloads):
        await producer.send(topic, payload, key=str(i).encode())
    await producer.flush()
    await producer.stop()


async def raw_pipe(bootstrap: str, source: str, sink: str, n: int, reply: bytes, batch: int) -> float:
    consumer = AIOKafkaConsumer(
        source,
        bootstrap_servers=bootstrap,
        group_id="raw-bench",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_records=batch,
        fetch_max_wait_ms=20,
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=2)
    await consumer.start()
    await producer.start()
    done, start = 0, 0.0
    while done < n:
        for records in (await consumer.getmany(timeout_ms=200, max_records=batch)).values():
            start = start or time.perf_counter()
            await asyncio.gather(*[await producer.send(sink, reply, key=r.key) for r in records])
            await consumer.commit()
            done += len(records)
    elapsed = time.perf_counter() - start
    await consumer.stop()
    await producer.stop()
    return n / elapsed


async def count_answers(bootstrap: str, topic: str, n: int, prefix: bytes = b"", timeout_s: float = 300) -> float:
    """Answers/s of the ``n`` queries whose ids start with ``prefix``, from the first of their answers to the last."""
    return (await measure_answers(bootstrap, topic, n, prefix, timeout_s))[0]


async def measure_answers(
    bootstrap: str, topic: str, n: int, prefix: bytes = b"", timeout_s: float = 300, pids: tuple[int, ...] = ()
) -> tuple[float, float]:
    """(answers/s, the CPU seconds the processes ``pids`` used) of the ``n`` queries whose ids start with
    ``prefix``, from the first of their answers to the last."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest", fetch_max_wait_ms=20
    )
    await consumer.start()
    seen: set[bytes] = set()
    first, deadline, cpu = None, time.time() + timeout_s, 0.0
    while len(seen) < n and time.time() < deadline:
        for records in (await consumer.getmany(timeout_ms=200)).values():
            mine = [r.key for r in records if r.key.startswith(prefix)]
            if mine and first is None:
                first, cpu = time.perf_counter(), cpu_seconds(pids)
            seen.update(mine)
    elapsed, cpu = time.perf_counter() - (first or 0.0), cpu_seconds(pids) - cpu
    await consumer.stop()
    if len(seen) < n:
        raise RuntimeError(f"only {len(seen)} of {n} queries answered")
    return n / elapsed, cpu


def alternate(
    args: argparse.Namespace,
    stack,
    traffic: list,
    phase: str,
    states: dict[str, dict],
    reps: int,
    policies: Callable[[int, str, str], list[bytes]] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The workers restarted with each state's settings in turn, ``reps`` times, each time on the N queries again under
    fresh ids (``phase``, the repetition and the state before each id): queries/s per state, and the workers' CPU µs
    per query. ``policies(rep, state, when)``: the policy messages to publish ``"before"`` that state's workers start
    and ``"after"`` they are done."""
    topics, bootstrap = Topics.from_settings(stack.settings), stack.settings.kafka.bootstrap
    rates: dict[str, list[float]] = {state: [] for state in states}
    cpu: dict[str, list[float]] = {state: [] for state in states}  # the workers' CPU µs per query
    for rep in range(reps):
        for state, update in states.items():
            for worker in list(stack.workers):  # a graceful stop: the worker commits and leaves the group
                worker.send_signal(signal.SIGTERM)
                worker.wait(60)
                stack.workers.remove(worker)
            stack.settings = stack.settings.updated(update)
            if policies is not None:
                asyncio.run(prefill(bootstrap, topics.policy, policies(rep, state, "before")))
            prefix = f"{phase}{rep}{state}-"
            asyncio.run(
                prefill(
                    bootstrap,
                    topics.queries,
                    [
                        q.model_copy(update={"query_id": prefix + q.query_id}).model_dump_json().encode()
                        for q, _ in traffic
                    ],
                )
            )
            for _ in range(args.workers):
                stack.start_worker()
            pids = tuple(worker.pid for worker in stack.workers)
            rate, used = asyncio.run(
                measure_answers(bootstrap, topics.answers, len(traffic), prefix.encode(), pids=pids)
            )
            rates[state].append(rate)
            cpu[state].append(1e6 * used / len(traffic))
            print(f"worker, {state}: {rate:.0f} queries/s, {cpu[state][-1]:.0f} CPU µs per query", flush=True)
            if policies is not None:
                asyncio.run(prefill(bootstrap, topics.policy, policies(rep, state, "after")))
    return rates, cpu


def evidence_phase(args: argparse.Namespace, stack, traffic: list) -> dict:
    """What off-policy evidence costs the whole worker (issue 35), alternately: without it (``RLENS_OPE_LOGGING=false``),
    with it, and with it and a candidate scored in shadow (another seed's weights, published as a signed candidate
    before those workers start, superseded afterwards by the champion's own weights published live: the champion
    stays the seeded policy every worker starts from)."""
    from rlens.focal.engine import FocalEngine
    from rlens.service.common.policy import encode_policy
    from rlens.service.common.security import PolicySigner
    from rlens.service.run import build_engine, pool_of

    settings_ = stack.settings
    assert settings_.security.policy_signing_key is not None
    signer = PolicySigner(settings_.security.policy_signing_key.get_secret_value())
    pool = pool_of(settings_)
    names = [m.name for m in pool.models]
    champion = build_engine(settings_, pool)
    other = FocalEngine(champion.n_models, champion.model_costs, champion.cfg, seed=settings_.service.seed + 1)

    def policies(rep: int, state: str, when: str) -> list[bytes]:
        if state != "shadow":
            return []
        version, weights, stage = (
            (2 * rep + 1, other, "candidate") if when == "before" else (2 * rep + 2, champion, "live")
        )
        policy = encode_policy(weights.policy_state(), version, 1, names, "rl_focal", signer, stage)
        return [policy.model_dump_json().encode()]

    # without calibrations in all three (they need the logged distributions; bench.service.worker_core has their cost)
    states = {
        state: {"ope_logging": logging, "focal_calibration_rows": 0}
        for state, logging in (("off", False), ("on", True), ("shadow", True))
    }
    rates, cpu = alternate(args, stack, traffic, "e", states, args.evidence_reps, policies)
    out: dict = {"queries_per_s": rates, "cpu_us_per_query": cpu, **evidence_costs(rates, cpu)}
    print(
        f"off-policy logging costs {100 * out['logging_cost']:.1f} % of the whole worker's throughput "
        f"({100 * out['logging_cpu_cost']:.1f} % by its CPU time per query), logging and shadow scoring "
        f"{100 * out['logging_and_shadow_cost']:.1f} % ({100 * out['logging_and_shadow_cpu_cost']:.1f} %); medians "
        f"over {args.evidence_reps} alternations",
        flush=True,
    )
    return out


def evidence_costs(rates: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, float]:
    """The share of the throughput lost to logging (``on``) and to logging with a shadow (``shadow``) against ``off``,
    and the share a CPU-bound worker would lose by its CPU time per query: medians over the alternations of each
    one's own ratio (paired within an alternation, so a drift of the machine's speed across the run cancels)."""
    out = {}
    for state, name in (("on", "logging"), ("shadow", "logging_and_shadow")):
        out[f"{name}_cost"] = 1 - float(np.median(np.divide(rates[state], rates["off"])))
        out[f"{name}_cpu_cost"] = 1 - float(np.median(np.divide(cpu["off"], cpu[state])))
    return out


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--queries", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--saturate-s", type=float, default=30.0, help="seconds of the stack at its maximum rate")
    parser.add_argument("--load-s", type=float, default=60.0, help="seconds of the latency phase (0: no latency phase)")
    parser.add_argument(
        "--load-share", type=float, default=0.8, help="the latency phase's rate, as a share of the stack's maximum"
    )
    parser.add_argument(
        "--metrics-reps", type=int, default=2, help="alternations of the worker with its metrics off and on"
    )
    parser.add_argument(
        "--evidence-reps",
        type=int,
        default=0,
        help="alternations of the worker without off-policy evidence, with it, and with a candidate in shadow",
    )
    parser.add_argument("--partitions", type=int, default=4, help="partitions of the per-query topics")
    parser.add_argument("--kafka", default=None, help="bootstrap of an Apache Kafka broker to run on (default: tansu)")
    parser.add_argument(
        "--without-learner", action="store_true", help="the latency phase without a learner (no policy updates)"
    )
    parser.add_argument(
        "--catch-up-s", type=float, default=300.0, help="the longest wait for the learner between the two phases"
    )
    parser.add_argument(
        "--probe-s",
        type=float,
        default=60.0,
        help="seconds at the estimated sustained maximum, to see whether the learner keeps up there (0: no probe)",
    )
    parser.add_argument(
        "--probes",
        type=int,
        default=3,
        help="the most probes, each at the rate the stack answered and learned from in the one before",
    )
    parser.add_argument("--learner-nice", type=int, default=0, help="RLENS_LEARNER_NICE for the latency phase")
    parser.add_argument(
        "--rate", type=float, default=None, help="the latency phase at this many queries/s (no saturation, no probes)"
    )
    add_out(parser, "bench/out/service.json")
    args = parser.parse_args()
    if args.probes < 1:
        parser.error("--probes must be at least 1 (--probe-s 0: no probe)")
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be above 0")
    if args.rate is None and args.saturate_s <= 12:
        parser.error("--saturate-s must be above 12: the maximum is measured after the phase's first 10 s")
    print(f"machine: {machine_facts()}", flush=True)
    data = settings().service.demo_data
    dataset = load_dataset(data)
    stream = queries_of(dataset, None, "bench")  # reference ids index the dataset the replay backends serve
    results: dict = {
        "broker": f"Apache Kafka at {args.kafka}" if args.kafka else "tansu (memory storage)",
        "queries": args.queries,
        "workers": args.workers,
        "partitions": args.partitions,
        "learner": not args.without_learner,
        "learner_nice": args.learner_nice,
        "given_rate": args.rate,
    }
    if args.queries:
        throughput_phases(args, stream, results)
    if args.load_s > 0:
        latency_phase(args, stream, results)
    write_json(
        args.out,
        results,
    )
    if "latency_by_10s" in results:
        plot_latency_phase(results, Path(args.out).with_suffix(".png"))


def throughput_phases(args: argparse.Namespace, stream: list, results: dict) -> None:
    """Phases 1 and 2 (the raw loop, the worker, metrics on and off, evidence) on ``--queries`` queries."""
    traffic = cycled(stream, "bench", args.queries)
    stack = replay_stack(Path("bench/out/service-stack"), args.partitions, args.kafka)
    topics = Topics.from_settings(stack.settings)
    bootstrap = stack.settings.kafka.bootstrap
    results["worker_batch"] = stack.settings.worker.batch
    try:
        payloads = [q.model_dump_json().encode() for q, _ in traffic]
        reply_size = 700  # an Answer of the bundled stream is about this many bytes
        raw_in, raw_out = f"{stack.settings.kafka.topic_prefix}raw.in", f"{stack.settings.kafka.topic_prefix}raw.out"
        asyncio.run(prefill(bootstrap, raw_in, payloads))
        results["raw_aiokafka_msgs_per_s"] = asyncio.run(
            raw_pipe(bootstrap, raw_in, raw_out, len(payloads), b"x" * reply_size, stack.settings.worker.batch)
        )
        print(f"raw aiokafka consume->produce: {results['raw_aiokafka_msgs_per_s']:.0f} msgs/s")

        asyncio.run(prefill(bootstrap, topics.queries, payloads))
        for _ in range(args.workers):
            stack.start_worker()
        results["worker_queries_per_s"] = asyncio.run(count_answers(bootstrap, topics.answers, len(payloads)))
        results["ratio"] = results["worker_queries_per_s"] / results["raw_aiokafka_msgs_per_s"]
        print(f"worker: {results['worker_queries_per_s']:.0f} queries/s; ratio to raw {results['ratio']:.2f}")

        metrics = {"off": {"metrics_enabled": False}, "on": {"metrics_enabled": True}}
        rates, _ = alternate(args, stack, traffic, "m", metrics, args.metrics_reps)
        if args.metrics_reps:
            results.update(
                metrics_on_queries_per_s=rates["on"],
                metrics_off_queries_per_s=rates["off"],
                metrics_on_off_ratio=sum(rates["on"]) / sum(rates["off"]),
            )
            print(f"metrics on / off: {results['metrics_on_off_ratio']:.3f}")
        if args.evidence_reps:
            results["evidence"] = evidence_phase(args, stack, traffic)
    finally:
        stack.stop()


def probe_learner(args: argparse.Namespace, stack, stream: list, sent: int, results: dict) -> int:
    """Up to ``--probes`` rounds of ``--probe-s`` seconds at the estimated sustained maximum, the workers busy (the
    catch-up after the saturation ran with them idle): each round's queries over its time from the first answer to
    the learner's catching up after the last is the rate the stack answers and learns from there; where that falls
    short of the round's rate (by more than 3 %), the next round runs at it. The feedback the probes sent."""
    rate, probed_sent, results["probes"] = results["sustained_queries_per_s"], 0, []
    for probe in range(args.probes):
        traffic = cycled(stream, f"probe{probe}", int(args.probe_s * rate))
        probed = asyncio.run(play(stack.settings, traffic, rate=rate, idle_timeout_s=60))
        probed_sent += probed.feedback_sent
        caught_up = wait_for_learner(stack, sent + probed_sent, args.catch_up_s)
        if caught_up is None:
            raise SystemExit(f"the learner did not catch up on the probe's records within {args.catch_up_s:g} s")
        span = probed.answered_at[-1] - probed.answered_at[0]
        learned = probed.answered / (span + caught_up)
        results["probes"].append([round(rate, 1), round(learned, 1), round(caught_up, 1)])
        print(
            f"at {rate:.0f} queries/s for {args.probe_s:g} s the learner caught up {caught_up:.0f} s after the last "
            f"answer: the stack answers and learns from {learned:.0f} queries/s",
            flush=True,
        )
        if learned >= 0.97 * rate:
            break
        rate = learned
    results["sustained_queries_per_s"] = min(rate, learned)
    print(f"the sustained maximum: {results['sustained_queries_per_s']:.0f} queries/s", flush=True)
    return probed_sent


def latency_phase(args: argparse.Namespace, stream: list, results: dict) -> None:
    """The whole stack on a fresh broker and Redis: its maximum rate, then latency at ``--load-share`` of it (or at
    ``--rate``)."""
    stack = replay_stack(
        Path("bench/out/service-latency-stack"),
        args.partitions,
        args.kafka,
        fast_failover=False,
        learner={"nice": args.learner_nice},
    )
    try:
        if not args.without_learner:
            stack.start_learner()
        for _ in range(args.workers):
            stack.start_worker()
        stack.wait_ready(120)
        if args.rate is None:
            sent, rate = find_the_maximum(args, stack, stream, results)
        else:
            sent, rate = 0, args.rate
        report = LoadReport()

        def seen(latest: LoadReport) -> None:
            nonlocal report
            report = latest

        traffic = cycled(stream, "latency", int(args.load_s * rate))
        with StackSampler(stack, lambda: sent + report.feedback_sent) as sampler:
            report = asyncio.run(play(stack.settings, traffic, rate=rate, idle_timeout_s=60, on_answer=seen))
        steady = [ms for ms, t in zip(report.latencies_ms, report.answered_at) if t >= 5.0]
        results.update(
            latency_rate=rate,
            latency_p50_ms=float(np.percentile(steady, 50)),
            latency_p99_ms=float(np.percentile(steady, 99)),
            latency_accuracy=report.accuracy,
            latency_answered=report.answered,
            # the load generator's own pauses count in the latencies it measures
            load_generator_gc_max_ms=max(report.gc_pauses_ms, default=0.0),
            load_generator_gc_total_ms=sum(report.gc_pauses_ms),
            samples=sampler.rows,
            latency_by_10s=[  # [start s, answers, p50 ms, p99 ms] per 10 s of the phase: does the backlog grow?
                [start, len(chunk), round(float(np.percentile(chunk, 50))), round(float(np.percentile(chunk, 99)))]
                for start in range(0, int(report.answered_at[-1]) + 1, 10)
                if (chunk := [ms for ms, t in zip(report.latencies_ms, report.answered_at) if start <= t < start + 10])
            ],
        )
        given = "given" if args.rate is not None else f"{args.load_share:g} of the stack's sustained maximum"
        print(
            f"at {rate:.0f} queries/s ({given}): p50 {results['latency_p50_ms']:.1f} ms, p99 {results['latency_p99_ms']:.1f} ms ({report.answered} answered, accuracy {100 * report.accuracy:.1f} %)"
        )
        print(over_time(results))
    finally:
        stack.stop()


def find_the_maximum(args: argparse.Namespace, stack, stream: list, results: dict) -> tuple[int, float]:
    """The stack's maximum (``--saturate-s``), the learner's catch-up and the probes: (feedback sent, the latency
    phase's rate: ``--load-share`` of the sustained maximum)."""
    saturated = asyncio.run(
        play(
            stack.settings,
            cycled(stream, "saturate", int(args.saturate_s * 10_000)),
            rate=1e9,
            idle_timeout_s=60,
            max_in_flight=2000,
            duration_s=args.saturate_s,
        )
    )
    after = [t for t in saturated.answered_at if t >= saturated.answered_at[0] + 10.0]
    results["stack_queries_per_s"] = (len(after) - 1) / (after[-1] - after[0])
    print(f"the stack at its maximum: {results['stack_queries_per_s']:.0f} queries/s")
    results["sustained_queries_per_s"] = results["stack_queries_per_s"]
    sent = saturated.feedback_sent  # feedback sent so far, for the learner's lag
    if not args.without_learner:
        caught_up = wait_for_learner(stack, sent, args.catch_up_s)
        if caught_up is None:
            raise SystemExit(
                f"the learner did not catch up on the saturation's records within {args.catch_up_s:g} s: no "
                "sustained maximum to load at (raise --catch-up-s)"
            )
        results["learner_catch_up_s"] = caught_up
        span = saturated.answered_at[-1] - saturated.answered_at[0]
        results["sustained_queries_per_s"] = saturated.answered / (span + caught_up)
        print(
            f"the learner caught up on the saturation's records in {caught_up:.0f} s: the stack answers and "
            f"learns from {results['sustained_queries_per_s']:.0f} queries/s"
        )
        if args.probe_s:
            sent += probe_learner(args, stack, stream, sent, results)
    return sent, results["sustained_queries_per_s"] * args.load_share


P99_TARGET_MS = 100.0  # issue 59's p99 at 80 % of the maximum


def full_windows(results: dict) -> list[list]:
    """The latency phase's 10 s windows but a last one cut short (under half the median window's answers)."""
    windows = results["latency_by_10s"]
    typical = float(np.median([w[1] for w in windows]))
    return [w for w in windows if w[1] >= typical / 2]


def over_time(results: dict) -> str:
    """One line on the latency phase over time: per 10 s p50 and p99 ranges, the windows above the p99 target, and
    the learner's largest lag (records) where it ran."""
    windows = full_windows(results)
    p50s, p99s = [w[2] for w in windows], [w[3] for w in windows]
    above = sum(p99 > P99_TARGET_MS for p99 in p99s)
    line = (
        f"per 10 s: p50 {min(p50s)}–{max(p50s)} ms, p99 {min(p99s)}–{max(p99s)} ms, {above} of {len(windows)} windows "
        f"above {P99_TARGET_MS:g} ms"
    )
    lags = [max(row["experience_lag"], row["feedback_lag"]) for row in results["samples"]]
    return line + (f"; the learner's largest lag {max(lags):,.0f} (records)" if results["learner"] and lags else "")


def plot_latency_phase(results: dict, path: Path) -> None:
    """The latency phase over time, one panel each: p50 and p99 per 10 s (the target dashed), the learner's lag, and
    each process's share of a core (stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows, samples = full_windows(results), results["samples"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    starts = [w[0] + 5 for w in windows]
    axes[0].plot(starts, [w[2] for w in windows], marker=".", label="p50")
    axes[0].plot(starts, [w[3] for w in windows], marker=".", label="p99")
    axes[0].axhline(P99_TARGET_MS, color="grey", linestyle="--", label=f"target p99 {P99_TARGET_MS:g} ms")
    axes[0].set_ylabel("ms, per 10 s")
    axes[0].legend()
    axes[0].set_title(
        f"{results['broker']}: {results['latency_rate']:.0f} queries/s, p50 {results['latency_p50_ms']:.1f} ms, "
        f"p99 {results['latency_p99_ms']:.1f} ms"
    )
    times = [row["t"] for row in samples]  # none in a phase under 10 s: those panels stay empty
    if results["learner"] and samples:
        axes[1].plot(times, [max(r["experience_lag"], r["feedback_lag"]) for r in samples], color="tab:orange")
    axes[1].set_ylabel("the learner's lag, records")
    axes[1].set_ylim(bottom=0)
    shares = [row.get("cpu_share", {}) for row in samples]
    roles = sorted({role for share in shares for role in share})
    if roles:
        stacked = [[share.get(role, 0.0) for share in shares] for role in roles]
        axes[2].stackplot(times, stacked, labels=roles)
        axes[2].set_ylim(0, 1.3 * max(map(sum, zip(*stacked))))  # room for the legend
        axes[2].legend(loc="upper left", ncol=len(roles))
    axes[2].set_ylabel("share of a core")
    axes[2].set_xlabel("seconds into the phase")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
