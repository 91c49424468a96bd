"""Evaluation protocols: which questions warm-start the agents and which form the online test stream, and which
tasks may be used to choose settings (:func:`task_half`)."""

from __future__ import annotations

from enum import Enum
from typing import Literal

import numpy as np

from rlens.records.recorded import RecordedDataset

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


def task_half(data: RecordedDataset, half: Literal["tune", "holdout"]) -> RecordedDataset:
    """The questions of half the tasks, in stream order: ``tune`` the tasks at even positions of the sorted task ids,
    ``holdout`` those at odd positions. Settings are chosen on ``tune``; ``holdout`` reports figures on tasks that
    played no part in choosing them."""
    ids = np.unique(data.task)
    chosen = ids[0::2] if half == "tune" else ids[1::2]
    return data.subset(np.flatnonzero(np.isin(data.task, chosen)))
