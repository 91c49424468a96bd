"""The learner's writes to the Redis windows: each joined outcome is queued, and the queue is applied in order, in
pipelined round trips of :data:`APPLY_BATCH`, once per query id. While Redis is unreachable it retries with backoff
for at most ``redis_wait_s``, then keeps the outcomes in a bounded backlog (checkpointed) for the next call."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

from redis.exceptions import RedisError

from rlens.service.common.windows import RedisWindows
from rlens.service.common.logs import query_fields

APPLY_BATCH = 256  # outcomes sent to Redis in one round trip
RETRY_AFTER_S = 2.0  # after a bounded wait gave up: no new try before this
log = logging.getLogger("rlens.learner")


@dataclass
class Applied:
    """What one :meth:`WindowWriter.apply` did."""

    windows_applied: int = 0  # outcomes added to windows (a replay after a crash adds none twice)
    redis_retries: int = 0
    window_backlog_dropped: int = 0  # the oldest outcomes dropped from a full backlog


class WindowWriter:
    def __init__(self, windows: RedisWindows, redis_wait_s: float = 10.0, backlog_limit: int = 100_000):
        self.windows = windows
        self.redis_wait_s, self.backlog_limit = redis_wait_s, backlog_limit
        self.backlog: deque[list] = deque()  # [stream, query id, predictions, label, reward] not yet in Redis
        self._retry_at = 0.0  # monotonic clock

    def queue(self, stream: str, query_id: str, row: tuple, reward: float) -> bool:
        """Queue one outcome; whether a round trip's worth is waiting (time to apply)."""
        self.backlog.append([stream, query_id, *row, reward])
        return len(self.backlog) >= APPLY_BATCH

    async def apply(self) -> Applied:
        """Apply the backlog to Redis in order, retrying for at most ``redis_wait_s``; what Redis did not take stays
        in the backlog (bounded: the oldest outcomes go first) for the next call. A row no window can hold is
        dropped (logged), never blocks the others."""
        done, delay, waited = Applied(), 0.05, 0.0
        while self.backlog and time.monotonic() >= self._retry_at:
            batch = list(itertools.islice(self.backlog, APPLY_BATCH))
            errors = [self.windows.row_error(*outcome[2:]) for outcome in batch]
            try:
                applied = await self.windows.apply_many([outcome for outcome, error in zip(batch, errors) if not error])
                for outcome, error in zip(batch, errors):
                    self.backlog.popleft()
                    if error:
                        fields = query_fields(outcome[1], outcome[0])
                        log.error("outcome of query %s dropped: %s", outcome[1], error, extra=fields)
                done.windows_applied += sum(applied)
            except (RedisError, OSError) as exc:
                done.redis_retries += 1
                if waited >= self.redis_wait_s:
                    log.warning(
                        "Redis unreachable (%s): %d outcomes wait in the backlog; next try in %g s",
                        exc,
                        len(self.backlog),
                        RETRY_AFTER_S,
                    )
                    self._retry_at = time.monotonic() + RETRY_AFTER_S
                    break
                log.warning("Redis unreachable (%s); retrying in %.2f s", exc, delay)
                await asyncio.sleep(delay)
                waited += delay
                delay = min(2 * delay, 2.0)
        while len(self.backlog) > self.backlog_limit:
            self.backlog.popleft()
            done.window_backlog_dropped += 1
        return done
