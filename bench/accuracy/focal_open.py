"""Open-ended RL-Focal on the zoo's generation stream: offline on recorded samples, and live in the service with the
models sampling.

    python -m bench.accuracy.focal_open [--zoo DIR] [--seeds 0 1 2] [--samples 5] [--rate 20] [--skip-live]

Pool: the zoo's four specialists. Warm split: ``generation_split`` (the four families, 400 tasks, seed 100); test
stream: ``generation_stream`` (16 blocks of 50, seed 7: 15 task switches), so nothing is chosen on the test stream.
Each model samples ``--samples`` texts per task at temperature 1 (an answer is a sample's first line).

Offline, per seed: RL-Focal warm-started on the warm split's samples, then online over the test stream's (the
replay harness's ``run_variant``, one window per family), against each single model (its most frequent sampled
answer, and its greedy answer, recorded apart), the best single model and the best single model per family (both
chosen on the warm split), the plurality vote of every model's answers, and the oracle.

Live, per seed: the local stack (tansu, redis-server, the learner warm-started from the warm split's samples, one
worker whose models sample live: ``transformers`` backends, not a replay) plays the test stream at ``--rate``
queries/s, the feedback (the reference) sent as each answer arrives.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from bench.common.machine import machine_facts
from bench.common.args import add_out, add_seeds, arguments, write_json
from rlens.progress import quiet_transformers
from rlens.evaluation import baselines
from rlens.records.dataset import load_dataset
from rlens.records.open_ended import sampled_dataset
from rlens.evaluation.replay import run_variant
from rlens.focal.config import FocalConfig
from rlens.local.load import open_ended_queries, play
from rlens.local.stack import LocalStack, write_zoo_pool
from rlens.settings import settings
from rlens.zoo.build import SPECIALISTS, load_zoo
from rlens.zoo.record import record_samples
from rlens.zoo.tasks import GENERATION_FAMILIES, exact_match, generation_split, generation_stream

NAMES = [spec.name for spec in SPECIALISTS]


def record(zoo: Path, out: Path, samples: int) -> dict:
    """The warm split's and the test stream's samples, and the test stream's greedy answers (recorded once)."""
    models = [m for m in load_zoo(zoo) if m.name in NAMES]
    sets = {
        "warm": generation_split(GENERATION_FAMILIES, 400, seed=100),
        "test": generation_stream(GENERATION_FAMILIES, 16, 50, seed=7),
    }
    paths = {}
    for name, tasks in sets.items():
        paths[name] = out / name
        if not (paths[name] / "samples.jsonl").is_file():
            started = time.perf_counter()
            record_samples(models, tasks, paths[name], n=samples, temperature=1.0)
            print(
                f"recorded {name}: {len(tasks)} tasks x {len(models)} models x {samples} samples in {time.perf_counter() - started:.0f} s",
                flush=True,
            )
    paths["greedy"] = out / "test_greedy"
    if not (paths["greedy"] / "samples.jsonl").is_file():
        record_samples(models, sets["test"], paths["greedy"], n=1, temperature=0.0)
    return {"paths": paths, "tasks": sets}


def offline(paths: dict, seed: int) -> dict:
    warm, test = load_dataset(paths["warm"]), load_dataset(paths["test"])
    both = sampled_dataset(
        "warm+test", warm.sampled + test.sampled, warm.model_names, warm.model_costs, families=GENERATION_FAMILIES
    )
    warm_index, test_index = np.arange(warm.n_questions), np.arange(warm.n_questions, both.n_questions)
    started = time.perf_counter()
    trace = run_variant("rl_focal", both, warm_index, test_index, FocalConfig(), seed, None)
    seconds = time.perf_counter() - started
    w, t = both.subset(warm_index), both.subset(test_index)
    accuracy = {
        name: float((run.answers == t.labels).mean())
        for name, run in (
            ("best_single", baselines.best_single(w, t)),
            ("best_single_per_family", baselines.best_single_per_task(w, t)),
            ("plurality", baselines.plurality(t)),
            ("oracle", baselines.oracle(t)),
        )
    }
    accuracy.update(
        {
            f"single:{both.model_names[j]}": float((run.answers == t.labels).mean())
            for j, run in baselines.single_models(t).items()
        }
    )
    greedy = load_dataset(paths["greedy"])
    for j, name in enumerate(greedy.model_names):
        accuracy[f"greedy:{name}"] = float(
            np.mean(
                [
                    exact_match(task.samples[name][0].split("\n")[0] if task.samples[name] else "", task.reference)
                    for task in greedy.sampled
                ]
            )
        )
    return {
        "rl_focal": float(trace.correct.mean()),
        "calls_per_query": float(trace.models_called.mean()),
        "seconds": seconds,
        "baselines": accuracy,
    }


def live(zoo: Path, paths: dict, tasks: list, seed: int, samples: int, rate: float, workdir: Path) -> dict:
    pool = write_zoo_pool(zoo, NAMES, workdir / "pool.json")
    config = settings().updated(
        {
            "pool_file": pool.resolve(),
            "seed": seed,
            "focal_samples": samples,
            "kafka_session_timeout_ms": 2000,
            "kafka_heartbeat_ms": 500,
        }
    )
    stack = LocalStack(config, workdir)
    try:
        stack.start_learner("--warm-start", str(paths["warm"].resolve()))
        stack.start_worker()
        stack.wait_ready(300)
        time.sleep(5.0)  # the worker reads the warm-started policy the learner announced
        report = asyncio.run(
            play(stack.settings, open_ended_queries(tasks, f"open-{seed}"), rate=rate, idle_timeout_s=120)
        )
        time.sleep(2.0)
    finally:
        stack.stop()
    return {
        "accuracy": report.accuracy,
        "answered": report.answered,
        "no_answer": report.no_answer,
        "calls_per_query": float(np.mean(report.models_called)),
        "p50_ms": report.latency_percentile(50),
        "p99_ms": report.latency_percentile(99),
        "policy_versions": sorted(report.policy_versions),
        "answers_before_the_warm_policy": int(sum(v == 0 for v in report.versions)),
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--zoo", type=Path, default=settings().service.zoo_dir)
    add_seeds(parser)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--skip-live", action="store_true")
    add_out(parser, "bench/out/focal_open")
    args = parser.parse_args()
    quiet_transformers()
    print(f"machine: {machine_facts()}", flush=True)
    recorded = record(args.zoo, args.out, args.samples)
    rows = []
    for seed in args.seeds:
        row = {"seed": seed, "offline": offline(recorded["paths"], seed)}
        print(
            f"seed {seed} offline: RL-Focal {100 * row['offline']['rl_focal']:.1f} % at {row['offline']['calls_per_query']:.2f} calls; "
            + ", ".join(f"{k} {100 * v:.1f}" for k, v in row["offline"]["baselines"].items()),
            flush=True,
        )
        if not args.skip_live:
            row["live"] = live(
                args.zoo,
                recorded["paths"],
                recorded["tasks"]["test"],
                seed,
                args.samples,
                args.rate,
                args.out / f"stack-{seed}",
            )
            print(
                f"seed {seed} live: {100 * row['live']['accuracy']:.1f} % at {row['live']['calls_per_query']:.2f} calls, "
                f"p50 {row['live']['p50_ms']:.0f} ms, p99 {row['live']['p99_ms']:.0f} ms, {row['live']}",
                flush=True,
            )
        rows.append(row)
    summary = {
        "machine": machine_facts(),
        "samples": args.samples,
        "rate": args.rate,
        "rows": rows,
        "rl_focal_mean": float(np.mean([r["offline"]["rl_focal"] for r in rows])),
        "rl_focal_std": float(np.std([r["offline"]["rl_focal"] for r in rows])),
    }
    if not args.skip_live:
        summary["live_mean"] = float(np.mean([r["live"]["accuracy"] for r in rows]))
        summary["live_std"] = float(np.std([r["live"]["accuracy"] for r in rows]))
    write_json(args.out / "results.json", summary, show={k: v for k, v in summary.items() if k != "rows"})


if __name__ == "__main__":
    main()
