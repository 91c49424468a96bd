"""What every benchmark prints about the machine it ran on (benchmarks compare only figures from one machine)."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Iterable
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


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (Linux: /proc/<pid>/stat); a process that
    has ended counts nothing."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the line)
    return ticks / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux: each process's parent from /proc/<pid>/stat)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(parents.get(tree[-1], []))
    return tree


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (Linux: /proc/<pid>/status); NaN when it is not there."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
