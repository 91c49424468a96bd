"""What every service process shows probes and operators over HTTP: ``/healthz`` (200 while it runs), ``/readyz``
(200 once it can work, else 503 with the reason) and ``/metrics`` (Prometheus, behind the admin token when one is
set), in one place for the worker, the learner (ASGI routes of FastStream's app) and the gateway (FastAPI)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable

from faststream.asgi import AsgiResponse, get
from faststream.asgi.types import ASGIApp
from prometheus_client import CollectorRegistry, make_asgi_app
from redis.exceptions import RedisError

from rlens.service.common.security import admin_allowed

if TYPE_CHECKING:
    from fastapi import FastAPI

    from rlens.settings import Settings


def settings_url(settings: "Settings") -> str:
    """Where a process's HTTP side answers (announced in its readiness mark)."""
    return f"http://{settings.metrics_host}:{settings.metrics_port}"


async def not_ready(core, joined: list[bool]) -> str | None:
    """Why a worker or learner (``core``, with its ``windows``) is not ready: subscribers not joined, Redis down."""
    if not joined:
        return "subscribers have not joined their groups yet"
    try:
        await core.windows.redis.ping()
    except (RedisError, OSError) as exc:
        return f"Redis unreachable ({exc})"
    return None


def admin_token(settings: Settings) -> str | None:
    return settings.admin_token.get_secret_value() if settings.admin_token else None


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
