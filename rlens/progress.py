"""Progress for long CLI work: a rich bar on a terminal, plain lines elsewhere (CI logs, ``nohup``, pipes).

Without a terminal rich draws nothing until the end, so :class:`LineProgress` prints one line per 10 % of the
work, and at least one every ``every_s`` seconds while work advances: ``description: done/total (p %), elapsed,
about N s left``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@dataclass
class _Task:
    description: str
    total: float
    done: float = 0.0
    started: float = field(default_factory=time.monotonic)
    last_line: float = field(default_factory=time.monotonic)
    last_tenth: int = 0
    first: tuple[float, float] | None = None  # (time, done) of the first advance: the pace is measured from it


class LineProgress:
    """The part of rich's ``Progress`` the CLI uses (``add_task``, ``advance``, ``update``), as log lines."""

    def __init__(self, console: Console, every_s: float = 30.0):
        self.console, self.every_s = console, every_s
        self.tasks: list[_Task] = []

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: float) -> TaskID:
        self.tasks.append(_Task(description, total))
        return TaskID(len(self.tasks) - 1)

    def advance(self, task_id: TaskID, advance: float) -> None:
        self.update(task_id, advance=advance)

    def update(self, task_id: TaskID, advance: float = 0.0, description: str | None = None) -> None:
        task = self.tasks[task_id]
        if task.first is None and advance:
            task.first = (time.monotonic(), task.done)
        task.done += advance
        if description is not None:
            task.description = description
        now = time.monotonic()
        tenth = int(10 * task.done / task.total) if task.total else 10
        if tenth > task.last_tenth or now - task.last_line >= self.every_s:
            task.last_tenth, task.last_line = tenth, now
            self.console.print(self.line(task, now), highlight=False, markup=False)

    @staticmethod
    def line(task: _Task, now: float) -> str:
        """The time left comes from the pace since the first advance: what came before it (starting processes,
        loading data) is not paid again."""
        elapsed = now - task.started
        share = task.done / task.total if task.total else 1.0
        left = ""
        if 0 < share < 1 and task.first is not None and now > task.first[0]:
            pace = (task.done - task.first[1]) / (now - task.first[0])  # work per second since the first advance
            left = f", about {(task.total - task.done) / pace:.0f} s left" if pace > 0 else ""
        return f"{task.description}: {task.done:.0f}/{task.total:.0f} ({100 * share:.0f} %), {elapsed:.0f} s{left}"


def progress_bar(console: Console) -> Progress | LineProgress:
    """A rich progress bar on a terminal, :class:`LineProgress` otherwise."""
    if not console.is_terminal:
        return LineProgress(console)
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def quiet_transformers() -> None:
    """No transformers progress bars or advisory warnings on the terminal; rlens shows its own progress."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the service runs without the model extras (the `hf` extra)
        return

    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's own tqdm bar
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # processes it starts, too (the zoo's training)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
