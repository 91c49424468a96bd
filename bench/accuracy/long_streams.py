"""RL-Focal on long single-task streams, with and without the pools' joint fits, beside stacking (issue 57).

    python -m bench.accuracy.long_streams [--sets plain families zoo] [--zoo-data DIR] [--seeds 0 1 2]
                                          [--budgets none 0.5] [--out bench/out/long_streams.json]

The validation sets: ``plain``, a seeded synthetic stream of 10,000 questions answered by 11 models
(:func:`rlens.evaluation.synthetic.synthetic_dataset`, one task, 4 choices, seed 0); ``families``, the same with the
models in 3 families that share their mistakes; ``zoo``, a long one-task stream of the zoo's real models, recorded
by ``rlens zoo record --families arithmetic --blocks 1 --block-size 2000 --seed 11 --models
smollm2-135m,arith-char,count-bpe,order-char,pattern-bpe --out DIR`` (``--zoo-data DIR``; skipped without it).
Each cell is ``rlens replay``'s paper protocol, rl_focal alone (portable numerics), with ``joint_rows`` 0 (the vote
alone) and the default; the machine is printed first.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from bench.common.args import add_out, add_seeds, arguments, write_json
from bench.common.datasets import SYNTHETIC
from bench.common.machine import machine_facts
from rlens.evaluation.protocols import Protocol
from rlens.evaluation.replay import replay
from rlens.focal.config import FocalConfig
from rlens.records.dataset import load_dataset
from rlens.records.recorded import RecordedDataset


def add_sets(parser: argparse.ArgumentParser) -> None:
    """The options that choose the validation sets (``--sets``, ``--zoo-data``)."""
    parser.add_argument("--sets", nargs="+", default=["plain", "families", "zoo"], choices=["plain", "families", "zoo"])
    parser.add_argument("--zoo-data", default=None, help="the recorded long zoo stream (bench.accuracy.long_streams)")


def validation_sets(args: argparse.Namespace) -> Iterator[tuple[str, RecordedDataset]]:
    """Each chosen set by name, made or loaded when its turn comes; the zoo's skipped (with a line) without its data."""
    for name in args.sets:
        if name == "zoo" and args.zoo_data is None:
            print("zoo: skipped (no --zoo-data)", flush=True)
        elif name == "zoo":
            yield name, load_dataset(args.zoo_data)
        else:
            yield name, SYNTHETIC[f"synthetic-{name}"]()


def main() -> None:
    parser = arguments(__doc__)
    add_sets(parser)
    add_seeds(parser)
    parser.add_argument(
        "--budgets", nargs="+", default=["none"], help="none (alpha alone) or shares of the pool's cost"
    )
    add_out(parser, "bench/out/long_streams.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    rows = []
    for name, data in validation_sets(args):
        for budget in args.budgets:
            cell = {"set": name, "budget": None if budget == "none" else float(budget)}
            for joint_rows in (0, FocalConfig.joint_rows):
                config = replace(FocalConfig(), joint_rows=joint_rows, budget=cell["budget"], budget_cap=False)
                accuracy, calls = [], []
                for seed in args.seeds:
                    start = time.perf_counter()
                    run = replay(data, Protocol.paper, seed=seed, config=config, variants=["rl_focal"], workers=1)
                    focal = run.results.methods["rl_focal"]
                    accuracy.append(100 * focal.accuracy)
                    calls.append(focal.mean_models_called)
                    cell["stacking"] = round(100 * run.results.methods["stacking"].accuracy, 2)
                    print(
                        f"{name} budget {budget} joint_rows {joint_rows} seed {seed}: {accuracy[-1]:.2f} % at "
                        f"{calls[-1]:.2f} calls ({time.perf_counter() - start:.0f} s)",
                        flush=True,
                    )
                cell[f"joint_rows_{joint_rows}"] = {
                    "per_seed": np.round(accuracy, 2).tolist(),
                    "mean": round(float(np.mean(accuracy)), 2),
                    "calls": round(float(np.mean(calls)), 2),
                }
            print(cell, flush=True)
            rows.append(cell)
    write_json(args.out, {"machine": machine_facts(), "seeds": args.seeds, "cells": rows}, indent=1)


if __name__ == "__main__":
    main()
