"""Loopback TCP ports: a free one, and whether one is taken."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000  # free ports are drawn from here up to the kernel's ephemeral range
DRAW = random.SystemRandom()  # not the seeded module generator: processes seeded alike must not draw alike


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now, drawn below the kernel's ephemeral range
    where it is known: a port chosen now and bound a few seconds later (a service's HTTP side, a broker) is then not
    taken meanwhile by the local end of some process's outgoing connection, which the kernel draws from that range.
    Elsewhere, one the kernel picks."""
    try:
        first_ephemeral = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 0
    if first_ephemeral > LOWEST + 1000:
        for port in DRAW.sample(range(LOWEST, first_ephemeral), 50):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``host:port`` now."""
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) == 0
