"""The HTTP server every service process runs (the gateway's API; a worker's or learner's ``/healthz``, ``/readyz``,
``/metrics``; a model server's): uvicorn's, woken once a second while idle instead of ten times.

uvicorn's main loop wakes every 0.1 s to refresh its ``date`` header (once a second) and to see whether a signal
asked it to stop: a bare server idle took 0.002 of a core, against 0.0002-0.0005 woken once a second (BENCHMARKS.md).
Here it wakes once a second for the header, and at once when a stop signal comes.
"""

from __future__ import annotations

import asyncio
import sys
from types import FrameType

import uvicorn
from uvicorn.config import STARTUP_FAILURE


class QuietServer(uvicorn.Server):
    """``uvicorn.Server`` whose main loop ticks every ``tick_s`` (its date header still changes each second) and wakes
    at once on SIGINT or SIGTERM."""

    tick_s = 1.0

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self._woken: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._woken, self._loop = asyncio.Event(), asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864_000  # a multiple of 10: each tick refreshes the date header
            try:
                await asyncio.wait_for(self._woken.wait(), self.tick_s)
            except TimeoutError:
                pass
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._woken is not None:
            self._loop.call_soon_threadsafe(self._woken.set)


def serve(app, **options) -> None:
    """``uvicorn.run(app, **options)`` on a :class:`QuietServer`: Ctrl-C ends it quietly, a server that could not
    start exits with uvicorn's code for that."""
    server = QuietServer(uvicorn.Config(app, **options))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(STARTUP_FAILURE)
