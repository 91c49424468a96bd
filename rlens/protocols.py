"""Evaluation protocols: which questions warm-start the agents and which form the online test stream."""

from __future__ import annotations

from enum import Enum

import numpy as np

from rlens.dataset import RecordedDataset

WARM_FRACTION = 0.8


class Protocol(str, Enum):
    paper = "paper"  # per task: first 80% warm-start split, last 20% online test stream
    stream = "stream"  # no warm start: the whole stream in order, from a cold start (prequential)


def split(data: RecordedDataset, protocol: Protocol) -> tuple[np.ndarray, np.ndarray]:
    """(warm-start indices, test-stream indices), both in original stream order."""
    everything = np.arange(data.n_questions)
    if protocol == Protocol.stream:
        return everything[:0], everything
    warm = np.zeros(data.n_questions, dtype=bool)
    for task_id in np.unique(data.task):
        rows = np.flatnonzero(data.task == task_id)
        warm[rows[: int(round(WARM_FRACTION * len(rows)))]] = True
    return everything[warm], everything[~warm]
