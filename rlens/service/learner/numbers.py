"""The learner's policy numbers: its epoch (when it started) and the newest version it gave a policy. Their only
writer: a policy is ordered by (epoch, version), and workers take only a live policy or a candidate newer than what
they serve, so a number is never given twice."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class PolicyNumbers:
    epoch: int = field(default_factory=lambda: time.time_ns() // 1_000_000)
    version: int = 0  # 0: no policy yet (the seeded weights)

    @property
    def newest(self) -> tuple[int, int]:
        """(epoch, version) of the newest number given."""
        return self.epoch, self.version

    def next(self) -> int:
        """A new version: the next policy published is newer than any before it."""
        self.version += 1
        return self.version

    def at_least(self, version: int) -> None:
        """Go on above ``version`` (an operator's policy of this epoch, or a checkpoint's number)."""
        self.version = max(self.version, version)
