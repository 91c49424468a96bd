"""RL-Focal's default budget, chosen on validation sets only (issue 57, item 3).

    python -m bench.accuracy.default_budget [--sets tune bundled plain families zoo] [--zoo-data DIR]
                                            [--candidates alpha 0.4 0.5 cap:0.5] [--seeds 0 1 2]
                                            [--out bench/out/default_budget.json]

The candidates: ``alpha`` (no budget: the cost weight alone, the default before), ``B`` (a budget met on average:
spending under it is pushed up, above it down) and ``cap:B`` (a cap: only spending above it is pushed down;
``FocalConfig.budget_cap``). The validation sets: ``tune``, bbh_dev's tuning half (``task_half``; its holdout half
and every other BBH set stay out); ``bundled``, the stream ``rlens demo`` replays (its costly model is its weakest);
``plain``, ``families`` and ``zoo``, the long single-task streams of :mod:`bench.accuracy.long_streams`. Each cell
is ``rlens replay``'s paper protocol, rl_focal alone, portable numerics, against per-task stacking over every model
on the same split. The rule, fixed before the run: among the candidates with a budget of at most 0.5, the one whose
worst margin over stacking (the mean over seeds, on any set) is the largest; within 0.1 point of it, the cheaper
(the lower mean cost share). The machine is printed first.
"""

from __future__ import annotations

import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")  # portable numerics (as `rlens replay`): before torch loads
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from multiprocessing import get_context  # noqa: E402
from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402

from bench.common.args import add_out, add_seeds, arguments, write_json  # noqa: E402
from bench.common.datasets import SYNTHETIC  # noqa: E402
from bench.common.machine import machine_facts  # noqa: E402
from rlens.evaluation.protocols import Protocol, task_half  # noqa: E402
from rlens.evaluation.replay import replay  # noqa: E402
from rlens.focal.config import FocalConfig  # noqa: E402
from rlens.records.dataset import load_dataset  # noqa: E402
from rlens.records.recorded import RecordedDataset  # noqa: E402
from rlens.settings import settings  # noqa: E402


def config_of(candidate: str) -> FocalConfig:
    """``alpha``, ``B`` or ``cap:B`` as RL-Focal's configuration."""
    if candidate == "alpha":
        return replace(FocalConfig(), budget=None)
    cap = candidate.startswith("cap:")
    return replace(FocalConfig(), budget=float(candidate.removeprefix("cap:")), budget_cap=cap)


def choose(cells: list[dict], candidates: list[str]) -> str:
    """The rule of the module docstring: the largest worst margin over stacking; within 0.1 point, the cheaper."""
    eligible = [c for c in candidates if c != "alpha" and float(c.removeprefix("cap:")) <= 0.5]
    worst = {c: min(cell["margin"] for cell in cells if cell["candidate"] == c) for c in eligible}
    cost = {c: float(np.mean([cell["cost_share"] for cell in cells if cell["candidate"] == c])) for c in eligible}
    best = max(worst.values())
    return min((c for c in eligible if worst[c] >= best - 0.1), key=lambda c: cost[c])


def load(name: str, zoo_data: str | None) -> RecordedDataset:
    """A validation set by name (the module docstring)."""
    if name == "tune":
        return task_half(load_dataset(settings().service.shared_data / "bbh_dev"), "tune")
    if name == "bundled":
        return load_dataset(settings().service.demo_data)
    if name == "zoo":
        return load_dataset(zoo_data)
    return SYNTHETIC[f"synthetic-{name}"]()


def run(name: str, candidate: str, seed: int, zoo_data: str | None) -> dict:
    """One cell's seed: rl_focal and stacking on the paper protocol."""
    start = time.perf_counter()
    replayed = replay(
        load(name, zoo_data), Protocol.paper, seed=seed, config=config_of(candidate), variants=["rl_focal"]
    )
    focal = replayed.results.methods["rl_focal"]
    found = {
        "accuracy": 100 * focal.accuracy,
        "cost_share": focal.cost_share,
        "calls": focal.mean_models_called,
        "stacking": 100 * replayed.results.methods["stacking"].accuracy,
    }
    print(
        f"{name} {candidate} seed {seed}: {found['accuracy']:.2f} % at cost share {found['cost_share']:.3f} "
        f"({found['calls']:.2f} calls), stacking {found['stacking']:.2f} % ({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    return found


def main() -> None:
    parser = arguments(__doc__)
    sets = ["tune", "bundled", "plain", "families", "zoo"]
    parser.add_argument("--sets", nargs="+", default=sets, choices=sets)
    parser.add_argument("--zoo-data", default=None, help="the recorded long zoo stream (bench.accuracy.long_streams)")
    parser.add_argument("--candidates", nargs="+", default=["alpha", "0.4", "0.5", "cap:0.5"])
    parser.add_argument("--jobs", type=int, default=2, help="cells run at once, one process each")
    add_seeds(parser)
    add_out(parser, "bench/out/default_budget.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    if "zoo" in args.sets and args.zoo_data is None:
        print("zoo: skipped (no --zoo-data)", flush=True)
        args.sets.remove("zoo")
    keys = [(name, candidate) for name in args.sets for candidate in args.candidates]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {(key, seed): pool.submit(run, *key, seed, args.zoo_data) for key in keys for seed in args.seeds}
        found = {cell: future.result() for cell, future in futures.items()}
    cells = []
    for name, candidate in keys:
        seeds = [found[(name, candidate), seed] for seed in args.seeds]
        accuracy = [s["accuracy"] for s in seeds]
        stacking = seeds[0]["stacking"]
        cell = {
            "set": name,
            "candidate": candidate,
            "per_seed": np.round(accuracy, 2).tolist(),
            "accuracy": round(float(np.mean(accuracy)), 2),
            "cost_share": round(float(np.mean([s["cost_share"] for s in seeds])), 3),
            "calls": round(float(np.mean([s["calls"] for s in seeds])), 2),
            "stacking": round(stacking, 2),
            "margin": round(float(np.mean(accuracy)) - stacking, 2),
        }
        print(cell, flush=True)
        cells.append(cell)
    chosen = choose(cells, args.candidates)
    print(f"chosen: {chosen}", flush=True)
    write_json(args.out, {"machine": machine_facts(), "seeds": args.seeds, "cells": cells, "chosen": chosen}, indent=1)


if __name__ == "__main__":
    main()
