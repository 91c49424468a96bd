"""Loopback TCP ports: a free one, and whether one is taken."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``host:port`` now."""
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) == 0
