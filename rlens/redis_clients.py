"""Every Redis client of the service, from one URL: a single server, a Sentinel-watched master, or a Redis Cluster.

- ``redis://[[user]:password@]host:port[/db]`` (``rediss://`` with TLS, ``unix://``): one server (redis-py's own form);
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/<service>[/db]`` (``rediss+sentinel://``): the master
  the Sentinels at those addresses name for ``<service>``, found again after a failover (the password is the
  master's and its replicas'; the Sentinels are asked without one);
- ``redis+cluster://[[user]:password@]host:port[,host:port...]`` (``rediss+cluster://``): a Redis Cluster from those
  startup nodes (database 0, the only one a cluster has); every key is routed to its slot's master, and a slot that
  moves (a failover, a resharding) is followed.

Every key the service writes in one command or script carries a hash tag (``{stream}``, ``{key id}``, ...), so each
script touches one slot; pipelines are not transactions, so a cluster spreads them over its nodes. A script run
in a pipeline (:func:`run_scripts`) is sent by its digest, loaded only where a server lacks it, and whole in a
cluster's pipeline, whose nodes (a replica that just became master) may not have it cached.

Under uvloop, a command written to a connection whose transport closed (its server killed: a failover) raises
RuntimeError ("the handler is closed") where Python's own loop raises an OSError, which redis-py makes a
ConnectionError: a lost connection it can recover from, and a 503 at the gateway. :func:`async_redis` (and
:func:`closed_transport_is_a_lost_connection` for a pool built apart) makes uvloop's error the same ConnectionError
(MagicStack/uvloop#506).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster")


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names."""

    kind: Literal["single", "sentinel", "cluster"]
    url: str  # the URL itself (single: what redis-py's from_url reads)
    nodes: tuple[tuple[str, int], ...] = ()  # sentinel: the Sentinels; cluster: the startup nodes
    service: str = ""  # sentinel: the master's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def parse_redis_url(url: str) -> RedisTarget:
    """The target of a Redis URL (:data:`SCHEMES`), or ValueError saying what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"not a Redis URL (its scheme must be one of {', '.join(SCHEMES)}, got {parts.scheme!r})")
    if "+" not in parts.scheme:
        return RedisTarget("single", url)
    kind: Literal["sentinel", "cluster"] = "sentinel" if parts.scheme.endswith("sentinel") else "cluster"
    credentials, _, hosts = parts.netloc.rpartition("@")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    nodes = []
    for address in hosts.split(","):
        host, _, port = address.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{parts.scheme} URL: {address!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    service, db = "", 0
    if kind == "sentinel":
        if not path:
            raise ValueError(f"{parts.scheme} URL: the master's service name is missing (…/<service>[/db])")
        service = unquote(path[0])
        db = int(path[1]) if len(path) > 1 and path[1].isdigit() else 0
        if len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise ValueError(f"{parts.scheme} URL: the path is /<service>[/db], got {parts.path!r}")
    elif path and path != ["0"]:
        raise ValueError(f"{parts.scheme} URL: a Redis Cluster has database 0 only, got {parts.path!r}")
    return RedisTarget(
        kind,
        url,
        tuple(nodes),
        service,
        db,
        unquote(username) or None,
        unquote(password) or None,
        parts.scheme.startswith("rediss"),
    )


def async_redis(url: str, **options: Any) -> Any:
    """An asyncio client of ``url`` (redis.asyncio's Redis, or its RedisCluster); ``options``: redis-py's connection
    options (timeouts, health checks, retries, ``max_connections``)."""
    from redis.asyncio import Redis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.sentinel import Sentinel

    closed_transport_is_a_lost_connection()
    return _client(url, options, Redis, RedisCluster, ClusterNode, Sentinel)


def closed_transport_is_a_lost_connection() -> None:
    """redis-py's asyncio connections (every kind: plain, TLS, Unix socket) raise its ConnectionError where uvloop
    refuses a write to a closed transport with RuntimeError; once per process."""
    from redis.asyncio.connection import AbstractConnection
    from redis.exceptions import ConnectionError as RedisConnectionError

    send = AbstractConnection.send_packed_command
    if getattr(send, "closed_transport_is_a_lost_connection", False):
        return

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        try:
            await send(self, command, check_health)
        except RuntimeError as exc:  # redis-py disconnected the connection already
            if "handler is closed" not in str(exc):
                raise
            raise RedisConnectionError("Error while writing to socket: the connection was closed.") from exc

    send_packed_command.closed_transport_is_a_lost_connection = True  # type: ignore[attr-defined]
    AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]


def sync_redis(url: str, **options: Any) -> Any:
    """:func:`async_redis` for blocking code (the CLI, the workers' output cache, the local stack)."""
    from redis import Redis
    from redis.cluster import ClusterNode, RedisCluster
    from redis.sentinel import Sentinel

    return _client(url, options, Redis, RedisCluster, ClusterNode, Sentinel)


def _client(url: str, options: dict, redis: Any, cluster: Any, node: Any, sentinel: Any) -> Any:
    """The client of ``url`` built from one flavour's classes (asyncio or blocking)."""
    target = parse_redis_url(url)
    if target.kind == "single":
        return redis.from_url(url, **options)
    auth: dict[str, Any] = {"username": target.username, "password": target.password, "ssl": target.ssl}
    if target.kind == "cluster":
        return cluster(startup_nodes=[node(h, p) for h, p in target.nodes], **auth, **options)
    sentinels = sentinel(list(target.nodes), sentinel_kwargs=_sentinel_options(options), **auth, **options)
    return sentinels.master_for(target.service, db=target.db)


def _sentinel_options(options: dict) -> dict:
    """How the Sentinels themselves are asked: the same timeouts, no password (a Sentinel's own is rare)."""
    return {k: v for k, v in options.items() if k in ("socket_timeout", "socket_connect_timeout")}


async def run_scripts(redis: Any, script: Any, calls: list[tuple[list, list]]) -> list:
    """Run a registered script (``register_script``) once per ``(keys, args)``, in order, in one pipelined round
    trip; the results. By its digest alone (redis-py's pipeline asks the server whether it has its scripts first: a
    second round trip every time); where the server lacks it (restarted, or its scripts flushed) every call failed,
    so the script is loaded and the pipeline sent again. Whole (EVAL) in a Redis Cluster's pipeline, whose nodes (a
    replica that just became master) may not have it cached."""
    from redis.asyncio.cluster import RedisCluster
    from redis.exceptions import NoScriptError

    whole = isinstance(redis, RedisCluster)
    for attempt in range(2):
        async with redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                if whole:
                    pipe.eval(script.script, len(keys), *keys, *args)
                else:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
        missing = [r for r in results if isinstance(r, NoScriptError)]
        if not missing or attempt or len(missing) < len(results):
            break
        script.sha = await redis.script_load(script.script)
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results
