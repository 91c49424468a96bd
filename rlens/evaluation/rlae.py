"""RLAE against its baselines on open-ended tasks (exact match): each single model, the uniform token ensemble (GaC),
the best static weights found by grid search on the training split, and RL-Focal's selection over the same pool.

RL-Focal needs answer distributions over choices: each model's greedy output is its one sample of an open-ended
dataset (:mod:`rlens.records.open_ended`): the choices of a task are the union of the pool's answers (first lines,
stripped), each model's distribution one-hot on its own answer, and one extra, never selectable choice holds the
label when no model produced the reference, so such tasks count as wrong for every method.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from rlens.records.recorded import RecordedDataset
from rlens.records.open_ended import sampled_dataset
from rlens.records.recorded import SampledTask
from rlens.focal.config import FocalConfig
from rlens.rlae.agent import RLAEConfig
from rlens.rlae.decode import SpanWeightedDecoder, Weights
from rlens.rlae.train import STOP, RLAEAgent
from rlens.zoo.tasks import GenerationTask, exact_match

Progress = Callable[[int], None]


def decode(
    ensemble: SpanWeightedDecoder,
    tasks: list[GenerationTask],
    weights: Weights | RLAEAgent,
    cfg: RLAEConfig,
    batch: int = 64,
    progress: Progress = lambda n: None,
) -> list[str]:
    """The ensemble's greedy outputs, ``batch`` tasks at a time, under fixed weights or an agent's greedy weights
    (the mean of its policy; the agent's own span and token budget then apply)."""
    cfg = weights.cfg if isinstance(weights, RLAEAgent) else cfg
    texts: list[str] = []
    for start in range(0, len(tasks), batch):
        prompts = [t.prompt for t in tasks[start : start + batch]]
        outputs = (
            weights.decode(ensemble, prompts, greedy=True)[0]
            if isinstance(weights, RLAEAgent)
            else ensemble.generate_batch(prompts, weights, max_tokens=cfg.max_tokens, span=cfg.span, stop=STOP)
        )
        texts += [o.text for o in outputs]
        progress(len(prompts))
    return texts


def correct(texts: list[str], tasks: list[GenerationTask]) -> np.ndarray:
    return np.array([exact_match(text, task.reference) for text, task in zip(texts, tasks)])


def simplex_grid(n_models: int, step: float) -> np.ndarray:
    """Every weight vector on the simplex with coordinates in multiples of ``step`` [G, n_models]."""
    parts = round(1 / step)
    if abs(parts * step - 1) > 1e-9:
        raise ValueError(f"the grid step must divide 1, got {step}")
    points = [c for c in itertools.product(range(parts + 1), repeat=n_models) if sum(c) == parts]
    return np.array(points, dtype=np.float64) / parts


@dataclass
class GridSearch:
    best: np.ndarray  # the weights with the highest training accuracy (the first of ties, in grid order)
    grid: np.ndarray  # [G, M]
    accuracy: np.ndarray  # [G] on the tasks searched


def grid_search(
    ensemble: SpanWeightedDecoder,
    tasks: list[GenerationTask],
    cfg: RLAEConfig,
    step: float = 0.25,
    progress: Progress = lambda n: None,
) -> GridSearch:
    grid = simplex_grid(ensemble.n_models, step)
    accuracy = np.array([correct(decode(ensemble, tasks, w, cfg, progress=progress), tasks).mean() for w in grid])
    return GridSearch(grid[int(accuracy.argmax())], grid, accuracy)


def answer_dataset(
    outputs: list[list[str]], tasks: list[GenerationTask], model_names: list[str], families: list[str]
) -> RecordedDataset:
    """The pool's greedy answers [M][N] as an open-ended dataset: one sample per model and task."""
    sampled = [
        SampledTask(
            prompt=task.prompt,
            reference=task.reference,
            family=task.family,
            samples={name: [outputs[m][n]] for m, name in enumerate(model_names)},
        )
        for n, task in enumerate(tasks)
    ]
    return sampled_dataset("zoo-generation", sampled, model_names, np.ones(len(model_names)), families=families)


def rl_focal_correct(
    train_outputs: list[list[str]],
    train: list[GenerationTask],
    test_outputs: list[list[str]],
    test: list[GenerationTask],
    model_names: list[str],
    families: list[str],
    seed: int,
    config: FocalConfig | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """RL-Focal warm-started on the training split, then online on the test stream: (correct, models called) per test task."""
    from rlens.evaluation.replay import run_variant

    data = answer_dataset([a + b for a, b in zip(train_outputs, test_outputs)], train + test, model_names, families)
    threads = torch.get_num_threads()  # run_variant pins one thread (it is meant for worker processes)
    try:
        trace = run_variant(
            "rl_focal",
            data,
            np.arange(len(train)),
            np.arange(len(train), len(train) + len(test)),
            config or FocalConfig(),
            seed,
            None,
        )
    finally:
        torch.set_num_threads(threads)
    return trace.correct, trace.models_called
