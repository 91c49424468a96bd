"""The learner's log for off-policy evaluation (``rlens ope``): one JSON line per joined rl_focal query whose worker
logged its behaviour, with the label its feedback gave. Bounded: past ``max_bytes`` the file becomes ``<name>.1``
(replacing the one before) and a new one starts, so the log holds between one and two files' worth of recent
traffic. A query joined again after a crash (before its checkpoint) may appear twice; readers keep its last line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rlens.messages import Experience

log = logging.getLogger("rlens.learner")
OPE_LOG = "ope-log.jsonl"  # in the learner's checkpoint directory
FIELDS = {"query_id", "stream", "policy_version", "n_choices", "decider_state", "pool", "answer_index", "explored"}


class OpeLog:
    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = Path(path), max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, experience: Experience, label: int) -> None:
        if experience.behaviour is None or label < 0:
            return  # nothing to evaluate with: a worker before off-policy logging, or a bare reward
        line = {**experience.model_dump(mode="json", include=FIELDS), "behaviour": experience.behaviour.model_dump()}
        line["label"] = label
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
                size = f.tell()
            if size > self.max_bytes:
                self.path.replace(self.path.with_name(self.path.name + ".1"))
        except OSError as exc:  # a full disk must not stop the learner: the log is for evaluation only
            log.warning("off-policy log %s not written: %s", self.path, exc)
