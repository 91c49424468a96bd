"""The gateway's ASGI middleware: a body limit with a read timeout, containment of what escapes a handler, and
per-route request metrics with the access log."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import traceback
from pathlib import Path


from rlens.service.common.metrics import GatewayMetrics
from rlens.service.gateway.openai_api import ApiError, error_response

log = logging.getLogger("rlens.gateway")
access_log = logging.getLogger("rlens.gateway.access")


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413, and one that has not arrived whole within
    ``timeout_s`` gets 408, before the app reads any of it (a client that sends headers and a byte holds nothing)."""

    def __init__(self, app, limit: int, timeout_s: float):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send)
        body, more = b"", True
        try:
            async with asyncio.timeout(self.timeout_s):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > self.limit:
                        return await self._refuse(scope, receive, send)
        except TimeoutError:
            late = ApiError(
                408,
                f"the request body did not arrive within {self.timeout_s:g} s",
                "invalid_request_error",
                "request_timeout",
                headers={"Connection": "close"},
            )
            return await error_response(late)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        error = ApiError(
            413, f"the request body is larger than {self.limit} bytes", "invalid_request_error", "request_too_large"
        )
        await error_response(error)(scope, receive, send)


class Contain:
    """ASGI middleware: an unexpected error is a 500 logged by its type, its route and where it was raised (the
    innermost three frames). A whole traceback would log the exception's text, which may hold the request's input (a
    pydantic error quotes it), and prompts are never logged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = [False]

        async def sending(message) -> None:
            started[0] = started[0] or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            route = scope.get("route")
            # where it was raised (the innermost frames' files, lines and functions), never its text
            where = " < ".join(
                f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
                for frame in reversed(traceback.extract_tb(exc.__traceback__)[-3:])
            )
            log.error(
                "internal error on %s: %s at %s",
                route.path if route is not None else scope["path"],
                type(exc).__name__,
                where,
            )
            if not started[0]:
                error = ApiError(500, "internal error (logged by the gateway)", "server_error", "internal_error")
                await error_response(error)(scope, receive, send)


class Measure:
    """ASGI middleware: each request's count by route and status, and its duration by route; and the access log,
    one line per request (a share ``access_sample`` of them; 0: none) on the logger ``rlens.gateway.access``: method,
    route, status, latency, client address, and what the route learnt (key id, tenant, query id, cost; never the
    prompt or the answer)."""

    def __init__(self, app, metrics: GatewayMetrics, access_sample: float = 1.0):
        self.app, self.metrics, self.access_sample = app, metrics, access_sample

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [500]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            path, seconds = route.path if route is not None else "unmatched", time.perf_counter() - started
            self.metrics.requests.labels(path, str(status[0])).inc()
            self.metrics.request_seconds.labels(path).observe(seconds)
            if self.access_sample > 0 and (self.access_sample >= 1 or random.random() < self.access_sample):
                client = scope.get("client")
                fields = {
                    "method": scope.get("method"),
                    "route": path,
                    "status": status[0],
                    "latency_ms": round(1000 * seconds, 2),
                    "client": client[0] if client else None,
                    **scope.get("state", {}).get("access", {}),
                }
                access_log.info("%s %s %d %.1f ms", fields["method"], path, status[0], 1000 * seconds, extra=fields)
