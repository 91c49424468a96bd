"""Prompt + reference files for ``rlens rlae train`` (JSON lines, one task per line, validated).

    {"prompt": "Q: add: 12+7=\\nA:", "reference": "19", "family": "arithmetic"}

``family`` is optional (a label for per-family figures). Without a file, the zoo's generation split is used.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from rlens.zoo.tasks import GenerationTask


class TaskLine(BaseModel, extra="forbid"):
    prompt: str = Field(min_length=1)
    reference: str
    family: str = "default"


class TaskFileError(ValueError):
    pass


def read_tasks(path: Path) -> list[GenerationTask]:
    """Every task of a JSON-lines file; a :class:`TaskFileError` names the file and line of the first bad one."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot read: {exc.strerror}") from exc
    tasks = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            task = TaskLine.model_validate(json.loads(line))
        except (json.JSONDecodeError, ValidationError) as exc:
            raise TaskFileError(f"{path}:{number}: not a task line ({str(exc).splitlines()[0]})") from exc
        tasks.append(GenerationTask(task.family, task.prompt, task.reference.strip()))
    if not tasks:
        raise TaskFileError(f"{path}: no tasks")
    return tasks
