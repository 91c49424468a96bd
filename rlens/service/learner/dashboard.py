"""The live dashboard: what the learner sees, kept as bounded time series per stream, and the page that draws them.

The learner serves ``/dashboard`` (a static page shipped in the package: ``rlens/service/learner/static/``; no CDN, no
internet) and ``/api/dashboard`` (:meth:`Dashboard.snapshot`, JSON), which the page polls every two seconds. Per
stream, every :data:`POINT_EVERY` joined outcomes, a point holds the rolling (last :data:`ROLLING`) accuracy,
reward and label-free confidence, each model's share of the answers (in the Decider's pool, or its mean RLAE
weight) and each called model's accuracy, and the mean feedback delay. Drift events are marked where they happened
(the stream's join count), and the policy versions form a timeline; with gated promotion, the champion, the
candidate with its estimate and interval, and each verdict (promote, drop, roll back, passed). The :data:`STREAMS` most recently active
streams are kept; everything is bounded.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Callable

import numpy as np
from faststream.asgi import AsgiResponse, get
from faststream.asgi.types import ASGIApp

from rlens.messages import DriftEvent
from rlens.service.learner.versions import VersionStats

POINT_EVERY = 5
POINTS = 400
ROLLING = 50
STREAMS = 50
EVENTS = 200
STATIC = Path(__file__).parent / "static"


def _mean(values) -> float | None:
    """The mean of up to ROLLING floats, exactly rounded (math.fsum: no NumPy array made for 50 numbers)."""
    return math.fsum(values) / len(values) if len(values) else None


class StreamSeries:
    def __init__(self, n_models: int):
        self.joins = 0
        self.outcome: deque[float] = deque(maxlen=ROLLING)
        self.reward: deque[float] = deque(maxlen=ROLLING)
        self.confidence: deque[float] = deque(maxlen=ROLLING)
        self.delay: deque[float] = deque(maxlen=ROLLING)
        self.composition: deque[list[float]] = deque(maxlen=ROLLING)
        self.models: list[deque[float]] = [deque(maxlen=ROLLING) for _ in range(n_models)]
        self.points: deque[dict] = deque(maxlen=POINTS)
        self.drift: deque[dict] = deque(maxlen=EVENTS)

    def point(self) -> dict:
        composition = np.mean(self.composition, axis=0).round(4).tolist() if self.composition else []
        return {
            "n": self.joins,
            "t": time.time(),
            "accuracy": _mean(self.outcome),
            "reward": _mean(self.reward),
            "confidence": _mean(self.confidence),
            "delay_s": _mean(self.delay),
            "composition": composition,
            "model_accuracy": [_mean(m) for m in self.models],
        }


class Dashboard:
    def __init__(self, strategy: str, models: list[str], versions: VersionStats | None = None):
        self.strategy, self.models = strategy, models
        self.versions = versions or VersionStats()  # reward and accuracy per served policy version
        self.streams: OrderedDict[str, StreamSeries] = OrderedDict()
        self.policies: deque[dict] = deque(maxlen=EVENTS)
        self.joined = 0
        self.gate: dict | None = None  # gated promotion: champion, candidate and its latest estimate
        self.verdicts: deque[dict] = deque(maxlen=EVENTS)

    def _stream(self, stream: str) -> StreamSeries:
        series = self.streams.get(stream)
        if series is None:
            series = self.streams[stream] = StreamSeries(len(self.models))
            while len(self.streams) > STREAMS:
                self.streams.popitem(last=False)
        self.streams.move_to_end(stream)
        return series

    def observe_answer(self, stream: str, confidence: float, composition: list[float]) -> None:
        """What an answer tells before its feedback: its confidence and which models made it."""
        series = self._stream(stream)
        series.confidence.append(confidence)
        series.composition.append(composition)

    def observe_join(self, stream: str, signals: dict[str, float], reward: float, delay_s: float) -> None:
        series = self._stream(stream)
        series.joins += 1
        self.joined += 1
        series.outcome.append(signals["outcome"])
        series.reward.append(reward)
        series.delay.append(max(delay_s, 0.0))
        for i, name in enumerate(self.models):
            if (value := signals.get(f"model:{name}")) is not None:
                series.models[i].append(value)
        if series.joins % POINT_EVERY == 0:
            series.points.append(series.point())

    def observe_drift(self, event: DriftEvent) -> None:
        series = self._stream(event.stream)
        series.drift.append(
            {
                "n": series.joins,
                "signal": event.signal,
                "before": event.mean_before,
                "after": event.mean_after,
                "t": event.at,
            }
        )

    def observe_policy(self, version: int, note: str = "") -> None:
        self.policies.append({"version": version, "t": time.time(), "joined": self.joined, "note": note})

    def observe_gate(self, champion: int | None, candidate: int | None, kind: str, estimate, events: int) -> None:
        """The gate's state: what is served, what is scored in shadow, and candidate − champion so far."""
        self.gate = {
            "champion": champion,
            "candidate": candidate,
            "kind": kind,
            "events": events,
            "estimate": None if estimate is None else estimate.to_dict(),
        }

    def observe_verdict(self, verdict: str, version: int, estimate) -> None:
        self.verdicts.append(
            {"verdict": verdict, "version": version, "joined": self.joined, "t": time.time(), **estimate.to_dict()}
        )

    def snapshot(self) -> dict:
        streams = [
            {"stream": name, "joins": s.joins, "points": list(s.points), "drift": list(s.drift), "now": s.point()}
            for name, s in reversed(self.streams.items())  # the most recently active first
        ]
        return {
            "strategy": self.strategy,
            "models": self.models,
            "joined": self.joined,
            "policies": list(self.policies),
            "gate": self.gate,
            "verdicts": list(self.verdicts),
            "versions": self.versions.rows(),
            "streams": streams,
            "t": time.time(),
        }


def dashboard_routes(snapshot: Callable[[], dict]) -> list[tuple[str, ASGIApp]]:
    """``/dashboard`` (the page), ``/dashboard.js`` (its script) and ``/api/dashboard`` (``snapshot()`` as JSON)."""
    page, script = (STATIC / "dashboard.html").read_bytes(), (STATIC / "dashboard.js").read_bytes()

    @get
    async def html(scope) -> AsgiResponse:
        return AsgiResponse(page, 200, {"content-type": "text/html; charset=utf-8"})

    @get
    async def javascript(scope) -> AsgiResponse:
        return AsgiResponse(script, 200, {"content-type": "text/javascript; charset=utf-8"})

    @get
    async def api(scope) -> AsgiResponse:
        return AsgiResponse(
            json.dumps(snapshot()).encode(), 200, {"content-type": "application/json", "cache-control": "no-store"}
        )

    return [("/dashboard", html), ("/dashboard.js", javascript), ("/api/dashboard", api)]
