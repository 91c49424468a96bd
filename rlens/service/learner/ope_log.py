"""The learner's log for off-policy evaluation (``rlens ope``): one JSON line per joined rl_focal query whose worker
logged its behaviour, with the label its feedback gave. The file stays open and its lines are buffered; the learner
flushes them with each checkpoint (:meth:`OpeLog.flush`), so a crash loses only lines of joins the checkpoint does
not cover, which are joined and logged again. Bounded: past ``max_bytes`` (looked at on each flush) the file becomes
``<name>.1`` (replacing the one before) and a new one starts, so the log holds between one and two files' worth of
recent traffic. A query joined again after a crash (before its checkpoint) may appear twice; readers keep its last
line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import IO

from rlens.messages import Experience

log = logging.getLogger("rlens.learner")
OPE_LOG = "ope-log.jsonl"  # in the learner's checkpoint directory
FIELDS = {
    "query_id",
    "stream",
    "policy_version",
    "n_choices",
    "decider_state",
    "pool",
    "answer_index",
    "explored",
    "behaviour",
}


class OpeLog:
    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = Path(path), max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = None

    def append(self, experience: Experience, label: int) -> None:
        if experience.behaviour is None or label < 0:
            return  # nothing to evaluate with: a worker before off-policy logging, or a bare reward
        line = experience.model_dump_json(include=FIELDS)
        try:
            if self._file is None:
                self._file = self.path.open("a")
            self._file.write(f'{line[:-1]},"label":{label}}}\n')
        except OSError as exc:  # a full disk must not stop the learner: the log is for evaluation only
            self._failed(exc)

    def flush(self) -> None:
        """The buffered lines to the file, which starts again once past ``max_bytes``."""
        if self._file is None:
            return
        try:
            self._file.flush()
            if self._file.tell() > self.max_bytes:
                self._file.close()
                self._file = None
                self.path.replace(self.path.with_name(self.path.name + ".1"))
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        log.warning("off-policy log %s not written: %s", self.path, exc)
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass  # its buffer could not be written either: those lines are lost, the next append reopens
            self._file = None
