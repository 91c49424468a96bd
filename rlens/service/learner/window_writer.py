"""The learner's writes to the Redis windows: each joined outcome is queued, and the queue is applied in order, in
pipelined round trips of :data:`APPLY_BATCH`, once per query id. While Redis is unreachable it retries with backoff
for at most ``redis_wait_s``, then keeps the outcomes in a bounded backlog (checkpointed) for the next call.

With calibrations (``RLENS_FOCAL_CALIBRATION_ROWS``) an outcome also carries its called models' calibration rows, pushed
by the same script; once a stream has ``refit_every`` new rows of some model, and its calibrations were last fitted
``refit_interval_s`` ago or more (a busy stream's rows would otherwise call a fit every few queries: about 15 ms of CPU
each), :meth:`WindowWriter.refit` fits the stream's calibrations from its rows in Redis and publishes them for the
workers. With joint rows (``RLENS_FOCAL_JOINT_ROWS``) the outcome is also kept whole, and the pools' joint fits are made
again with the calibrations once the stream's joint rows grew by a tenth since they were last made
(:meth:`rlens.focal.calibration.PoolCombiner.due`, the replay's cadence) and :data:`JOINT_REFIT_S` have passed (a busy
stream's fits cost up to a second of CPU); in between, the last ones are published again. Every fit starts from the
stream's last one (kept for the newest :data:`FITTED_STREAMS` streams): fewer Newton steps to the same minimum."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from redis.exceptions import RedisError

from rlens.focal.calibration import PoolCombiner
from rlens.focal.config import FocalConfig
from rlens.service.common.windows import CalibrationRows, RedisWindows
from rlens.service.common.logs import query_fields

APPLY_BATCH = 256  # outcomes sent to Redis in one round trip
RETRY_AFTER_S = 2.0  # after a bounded wait gave up: no new try before this
MAX_COUNTED = 100_000  # (stream, model) calibration counts kept
FITTED_STREAMS = 10_000  # streams whose last fits the learner keeps between their refits (where the next start)
JOINT_REFIT_S = 30.0  # a stream's joint fits are made again at most this often
log = logging.getLogger("rlens.learner")


@dataclass
class Applied:
    """What one :meth:`WindowWriter.apply` did."""

    windows_applied: int = 0  # outcomes added to windows (a replay after a crash adds none twice)
    redis_retries: int = 0
    window_backlog_dropped: int = 0  # the oldest outcomes dropped from a full backlog


class WindowWriter:
    def __init__(
        self,
        windows: RedisWindows,
        redis_wait_s: float = 10.0,
        backlog_limit: int = 100_000,
        refit_every: int = FocalConfig.calibration_refit,
        refit_interval_s: float = 0.0,
    ):
        self.windows = windows
        self.redis_wait_s, self.backlog_limit, self.refit_every = redis_wait_s, backlog_limit, refit_every
        self.refit_interval_s = refit_interval_s
        self.fitted_at: dict[str, float] = {}  # stream -> when its calibrations were last fitted (monotonic clock)
        # [stream, query id, predictions, label, reward, calibration rows (CalibrationRows.to_list) or None]
        self.backlog: deque[list] = deque()
        self._retry_at = 0.0  # monotonic clock
        self.new_rows: Counter[tuple[str, int]] = Counter()  # (stream, model): calibration rows since its last fit
        # stream -> its last joint fits (their rows dropped; ``seen`` counts on with each new row: ``due``), and its
        # calibrations' last fits; the newest FITTED_STREAMS
        self.joint: OrderedDict[str, PoolCombiner] = OrderedDict()
        self.fits: OrderedDict[str, dict] = OrderedDict()
        self.joint_made: dict[str, float] = {}  # stream -> when its joint fits were last made (monotonic clock)

    def queue(
        self, stream: str, query_id: str, row: tuple, reward: float, calibration: CalibrationRows | None = None
    ) -> bool:
        """Queue one outcome; whether a round trip's worth is waiting (time to apply)."""
        self.backlog.append([stream, query_id, *row, reward, None if calibration is None else calibration.to_list()])
        return len(self.backlog) >= APPLY_BATCH

    async def apply(self) -> Applied:
        """Apply the backlog to Redis in order, retrying for at most ``redis_wait_s``; what Redis did not take stays
        in the backlog (bounded: the oldest outcomes go first) for the next call. A row no window can hold is
        dropped (logged), never blocks the others."""
        done, delay, waited = Applied(), 0.05, 0.0
        while self.backlog and time.monotonic() >= self._retry_at:
            batch = [
                [*outcome[:5], self._calibration(outcome)] for outcome in itertools.islice(self.backlog, APPLY_BATCH)
            ]
            errors = [self.windows.row_error(*outcome[2:5]) for outcome in batch]
            try:
                good = [outcome for outcome, error in zip(batch, errors) if not error]
                applied = await self.windows.apply_many(good)
                for outcome, error in zip(batch, errors):
                    self.backlog.popleft()
                    if error:
                        fields = query_fields(outcome[1], outcome[0])
                        log.error("outcome of query %s dropped: %s", outcome[1], error, extra=fields)
                for outcome, new in zip(good, applied):
                    if new and outcome[5] is not None and self.windows.calibration_rows:
                        self.new_rows.update((outcome[0], model) for model in outcome[5].log_probs)
                        if (combiner := self.joint.get(outcome[0])) is not None:
                            combiner.seen += 1
                            self.joint.move_to_end(outcome[0])
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

    def _calibration(self, outcome: list) -> CalibrationRows | None:
        """A queued outcome's calibration rows, or None (none queued, or rows no calibration can hold: dropped and
        logged, the outcome's window row kept)."""
        if len(outcome) < 6 or outcome[5] is None:
            return None
        rows = CalibrationRows.from_list(outcome[5])
        if error := self.windows.calibration_error(rows):
            log.error(
                "calibration rows of query %s dropped: %s",
                outcome[1],
                error,
                extra=query_fields(outcome[1], outcome[0]),
            )
            return None
        return rows

    async def refit(self) -> int:
        """Fit and publish the calibrations of each stream with ``refit_every`` new rows of some model (from its
        rows in Redis) and none fitted within ``refit_interval_s``; the number of streams published. Redis errors
        propagate (the caller tries again later: the counts stay)."""
        while len(self.new_rows) > MAX_COUNTED:  # streams seldom fed: the oldest counts go (their rows stay)
            del self.new_rows[next(iter(self.new_rows))]
        while len(self.joint) > FITTED_STREAMS:  # the oldest go: their next refit makes their joint fits again
            self.joint_made.pop(self.joint.popitem(last=False)[0], None)
        while len(self.fits) > FITTED_STREAMS:  # the oldest go: their next fits start from zero
            self.fits.popitem(last=False)
        now = time.monotonic()
        if len(self.fitted_at) > MAX_COUNTED:  # only the fits within the interval hold a stream back
            self.fitted_at = {s: at for s, at in self.fitted_at.items() if now - at < self.refit_interval_s}
        due = sorted(
            {
                stream
                for (stream, _), n in self.new_rows.items()
                if n >= self.refit_every
                and now - self.fitted_at.get(stream, -self.refit_interval_s) >= self.refit_interval_s
            }
        )
        for stream in due:
            last = self.joint.get(stream)
            joint = last is None or (
                last.due() and time.monotonic() - self.joint_made.get(stream, 0.0) >= JOINT_REFIT_S
            )
            calibration = await self.windows.load_calibration(stream, joint=joint)
            calibration.fit_all(self.fits.get(stream), None if last is None else last.fits)
            self.fits[stream] = calibration.fits
            self.fits.move_to_end(stream)
            if (combiner := calibration.combiner) is not None:  # made again
                self.joint[stream] = combiner
                if combiner.fitted_at:  # fits were made (or refused), at a cost
                    self.joint_made[stream] = time.monotonic()
                combiner.history.clear()  # only the fits are kept
            elif last is not None:
                calibration.combiner = last
            await self.windows.save_calibration(stream, calibration)
            self.fitted_at[stream] = time.monotonic()
            for key in [key for key in self.new_rows if key[0] == stream]:
                del self.new_rows[key]
        return len(due)
