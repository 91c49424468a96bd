"""The learner's unmatched halves: experience waiting for its feedback, or feedback waiting for its experience.

:class:`PendingHalves` holds one kind, oldest first, bounded by count and by bytes (each half counts its record's
size): adding past either bound drops the oldest. Each stream may hold at most ``per_stream`` halves: past that,
the stream's own oldest half is dropped, so a flood on one stream key cannot push out the other streams' halves. Halves expire by *event time* (their records' timestamps),
against the newest event time the learner has seen, so a learner that was down for an hour and catches up does
not expire everything it reads; time moves only as records arrive. What is dropped is handed back, so the learner
can dead-letter it with the reason.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, Iterator, TypeVar

from rlens.messages import Message

M = TypeVar("M", bound=Message)


@dataclass
class Pending(Generic[M]):
    at: float  # event time (seconds) of its record
    size: int  # bytes it stands for (its record's value)
    message: M
    record: dict  # the record's coordinates, as a DeadLetter holds them

    @property
    def stream(self) -> str | None:
        return getattr(self.message, "stream", None)


class PendingHalves(Generic[M]):
    def __init__(self, limit: int, max_bytes: int, per_stream: int | None = None):
        self.limit, self.max_bytes, self.per_stream = limit, max_bytes, per_stream or limit
        self.items: OrderedDict[str, Pending[M]] = OrderedDict()
        self.streams: dict[str, OrderedDict[str, None]] = {}  # stream -> its halves' query ids, oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[str]:
        return iter(self.items)

    def __contains__(self, query_id: object) -> bool:
        return query_id in self.items

    def add(self, query_id: str, pending: Pending[M]) -> list[tuple[Pending[M], str]]:
        """Hold ``pending``; the halves dropped to stay within the bounds, each with why."""
        self.items[query_id] = pending
        self.bytes += pending.size
        dropped = []
        if pending.stream is not None:
            mine = self.streams.setdefault(pending.stream, OrderedDict())
            mine[query_id] = None
            if len(mine) > self.per_stream:
                dropped.append((self.pop(next(iter(mine))), f"its stream's quota ({self.per_stream} halves)"))
        while len(self.items) > self.limit or (self.bytes > self.max_bytes and len(self.items) > 1):
            dropped.append((self._pop_oldest(), f"the bound ({self.limit} halves, {self.max_bytes} bytes)"))
        return dropped

    def pop(self, query_id: str) -> Pending[M]:
        pending = self.items.pop(query_id)
        self._forget(query_id, pending)
        return pending

    def _forget(self, query_id: str, pending: Pending[M]) -> None:
        self.bytes -= pending.size
        if pending.stream is not None:
            mine = self.streams[pending.stream]
            del mine[query_id]
            if not mine:
                del self.streams[pending.stream]

    def expire(self, before: float) -> list[Pending[M]]:
        """Drop and return the halves whose event time is before ``before``."""
        dropped = []
        while self.items and next(iter(self.items.values())).at < before:
            dropped.append(self._pop_oldest())
        return dropped

    def _pop_oldest(self) -> Pending[M]:
        query_id, pending = self.items.popitem(last=False)
        self._forget(query_id, pending)
        return pending

    def to_json(self) -> list:
        return [[q, p.at, p.size, p.message.model_dump(), p.record] for q, p in self.items.items()]

    def load_json(self, rows: list, model: type[M]) -> None:
        self.items.clear()
        self.bytes = 0
        for query_id, at, size, message, record in rows:
            self.add(query_id, Pending(at, size, model.model_validate(message), record))
