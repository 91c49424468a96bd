"""Where a request's time went, stage by stage: the gateway's own steps as they happen, then the wait for the
answer split with the worker's own figures (``Answer.latency_ms``, ``Answer.model_ms``), so no clock of another
process is read.

Stages: ``admit`` (checks, the key's rate bucket and budget, an ``Idempotency-Key``), ``state`` (the query's record
in Redis, before and after publishing), ``publish`` (the query record to Kafka, acknowledged), ``kafka`` (the rest of
the wait: the broker both ways, the worker's and the gateway's consumers waiting to fetch), ``worker`` (the
worker's own code, from taking the query to publishing the answer, less the models), ``models`` (the models' time)
and ``respond`` (the completion built). Reported in the ``Server-Timing`` header (W3C; a browser's developer tools
draw it), in ``rlens_gateway_stage_seconds{stage}`` and on the request's span (``rlens.stage.<stage>_ms``).
"""

from __future__ import annotations

import time

from rlens.messages import Answer


class Stages:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        """The time since the last mark (or the start) was spent in ``stage``."""
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now

    def answered(self, answer: Answer) -> None:
        """The wait up to now was for ``answer``: split it into the worker's, the models' and Kafka's parts."""
        self.mark("wait")
        wait = self.seconds.pop("wait")
        worker, models = answer.latency_ms / 1000, answer.model_ms / 1000
        self.seconds.update(
            kafka=max(wait - worker, 0.0) + self.seconds.get("kafka", 0.0),
            worker=max(worker - models, 0.0),
            models=models,
        )

    def header(self) -> str:
        """The ``Server-Timing`` value: ``admit;dur=0.41, state;dur=0.62, ...`` (milliseconds)."""
        return ", ".join(f"{stage};dur={1000 * s:.2f}" for stage, s in self.seconds.items())
