"""Portable numerics: torch's scalar CPU kernels and MKL's conditional numerical reproducibility mode.

Torch's CPU kernels round differently per instruction set (AVX-512, AVX2, ...), and training or an RL run is chaotic
in that rounding. A process started with :data:`PORTABLE_NUMERICS` in its environment computes the same floats on
any x86-64 machine with the same package versions (both are read when a process first computes, so they must be set
before it starts: :func:`environment` around the start of a spawned process)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

PORTABLE_NUMERICS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in this process's environment (what a process started inside inherits), restored after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
