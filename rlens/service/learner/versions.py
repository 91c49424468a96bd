"""Reward and accuracy per served policy version (the ``policy_version`` of each joined experience), with 95 %
intervals, for the newest ``keep`` versions: what ``rlens policy list``, the dashboard and the metrics show."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import astuple, dataclass


@dataclass
class Tally:
    events: int = 0
    reward_sum: float = 0.0
    reward_squares: float = 0.0
    labelled: int = 0  # events with a right-or-wrong outcome
    correct: int = 0

    def row(self, version: int) -> dict:
        """Means with normal 95 % intervals (Wilson's for accuracy)."""
        n, mean = self.events, self.reward_sum / self.events
        sd = math.sqrt(max(self.reward_squares / n - mean * mean, 0.0) * n / max(n - 1, 1))
        half = 1.96 * sd / math.sqrt(n)
        row: dict[str, float | int | None] = {
            "version": version,
            "events": n,
            "reward": mean,
            "reward_low": mean - half,
            "reward_high": mean + half,
        }
        row |= {"labelled": self.labelled, "accuracy": None, "accuracy_low": None, "accuracy_high": None}
        if self.labelled:
            m, p, z = self.labelled, self.correct / self.labelled, 1.96
            centre = (p + z * z / (2 * m)) / (1 + z * z / m)
            spread = z * math.sqrt(p * (1 - p) / m + z * z / (4 * m * m)) / (1 + z * z / m)
            row |= {"accuracy": p, "accuracy_low": centre - spread, "accuracy_high": centre + spread}
        return row


class VersionStats:
    def __init__(self, keep: int = 20):
        self.keep = keep
        self.tallies: OrderedDict[int, Tally] = OrderedDict()

    def observe(self, version: int, reward: float, correct: bool | None) -> int | None:
        """One joined query served by ``version``; the version no longer kept, if one was let go."""
        tally = self.tallies.get(version)
        if tally is None:
            tally = self.tallies[version] = Tally()
            self.tallies = OrderedDict(sorted(self.tallies.items()))
        tally.events += 1
        tally.reward_sum += reward
        tally.reward_squares += reward * reward
        if correct is not None:
            tally.labelled += 1
            tally.correct += int(correct)
        if len(self.tallies) > self.keep:
            return self.tallies.popitem(last=False)[0]
        return None

    def rows(self) -> list[dict]:
        return [t.row(v) for v, t in self.tallies.items()]

    def to_json(self) -> list:
        return [[v, *astuple(t)] for v, t in self.tallies.items()]

    def load_json(self, rows: list) -> None:
        self.tallies = OrderedDict((int(r[0]), Tally(*r[1:])) for r in rows)
