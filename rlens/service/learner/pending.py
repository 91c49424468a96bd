"""The learner's unmatched halves: experience waiting for its feedback, or feedback waiting for its experience.

:class:`PendingHalves` holds one kind, oldest first, bounded by count and by bytes (each half counts its record's
size): adding past either bound drops the oldest. Each stream may hold at most ``per_stream`` halves: past that,
the stream's own oldest half is dropped, so a flood on one stream key cannot push out the other streams' halves. Halves expire by *event time* (their records' timestamps),
against the newest event time the learner has seen, so a learner that was down for an hour and catches up does
not expire everything it reads; time moves only as records arrive. What is dropped is handed back, so the learner
can dead-letter it with the reason.

Both it and :class:`RecentIds` (the query ids joined lately) keep their changes since the last checkpoint in
``changes``, for the learner's :class:`rlens.service.learner.journal.Journal`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, Iterable, Iterator, TypeVar

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
        self.changes: list[list] = []  # since the last checkpoint: ["+", query id, Pending] or ["-", query id]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[str]:
        return iter(self.items)

    def __contains__(self, query_id: object) -> bool:
        return query_id in self.items

    def add(self, query_id: str, pending: Pending[M]) -> list[tuple[Pending[M], str]]:
        """Hold ``pending``; the halves dropped to stay within the bounds, each with why."""
        self._insert(query_id, pending)
        self.changes.append(["+", query_id, pending])
        dropped = []
        if pending.stream is not None:
            mine = self.streams[pending.stream]
            if len(mine) > self.per_stream:
                dropped.append((self.pop(next(iter(mine))), f"its stream's quota ({self.per_stream} halves)"))
        while len(self.items) > self.limit or (self.bytes > self.max_bytes and len(self.items) > 1):
            dropped.append((self._pop_oldest(), f"the bound ({self.limit} halves, {self.max_bytes} bytes)"))
        return dropped

    def _insert(self, query_id: str, pending: Pending[M]) -> None:
        self.items[query_id] = pending
        self.bytes += pending.size
        if pending.stream is not None:
            self.streams.setdefault(pending.stream, OrderedDict())[query_id] = None

    def pop(self, query_id: str) -> Pending[M]:
        pending = self.items.pop(query_id)
        self._forget(query_id, pending)
        return pending

    def _forget(self, query_id: str, pending: Pending[M]) -> None:
        self.changes.append(["-", query_id])
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

    @staticmethod
    def _row(pending: Pending) -> list:
        return [pending.at, pending.size, pending.message.model_dump_json(), pending.record]

    def as_json(self, changes: Iterable[list]) -> Iterator[list]:
        """``changes`` as JSON (``["+", query id, row]`` or ``["-", query id]``)."""
        return ([c[0], c[1], self._row(c[2])] if c[0] == "+" else c for c in changes)

    def live(self) -> tuple[list, list]:
        """Every held half's query id and the half, oldest first (a half is never changed once held)."""
        return list(self.items), list(self.items.values())

    def replay(self, changes: Iterable[list], model: type[M]) -> None:
        """Apply a journal's changes (the bounds were applied when they were made)."""
        for change in changes:
            if change[0] == "+":
                at, size, message, record = change[2]
                self._insert(change[1], Pending(at, size, model.model_validate_json(message), record))
            elif change[1] in self.items:
                self.pop(change[1])
        self.changes.clear()

    def load_json(self, rows: list, model: type[M]) -> None:
        """A checkpoint of before the journal (every half in ``state.json``)."""
        self.replay((["+", q, [at, size, json.dumps(message), record]] for q, at, size, message, record in rows), model)


class RecentIds:
    """The query ids joined lately, oldest first, at most ``limit`` (a later half of one is a duplicate)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.items: OrderedDict[str, float] = OrderedDict()  # query id -> when it was joined (seconds)
        self.changes: list[list] = []  # since the last checkpoint: ["+", query id, time] or ["-", query id]

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, query_id: object) -> bool:
        return query_id in self.items

    def add(self, query_id: str, at: float) -> None:
        self.items[query_id] = at
        self.changes.append(["+", query_id, at])
        while len(self.items) > self.limit:
            self.changes.append(["-", self.items.popitem(last=False)[0]])

    def as_json(self, changes: Iterable[list]) -> Iterable[list]:
        return changes

    def live(self) -> tuple[list, list]:
        return list(self.items), list(self.items.values())

    def replay(self, changes: Iterable[list]) -> None:
        for change in changes:
            if change[0] == "+":
                self.items[change[1]] = change[2]
            else:
                self.items.pop(change[1], None)
        self.changes.clear()
