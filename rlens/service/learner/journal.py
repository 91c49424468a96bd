"""The learner's large keyed state on disk by its changes, so that a checkpoint costs what changed since the one
before, not what is held (the halves waiting for their other half, the recent query ids).

A :class:`Journal` is one append-only file per generation, ``journal/{name}-{generation:06d}.jsonl`` beside the
checkpoints, each line one change: ``["+", key, value]`` (set) or ``["-", key]`` (delete). A checkpoint appends
the changes since the one before, fsyncs, and records the mark ``[generation, bytes]`` in its ``state.json``;
restoring replays the file up to the mark, and cuts off what a later checkpoint that never completed wrote after
it (the records behind those changes are read again from Kafka, from the checkpoint's offsets).

Once a file holds more than twice as many changes as there are live keys (plus ``floor``), a compaction writes
the next generation with only the live keys: a cost that grows with what is held (67 s at a million halves,
BENCHMARKS.md), so it runs in a thread of its own, from a snapshot of the live keys taken on the caller's thread.
Meanwhile checkpoints go on appending to the current generation (whose marks stay valid) and keep their lines; the
first checkpoint after the thread has finished appends those lines to the new generation and records its mark. A
learner that dies during a compaction restores from the older generation (the new file, which no mark names, is
written over by the next compaction). The files of the newest ``keep`` + 1 generations stay, for the older
checkpoints that still refer to them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

from rlens.checkpoint import fsync_dir

log = logging.getLogger("rlens.learner")

Change = list  # ["+", key, value] or ["-", key]
Mark = list[int]  # [generation, bytes]


class Journaled(Protocol):
    """A keyed collection that keeps its changes since the last checkpoint."""

    changes: list  # since the last checkpoint, as the collection holds them

    def __len__(self) -> int: ...

    def as_json(self, changes: Iterable[list]) -> Iterable[Change]:
        """Changes as the collection holds them, as JSON values."""
        ...

    def live(self) -> tuple[list, list]:
        """Every live key and its value, oldest first: two lists, so that a snapshot makes no object per key (which
        would wake the garbage collector over everything held); a value is never changed once held."""
        ...


def sets(keys: list, values: list) -> Iterator[Change]:
    """The changes that set ``keys`` to ``values``, as a collection holds them."""
    return (["+", key, value] for key, value in zip(keys, values))


def encoded(changes: Iterable[Change]) -> list[bytes]:
    return [json.dumps(c, separators=(",", ":")).encode() + b"\n" for c in changes]


def in_a_thread(work: Callable[[], None]) -> None:
    """How a compaction runs: a daemon thread (a learner that exits meanwhile leaves a file no mark names)."""
    threading.Thread(target=work, name="journal-compaction", daemon=True).start()


@dataclass
class Compaction:
    """A generation being written from a snapshot of the live keys, and the lines appended since."""

    generation: int
    done: threading.Event = field(default_factory=threading.Event)
    lines: int = 0  # the snapshot's
    since: list[bytes] = field(default_factory=list)  # the changes after the snapshot, encoded
    error: BaseException | None = None


class Journal:
    def __init__(
        self,
        directory: Path,
        name: str,
        keep: int = 3,
        floor: int = 10_000,
        run: Callable[[Callable[[], None]], None] = in_a_thread,
    ):
        self.directory, self.name, self.keep, self.floor, self.run = Path(directory), name, keep, floor, run
        self.directory.mkdir(parents=True, exist_ok=True)
        self.generation = max(self._generations(), default=0)  # a fresh learner's first write starts the next
        self.lines = 0  # changes in the current generation's file
        self.fresh = True  # nothing written or restored yet: the next write starts a generation
        self.compaction: Compaction | None = None

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
        """Append ``held``'s changes (then cleared), fsynced, and return the mark a checkpoint records: to the new
        generation if a compaction has finished, else to the current one, and then start a compaction if the file
        has grown past twice as many changes as live keys, plus ``floor``. The first write (nothing restored)
        starts a generation with every live key, on the caller's thread."""
        lines = encoded(held.as_json(held.changes))
        held.changes.clear()
        if self.fresh:
            self.generation, self.lines, self.fresh = self.generation + 1, 0, False
            return self._append(self.generation, encoded(held.as_json(sets(*held.live()))), truncate=True)
        compaction = self.compaction
        if compaction is not None and compaction.done.is_set():
            self.compaction = None
            if compaction.error is None:
                self.generation, self.lines = compaction.generation, compaction.lines
                return self._append(self.generation, compaction.since + lines, new=True)
            log.error(
                "journal %s: a compaction failed (%r); the next checkpoint tries again", self.name, compaction.error
            )
        mark = self._append(self.generation, lines)
        if self.compaction is not None:
            self.compaction.since.extend(lines)
        elif self.lines > 2 * len(held) + self.floor:
            self._compact(*held.live(), held)
        return mark

    def _append(self, generation: int, lines: list[bytes], truncate: bool = False, new: bool = False) -> Mark:
        """``lines`` at the end of ``generation``'s file (``truncate``: as its whole), fsynced; ``new``: the
        generation was just made (its directory entry fsynced, the generations past ``keep`` deleted)."""
        with self._path(generation).open("wb" if truncate else "ab") as f:
            f.write(b"".join(lines))
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        self.lines += len(lines)
        if truncate or new:
            fsync_dir(self.directory)
            for old in self._generations():
                if old < generation - self.keep:
                    self._path(old).unlink(missing_ok=True)
        return [generation, size]

    def _compact(self, keys: list, values: list, held: Journaled) -> None:
        """Write the next generation from a snapshot of ``held``'s live keys and values through ``self.run``."""
        compaction = self.compaction = Compaction(self.generation + 1)

        def work() -> None:
            try:
                with self._path(compaction.generation).open("wb", buffering=1 << 20) as f:
                    for start in range(0, len(keys), 10):
                        f.writelines(encoded(held.as_json(sets(keys[start : start + 10], values[start : start + 10]))))
                        time.sleep(0)  # hands the GIL back every 10 keys: the learner's loop waits at most that long
                    f.flush()
                    os.fsync(f.fileno())
                compaction.lines = len(keys)
            except BaseException as error:  # reported by the next write, which goes on with the current generation
                compaction.error = error
            finally:
                compaction.done.set()

        self.run(work)
