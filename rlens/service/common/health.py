"""What every service process shows probes and operators over HTTP: ``/healthz`` (200 while it runs), ``/readyz``
(200 once it can work, else 503 with the reason) and ``/metrics`` (Prometheus, behind the admin token when one is
set), in one place for the worker, the learner (ASGI routes of FastStream's app) and the gateway (FastAPI)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable

from faststream.asgi import AsgiResponse, get
from faststream.asgi.types import ASGIApp
from prometheus_client import CollectorRegistry, make_asgi_app
from redis.exceptions import RedisError

from rlens.service.common.security import admin_allowed

if TYPE_CHECKING:
    from fastapi import FastAPI

    from rlens.service.common.windows import RedisWindows
    from rlens.settings import Settings


def settings_url(settings: "Settings") -> str:
    """Where a process's HTTP side answers (announced in its readiness mark)."""
    return f"http://{settings.metrics.host}:{settings.metrics.port}"


class Readiness:
    """A process's readiness: ready once it runs (its subscribers joined, its broker connected) and while Redis
    answers; its mark in Redis (role, name, HTTP address: what ``rlens up`` and operators read) renewed until it
    stops, and extra keep-alive tasks (a gateway's reply topic) stopped with it."""

    def __init__(self, role: str, name: str, url: str, waiting: str = "subscribers have not joined their groups yet"):
        self.role, self.name, self.url, self.waiting = role, name, url, waiting
        self.windows: RedisWindows | None = None  # set by start
        self.tasks: list[asyncio.Task] = []

    def start(self, windows: RedisWindows, *keep: Awaitable) -> None:
        self.windows = windows
        self.tasks = [asyncio.create_task(windows.keep_ready(self.role, self.name, self.url))]
        self.tasks += [asyncio.create_task(k) for k in keep]  # type: ignore[arg-type]

    async def stop(self) -> None:
        """Stop renewing (first: the renewal would set the mark again) and take the mark down."""
        for task in self.tasks:
            task.cancel()
        if self.windows is not None:
            await self.windows.mark_ready(self.role, self.name, ready=False)

    async def not_ready(self) -> str | None:
        """Why the process is not ready, or None."""
        if self.windows is None:
            return self.waiting
        try:
            await self.windows.redis.ping()
        except (RedisError, OSError) as exc:
            return f"Redis unreachable ({exc})"
        return None


def admin_token(settings: Settings) -> str | None:
    return settings.security.admin_token.get_secret_value() if settings.security.admin_token else None


def admin_only(app: ASGIApp, token: str | None) -> ASGIApp:
    """``app`` behind the admin token (:func:`rlens.service.common.security.admin_allowed`): 401 with a Basic challenge
    without it, so that a browser asks for it once and sends it with the dashboard's own requests."""
    if token is None:
        return app

    async def guarded(scope, receive, send) -> None:
        authorization = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        if scope["type"] == "http" and not admin_allowed(authorization, token):
            challenge = {"www-authenticate": 'Basic realm="rlens monitoring"'}
            return await AsgiResponse(b"the admin token is needed here\n", 401, challenge)(scope, receive, send)
        await app(scope, receive, send)

    return guarded


def http_routes(
    registry: CollectorRegistry,
    not_ready: Callable[[], Awaitable[str | None]],
    token: str | None = None,
    monitoring: list[tuple[str, ASGIApp]] | None = None,
) -> list[tuple[str, ASGIApp]]:
    """``/healthz`` and ``/readyz`` (``not_ready()``: why the process is not ready, or None), open to probes;
    ``/metrics`` and the ``monitoring`` routes (the learner's dashboard) behind the admin ``token`` when set."""

    @get
    async def healthz(scope) -> AsgiResponse:
        return AsgiResponse(b"ok\n", 200)

    @get
    async def readyz(scope) -> AsgiResponse:
        reason = await not_ready()
        return AsgiResponse(b"ready\n", 200) if reason is None else AsgiResponse(f"not ready: {reason}\n".encode(), 503)

    guarded = [
        (path, admin_only(app, token)) for path, app in [("/metrics", make_asgi_app(registry)), *(monitoring or [])]
    ]
    return [*guarded, ("/healthz", healthz), ("/readyz", readyz)]


class _Asgi:
    """An ASGI app as a Starlette route's endpoint (a plain function would be taken for a request handler)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def add_http_routes(app: FastAPI, routes: list[tuple[str, ASGIApp]]) -> None:
    """The routes of :func:`http_routes` on a FastAPI app (the gateway), outside its OpenAPI document."""
    from starlette.routing import Route

    for path, route in routes:
        app.router.routes.append(Route(path, _Asgi(route), include_in_schema=False))
