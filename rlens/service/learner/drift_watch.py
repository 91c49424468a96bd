"""The learner's drift watch: each stream's signals to a :class:`rlens.drift.DriftMonitor`; each detection becomes a
:class:`DriftEvent` (published by the app, counted, shown on the dashboard). With ``keep`` set
(``RLENS_DRIFT_REACTION=trim``), a detection on a labelled signal trims the stream's Redis window to its last
``keep`` outcomes."""

from __future__ import annotations

import logging
import math
import time

from redis.exceptions import RedisError

from rlens.drift import DriftMonitor
from rlens.messages import DriftEvent
from rlens.service.common.metrics import LearnerMetrics
from rlens.service.common.windows import RedisWindows
from rlens.service.learner.dashboard import Dashboard

log = logging.getLogger("rlens.learner")
LOGGED_SHIFT = 0.05  # a detection whose means moved less than this is not logged (it is still an event)


class DriftWatch:
    def __init__(self, monitor: DriftMonitor | None, keep: int | None, dashboard: Dashboard):
        self.monitor, self.keep, self.dashboard = monitor, keep, dashboard
        self.events: list[DriftEvent] = []  # detections since the app last took them

    def to_json(self) -> list:
        """The detectors' state (in the learner's checkpoint)."""
        return self.monitor.to_json() if self.monitor is not None else []

    def load_json(self, state: list) -> None:
        if self.monitor is not None:
            self.monitor.load_json(state)

    def take_events(self) -> list[DriftEvent]:
        """The detections since the last call."""
        taken, self.events = self.events, []
        return taken

    def observe(
        self, stream: str, signals: dict[str, float], query_id: str, metrics: LearnerMetrics | None = None
    ) -> bool:
        """Feed each signal's value to its detector (and to ``metrics``); whether any detected a change."""
        if metrics is not None:
            metrics.observe_signals(stream, signals)
        if self.monitor is None:
            return False
        detected = False
        for signal, value in signals.items():
            found = self.monitor.observe(stream, signal, value)
            if found is None:
                continue
            detected = True
            before = None if math.isnan(found.mean_before) else found.mean_before
            event = DriftEvent(
                stream=stream,
                signal=signal,
                detector=self.monitor.config.detector,
                position=found.position,
                query_id=query_id,
                mean_before=before,
                mean_after=found.mean_after,
                window=found.window,
                at=time.time(),
            )
            self.events.append(event)
            self.dashboard.observe_drift(event)
            # a shift too small to act on (a confidence of 0.94 -> 0.95) is published and counted, not logged
            small = before is not None and abs(found.mean_after - before) < LOGGED_SHIFT
            log.log(
                logging.DEBUG if small else logging.INFO,
                "drift on stream %s, %s: %s -> %.2f (value %d)",
                stream,
                signal,
                "?" if before is None else f"{before:.2f}",
                found.mean_after,
                found.position,
            )
            if metrics is not None:
                metrics.drift_events.labels(metrics.stream(stream), signal).inc()
        return detected

    async def react(self, stream: str, windows: RedisWindows) -> bool:
        """Trim the drifted stream's window to its last ``keep`` outcomes (best-effort: Redis may be down); whether
        it was trimmed. The caller applies its queued outcomes first."""
        if self.keep is None:
            return False
        try:
            await windows.keep_last(stream, self.keep)
        except (RedisError, OSError) as exc:
            log.warning("Redis unreachable (%s): the window of drifted stream %s was not trimmed", exc, stream)
            return False
        return True
