"""What every benchmark prints about the machine it ran on (benchmarks compare only figures from one machine)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np


def cpu_name() -> str:
    """The CPU model, from /proc/cpuinfo where there is one."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
        platform.processor() or "unknown CPU",
    )


def machine_facts() -> str:
    """``CPU, N cores, load L`` (the 1-minute load average when the run started)."""
    return f"{cpu_name()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"


def small_op_us(repeats: int = 5, calls: int = 20_000) -> float:
    """Microseconds per call of a small NumPy operation (``a @ w + b`` on a [1, 16] row), the best of ``repeats``:
    the per-call cost that the service's per-query work is made of, as a yardstick measured in the same run (figures
    in this unit travel between machines better than milliseconds do)."""
    rng = np.random.default_rng(0)
    a, w, b = rng.random((1, 16), dtype=np.float32), rng.random((16, 16), dtype=np.float32), np.ones(16, np.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            a @ w + b
        best = min(best, (time.perf_counter() - started) / calls)
    return 1e6 * best
