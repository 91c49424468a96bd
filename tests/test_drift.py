"""Drift detection (rlens.drift): river's detectors per (stream, signal), on hand-made streams."""

from __future__ import annotations

import json
import math

from rlens.drift import DriftConfig, DriftMonitor, signals_of_outcome


def step(before: float, after: float, n_before: int = 300, n_after: int = 300) -> list[float]:
    """A 0/1 stream whose rate of ones steps from ``before`` to ``after``: in every 10 values, round(10 p) ones first."""

    def block(p: float, n: int) -> list[float]:
        ones = round(10 * p)
        return [1.0 if i % 10 < ones else 0.0 for i in range(n)]

    return block(before, n_before) + block(after, n_after)


def feed(monitor: DriftMonitor, values: list[float], stream: str = "s", signal: str = "outcome") -> list:
    return [d for v in values if (d := monitor.observe(stream, signal, v)) is not None]


def test_a_drop_in_accuracy_is_detected_soon_after_the_switch_and_not_before():
    detections = feed(DriftMonitor(), step(0.9, 0.2))
    assert detections, "no detection"
    first = detections[0]
    assert 300 < first.position <= 360  # within 60 queries of the switch at 300
    assert abs(first.mean_before - 0.9) < 0.1 and first.mean_after < 0.5 and 1 <= first.window < first.position
    assert all(b.position - a.position >= 50 for a, b in zip(detections, detections[1:]))  # min_gap


def test_a_stable_stream_raises_no_alarm_and_streams_are_apart():
    monitor = DriftMonitor()
    assert feed(monitor, step(0.8, 0.8, 600, 600)) == []
    assert feed(monitor, step(0.9, 0.1), stream="other")[0].stream == "other"
    assert feed(monitor, step(0.8, 0.8), stream="s") == []  # "s" kept its own detector: still no change there


def test_page_hinkley_also_detects_the_drop():
    detections = feed(DriftMonitor(DriftConfig(detector="page_hinkley")), step(0.9, 0.2))
    assert detections and 300 < detections[0].position <= 400


def test_the_same_values_give_the_same_detections_and_a_restored_monitor_goes_on_alike():
    values = step(0.9, 0.3, 400, 200) + step(0.3, 0.9, 0, 300)
    a, b = DriftMonitor(), DriftMonitor()
    assert [d.position for d in feed(a, values)] == [d.position for d in feed(b, values)]
    original = DriftMonitor(DriftConfig(history=1000))
    feed(original, values[:350])
    restored = DriftMonitor(DriftConfig(history=1000))
    restored.load_json(json.loads(json.dumps(original.to_json())))  # what a checkpoint holds: plain JSON
    assert [(d.position, d.mean_after) for d in feed(original, values[350:])] == [
        (d.position, d.mean_after) for d in feed(restored, values[350:])
    ]


def test_keys_are_bounded_and_non_finite_values_ignored():
    monitor = DriftMonitor(DriftConfig(max_keys=3))
    for i in range(5):
        monitor.observe(f"s{i}", "outcome", 1.0)
    assert [stream for stream, _ in monitor.keys] == ["s2", "s3", "s4"]
    assert monitor.observe("s4", "outcome", math.nan) is None and monitor.keys[("s4", "outcome")].count == 1


def test_outcome_signals_by_hand():
    models = ["a", "b", "c"]
    assert signals_of_outcome(2, 2, 0.7, [2, -1, 0], models) == {"outcome": 1.0, "model:a": 1.0, "model:c": 0.0}
    assert signals_of_outcome(1, 2, 0.7, [2, -1, 0], models) == {"outcome": 0.0, "model:a": 1.0, "model:c": 0.0}
    assert signals_of_outcome(None, None, 1.0, None, models) == {"outcome": 1.0}  # open-ended: exact match (reward 1)
    assert signals_of_outcome(3, None, -0.5, [1, 1, 1], models) == {"outcome": 0.0}  # a bare reward, no label


def test_replay_with_one_stream_key_detects_the_task_switch_and_the_reaction_trims_the_window(zoo):
    from rlens.focal.engine import FocalEngine
    from rlens.focal.schedule import run_online

    data = zoo.subset(list(range(240)))  # ordering (120), then antonyms (120)

    def run(reaction: str):
        engine = FocalEngine(zoo.n_models, zoo.model_costs, seed=0)
        return engine, run_online(engine, data, stream="one", drift=DriftMonitor(), reaction=reaction, keep=5)

    _, plain = run("none")
    _, again = run("none")
    engine, trimmed = run("trim")
    assert plain.detections == again.detections and plain.label_free == again.label_free  # deterministic under the seed
    assert all(0 <= i < 240 for i in plain.label_free)
    switch = [i for i, _ in plain.detections if i >= 120]
    assert switch and switch[0] < 200 and list(engine.windows) == ["one"]
    last = trimmed.detections[-1][0]
    assert engine.window("one").n_rows == min(engine.cfg.window, 5 + 239 - last)  # trimmed to 5 at the last detection
