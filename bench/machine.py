"""What every benchmark prints about the machine it ran on (benchmarks compare only figures from one machine)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


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
