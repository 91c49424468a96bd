"""The learner's large keyed state on disk by its changes, so that a checkpoint costs what changed since the one
before, not what is held (the halves waiting for their other half, the recent query ids).

A :class:`Journal` is one append-only file per generation, ``journal/{name}-{generation:06d}.jsonl`` beside the
checkpoints, each line one change: ``["+", key, value]`` (set) or ``["-", key]`` (delete). A checkpoint appends
the changes since the one before, fsyncs, and records the mark ``[generation, bytes]`` in its ``state.json``;
restoring replays the file up to the mark, and cuts off what a later checkpoint that never completed wrote after
it (the records behind those changes are read again from Kafka, from the checkpoint's offsets). Once a file holds
more than twice as many changes as there are live keys (plus ``floor``), the next checkpoint starts a new
generation holding only the live keys: a cost that grows with what is held, paid once per as many changes. The
files of the newest ``keep`` + 1 generations stay, for the older checkpoints that still refer to them.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Protocol

from rlens.checkpoint import fsync_dir

log = logging.getLogger("rlens.learner")

Change = list  # ["+", key, value] or ["-", key]
Mark = list[int]  # [generation, bytes]


class Journaled(Protocol):
    """A keyed collection that keeps its changes since the last checkpoint."""

    changes: list

    def __len__(self) -> int: ...

    def changes_as_json(self) -> Iterable[Change]: ...

    def live(self) -> Iterable[Change]:
        """Every live key as a change that sets it, oldest first."""
        ...


class Journal:
    def __init__(self, directory: Path, name: str, keep: int = 3, floor: int = 10_000):
        self.directory, self.name, self.keep, self.floor = Path(directory), name, keep, floor
        self.directory.mkdir(parents=True, exist_ok=True)
        self.generation = max(self._generations(), default=0)  # a fresh learner's first write starts the next
        self.lines = 0  # changes in the current generation's file
        self.fresh = True  # nothing written or restored yet: the next write starts a generation

    def _path(self, generation: int) -> Path:
        return self.directory / f"{self.name}-{generation:06d}.jsonl"

    def _generations(self) -> list[int]:
        pattern = re.compile(rf"{re.escape(self.name)}-(\d+)\.jsonl")
        return [int(m.group(1)) for p in self.directory.iterdir() if (m := pattern.fullmatch(p.name))]

    def restore(self, mark: Mark) -> Iterator[Change]:
        """The changes up to ``mark``, oldest first; appending then continues from there."""
        generation, size = int(mark[0]), int(mark[1])
        path = self._path(generation)
        data = path.read_bytes()[:size] if path.is_file() else b""
        if len(data) < size:
            log.error(
                "journal %s holds %d of the %d bytes its checkpoint wrote: the changes after byte %d are lost "
                "(a half held among them expires unmatched, a recent id among them may be joined again)",
                path,
                len(data),
                size,
                len(data),
            )
            data = data[: data.rfind(b"\n") + 1]
        if path.is_file():
            with path.open("r+b") as f:
                f.truncate(len(data))
        self.generation, self.lines, self.fresh = generation, data.count(b"\n"), not path.is_file()
        for line in data.splitlines():
            yield json.loads(line)

    def write(self, held: Journaled) -> Mark:
        """Append ``held``'s changes, or start a new generation with every live key of it when the file has grown
        past twice as many changes as live keys, plus ``floor``; fsynced; then ``held``'s changes are cleared. The
        mark a checkpoint records."""
        compact = self.fresh or self.lines + len(held.changes) > 2 * len(held) + self.floor
        if compact:
            self.generation, self.lines, self.fresh = self.generation + 1, 0, False
        path = self._path(self.generation)
        lines = [
            json.dumps(c, separators=(",", ":")).encode() + b"\n"
            for c in (held.live() if compact else held.changes_as_json())
        ]
        with path.open("wb" if compact else "ab") as f:
            f.write(b"".join(lines))
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        self.lines += len(lines)
        held.changes.clear()
        if compact:
            fsync_dir(self.directory)
            for old in self._generations():
                if old < self.generation - self.keep:
                    self._path(old).unlink(missing_ok=True)
        return [self.generation, size]
