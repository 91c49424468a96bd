"""What API keys spent, kept beyond Redis. Redis holds each key's spending for the budget checks
(:mod:`.state`); every gateway process also publishes its own running total per key and budget period, signed, to
the compacted ``spending`` topic (:class:`~rlens.messages.Spending`, at most every :data:`PUBLISH_EVERY_S`). A key's
spending is the sum over processes of each one's last record (:func:`totals`), so a key whose spending Redis lost (it
restarted empty: the key's restored mark is gone) gets it back from the topic before its next hold
(:meth:`SpendingLedger.restore`). What can still be lost: spending not yet published when a gateway process dies
with Redis, at most its last :data:`PUBLISH_EVERY_S`."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable

from pydantic import ValidationError

from rlens.messages import Spending
from rlens.service.common.security import FeedbackTokens
from rlens.service.gateway.state import PERIODS, GatewayState, period_stamp

log = logging.getLogger("rlens.gateway")
PUBLISH_EVERY_S = 1.0


def totals(records: Iterable[Spending]) -> dict[tuple[str, str], float]:
    """Each (key id, period)'s spending: the sum over gateway processes of each process's last record."""
    last: dict[tuple[str, str, str], float] = {}
    for record in records:
        last[(record.key_id, record.period, record.process)] = record.amount
    spent: defaultdict[tuple[str, str], float] = defaultdict(float)
    for (key_id, period, _), amount in last.items():
        spent[(key_id, period)] += amount
    return dict(spent)


class SpendingLedger:
    """This process's running totals and their publication; the topic's history and the restore of a key's spending.
    ``publish`` sends one record and returns once the broker has it; ``read`` returns the topic's record values."""

    def __init__(
        self,
        process: str,
        state: GatewayState,
        tokens: FeedbackTokens,
        publish: Callable[[Spending], Awaitable[None]],
        read: Callable[[], Awaitable[list[bytes | None]]],
    ):
        self.process = f"{process}-{uuid.uuid4().hex[:8]}"  # a restarted process starts a total of its own
        self.state, self.tokens, self._publish, self._read = state, tokens, publish, read
        self._mine: dict[tuple[str, str], float] = {}  # (key id, period) -> what this process charged it
        self._unpublished: set[tuple[str, str]] = set()
        self._found: dict[tuple[str, str], float] = {}  # the topic's totals, as last read
        self._read_at = -math.inf
        self._reading = asyncio.Lock()

    def add(self, key_id: str, period: str, cost: float) -> None:
        """A settled answer's cost, charged to the key in its budget period (``total``, ``daily``, ``monthly``)."""
        entry = (key_id, period_stamp(period or "total"))
        self._mine[entry] = self._mine.get(entry, 0.0) + cost
        self._unpublished.add(entry)

    async def flush(self) -> None:
        """Publish this process's total of every key charged since the last flush; one the broker refuses is kept
        for the next flush (a later total carries the earlier ones)."""
        entries, self._unpublished = self._unpublished, set()
        now = time.time()
        records = [
            self.tokens.sign_spending(
                Spending(key_id=key_id, period=period, process=self.process, amount=self._mine[key_id, period], at=now)
            )
            for key_id, period in sorted(entries)
        ]
        results = await asyncio.gather(*(self._publish(r) for r in records), return_exceptions=True)
        failed = {(r.key_id, r.period) for r, result in zip(records, results) if isinstance(result, BaseException)}
        if failed:
            log.warning(
                "could not publish the spending of %d keys; tried again in %.0f s", len(failed), PUBLISH_EVERY_S
            )
            self._unpublished |= failed

    async def keep_publishing(self) -> None:
        """A task: :meth:`flush` every :data:`PUBLISH_EVERY_S` (the process flushes once more as it stops)."""
        while True:
            await asyncio.sleep(PUBLISH_EVERY_S)
            await self.flush()

    async def _history(self) -> dict[tuple[str, str], float]:
        """Every key's spending per period on the topic, records without a valid signature ignored."""
        records, refused = [], 0
        for value in await self._read():
            try:
                record = Spending.model_validate_json(value or b"")
            except ValidationError:
                record = None
            if record is None or not self.tokens.signed_spending(record):
                refused += 1
                continue
            records.append(record)
        if refused:
            log.warning("%d records of the spending topic are not a gateway's (no valid signature): ignored", refused)
        return totals(records)

    async def restore(self, key_id: str, period: str) -> float:
        """Give the key its spending in the current period back from the topic (Redis keeps the larger of its own
        and the topic's), with what an older rlens kept in Redis under the key alone; what the key spent now. The
        topic is read once for every restore asked before the read began, and every key found there is restored
        with it (a Redis that restarted empty lost every key's spending)."""
        asked = time.monotonic()
        async with self._reading:
            if self._read_at < asked:
                self._read_at = time.monotonic()
                self._found = await self._history()
                today = {period_stamp(p) for p in PERIODS}
                await self.state.restore_spending(
                    [(k, stamp, v) for (k, stamp), v in self._found.items() if stamp in today]
                )
            stamp = period_stamp(period)
            legacy = await self.state.legacy_spending(key_id) if stamp == "total" else 0.0
            if legacy:  # from now on on the topic too, as this process's
                self.add(key_id, "total", legacy)
            (spent,) = await self.state.restore_spending(
                [(key_id, stamp, self._found.get((key_id, stamp), 0.0) + legacy)]
            )
            if legacy:
                await self.state.forget_legacy_spending(key_id)
        log.info("spending of key %s restored: %.6g in %s", key_id, spent, stamp)
        return spent
