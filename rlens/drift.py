"""Drift detection per stream: river's change detectors on the signals of each stream, one detector per
(stream, signal). Pure (no I/O) and deterministic: the learner and ``rlens replay`` feed it the same way.

Signals (:func:`signals_of_outcome`; the label-free one from the trainers' ``confidence``):
- ``outcome``: 1 when the ensemble's answer was right (the label; exact match for open-ended; reward > 0 for a
  bare reward), else 0, when its feedback is joined;
- ``model:<name>``: 1 when that model's top choice was right, for each model the query called (multiple choice);
- ``confidence``: label-free and early, on the answer itself: the Fusion agent's probability of its answer
  (rl_focal), the agent's value estimate (rlae). It moves when the inputs change, before any feedback arrives.

Each detection is a :class:`Detection` with the means before and after the change. A key detects at most once
per ``min_gap`` observations. The state a checkpoint keeps is each key's count and its last ``history`` values:
:meth:`DriftMonitor.load_json` rebuilds the detectors by feeding them those values again (river's detectors hold
native state that only pickle would save, and the service keeps no pickle).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Literal

from river import drift

Detector = Literal["adwin", "page_hinkley"]
RECENT, BEFORE = 20, 100  # a detection's means: of the last RECENT values, and of the BEFORE values before them


@dataclass(frozen=True)
class DriftConfig:
    detector: Detector = "adwin"
    delta: float = (
        0.05  # ADWIN's confidence (smaller: fewer false alarms, later detections); chosen on zoo_mc (BENCHMARKS.md)
    )
    clock: int = 8  # ADWIN checks for a change every this many observations
    threshold: float = 10.0  # Page-Hinkley's threshold (on 0/1 and [0, 1] signals)
    min_gap: int = 20  # observations between two detections of one key
    history: int = 500  # values kept per key (the state a checkpoint holds)
    max_keys: int = 20_000  # (stream, signal) keys followed at once; the least recently seen is forgotten


@dataclass(frozen=True)
class Detection:
    stream: str
    signal: str
    position: int  # how many values of this (stream, signal) came before and with this one
    mean_before: float  # of the BEFORE values before the last RECENT
    mean_after: float  # of the last RECENT values
    window: int  # values the detector kept after the change (ADWIN's width; Page-Hinkley: all it saw)


def make_detector(config: DriftConfig):
    if config.detector == "adwin":
        return drift.ADWIN(delta=config.delta, clock=config.clock)
    if config.detector == "page_hinkley":
        return drift.PageHinkley(threshold=config.threshold, delta=0.005, min_instances=30)
    raise ValueError(f"unknown drift detector {config.detector!r} (adwin, page_hinkley)")


class _Key:
    """One (stream, signal): its detector, count, recent values and last detection."""

    def __init__(self, config: DriftConfig):
        self.detector = make_detector(config)
        self.count = 0
        self.values: deque[float] = deque(maxlen=config.history)
        self.last_detection = -(10**9)

    def add(self, value: float) -> bool:
        self.count += 1
        self.values.append(value)
        self.detector.update(value)
        return self.detector.drift_detected


class DriftMonitor:
    def __init__(self, config: DriftConfig | None = None):
        self.config = config or DriftConfig()
        self.keys: OrderedDict[tuple[str, str], _Key] = OrderedDict()

    def observe(self, stream: str, signal: str, value: float) -> Detection | None:
        """Add one value of ``signal`` on ``stream``; the detection it completes, if any."""
        if not math.isfinite(value):
            return None
        key = self._key(stream, signal)
        if not key.add(value) or key.count - key.last_detection < self.config.min_gap:
            return None
        key.last_detection = key.count
        values = list(key.values)
        after, before = values[-RECENT:], values[-RECENT - BEFORE : -RECENT]
        return Detection(stream, signal, key.count, _mean(before), _mean(after), self._window(key))

    def _key(self, stream: str, signal: str) -> _Key:
        name = (stream, signal)
        key = self.keys.get(name)
        if key is None:
            key = self.keys[name] = _Key(self.config)
            while len(self.keys) > self.config.max_keys:
                self.keys.popitem(last=False)
        else:
            self.keys.move_to_end(name)
        return key

    @staticmethod
    def _window(key: _Key) -> int:
        width = getattr(key.detector, "width", None)  # ADWIN: the values it kept after dropping the old ones
        return int(width) if width is not None else key.count

    def to_json(self) -> list:
        return [
            [stream, signal, key.count, key.last_detection, list(key.values)]
            for (stream, signal), key in self.keys.items()
        ]

    def load_json(self, state: list) -> None:
        """Rebuild every key's detector by feeding it the kept values (no detection is reported while doing so)."""
        self.keys.clear()
        for stream, signal, count, last_detection, values in state:
            key = self._key(stream, signal)
            for value in values:
                key.add(value)
            key.count, key.last_detection = count, last_detection


@dataclass(frozen=True)
class DriftFigures:
    """How detections and answers went around the task switches of a stream (see :func:`drift_figures`)."""

    delays: list[int]  # per detected switch: queries from the switch to its first detection
    missed_switches: int  # switches with no detection in the first half of their block
    switches: int
    false_alarms_per_1000: float  # detections in a block's second half (or in the first block), per 1,000 queries
    recovery: list[int]  # per switch: queries until the rolling accuracy is back (see recovery_time)


RECOVERY_ROLLING, RECOVERY_TOLERANCE = 20, 0.02


def task_blocks(task) -> list[tuple[int, int]]:
    """(start, end) of each run of one task in a stream."""
    starts = [0, *(i + 1 for i in range(len(task) - 1) if task[i + 1] != task[i])]
    return list(zip(starts, [*starts[1:], len(task)]))


def recovery_time(correct, start: int, end: int) -> int:
    """Queries from a switch at ``start`` until the rolling accuracy over the block's last RECOVERY_ROLLING answers
    is within RECOVERY_TOLERANCE of the accuracy of the block's second half; the block's length if never."""
    level = _mean(list(correct[(start + end) // 2 : end]))
    for t in range(start + RECOVERY_ROLLING - 1, end):
        if _mean(list(correct[t - RECOVERY_ROLLING + 1 : t + 1])) >= level - RECOVERY_TOLERANCE:
            return t - start + 1
    return end - start


def drift_figures(correct, detections: list[int], task) -> DriftFigures:
    """Detection delays, missed switches, false alarms and recovery times of a stream with known task switches
    (``correct``: per query, the answer was right; ``detections``: the queries whose outcome completed one)."""
    blocks = task_blocks(task)
    delays, missed, false_alarms = [], 0, 0
    for b, (start, end) in enumerate(blocks):
        middle = (start + end) // 2
        early = [d for d in detections if start <= d < middle]
        if b == 0:
            false_alarms += len(early)  # no switch before the first block
        elif early:
            delays.append(early[0] - start)
        else:
            missed += 1
        false_alarms += sum(1 for d in detections if middle <= d < end)
        # detections after the first early one, within the first half, are the same switch seen again: not counted
    return DriftFigures(
        delays,
        missed,
        len(blocks) - 1,
        1000 * false_alarms / max(len(correct), 1),
        [recovery_time(correct, s, e) for s, e in blocks[1:]],
    )


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def signals_of_outcome(
    answer_index: int | None, label: int | None, reward: float, predictions: list[int] | None, models: list[str]
) -> dict[str, float]:
    """The labelled signals of one joined outcome: ``outcome`` and, where a label and the models' predictions are
    known, ``model:<name>`` for each model that answered (prediction -1: not called or failed)."""
    signals = {
        "outcome": float(answer_index == label) if label is not None and answer_index is not None else float(reward > 0)
    }
    if label is not None and predictions is not None:
        signals.update({f"model:{name}": float(p == label) for name, p in zip(models, predictions) if p >= 0})
    return signals
