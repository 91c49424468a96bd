"""The learner's unmatched halves: experience waiting for its feedback, or feedback waiting for its experience.

:class:`PendingHalves` holds one kind, oldest first, bounded by count and by bytes (each half counts its record's
size): adding past either bound drops the oldest. Halves expire by *event time* (their records' timestamps),
against the newest event time the learner has seen, so a learner that was down for an hour and catches up does
not expire everything it reads; time moves only as records arrive. What is dropped is handed back, so the learner
can dead-letter it with the reason.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

from rlens.messages import Message


@dataclass
class Pending:
    at: float  # event time (seconds) of its record
    size: int  # bytes it stands for (its record's value)
    message: Message
    record: dict  # the record's coordinates, as a DeadLetter holds them


class PendingHalves:
    def __init__(self, limit: int, max_bytes: int):
        self.limit, self.max_bytes = limit, max_bytes
        self.items: OrderedDict[str, Pending] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[str]:
        return iter(self.items)

    def __contains__(self, query_id: object) -> bool:
        return query_id in self.items

    def add(self, query_id: str, pending: Pending) -> list[Pending]:
        """Hold ``pending``; the oldest halves dropped to stay within the bounds."""
        self.items[query_id] = pending
        self.bytes += pending.size
        dropped = []
        while len(self.items) > self.limit or (self.bytes > self.max_bytes and len(self.items) > 1):
            dropped.append(self._pop_oldest())
        return dropped

    def pop(self, query_id: str) -> Pending:
        pending = self.items.pop(query_id)
        self.bytes -= pending.size
        return pending

    def expire(self, before: float) -> list[Pending]:
        """Drop and return the halves whose event time is before ``before``."""
        dropped = []
        while self.items and next(iter(self.items.values())).at < before:
            dropped.append(self._pop_oldest())
        return dropped

    def _pop_oldest(self) -> Pending:
        _, pending = self.items.popitem(last=False)
        self.bytes -= pending.size
        return pending

    def to_json(self) -> list:
        return [[q, p.at, p.size, p.message.model_dump(), p.record] for q, p in self.items.items()]

    def load_json(self, rows: list, model: type[Message]) -> None:
        self.items.clear()
        self.bytes = 0
        for query_id, at, size, message, record in rows:
            self.add(query_id, Pending(at, size, model.model_validate(message), record))
