"""Per-stream outcome windows in Redis: what every worker reads and the learner writes.

Keys (``{prefix}`` from the settings, default ``rlens``; the stream key in braces is a Redis Cluster hash tag,
so both keys of one stream live in one slot and the update script may touch both):

| key | type | content | bound | TTL |
|---|---|---|---|---|
| ``{prefix}:win:{<stream>}`` | list | the last W outcomes, oldest first, each ``[label, reward, p_0, ..., p_{M-1}]`` (JSON; ``p_m`` is model m's predicted choice, -1 where not called) | LTRIM to W | ``window_ttl_s``, renewed on every update |
| ``{prefix}:applied:{<stream>}:<query id>`` | string | marks a query whose outcome is in the window | one per query | ``dedup_ttl_s`` |
| ``{prefix}:cal:{<stream>}:<m>`` | list | with ``calibration_rows``: model m's last labelled outcomes, oldest first, each ``[n_choices, label, log p_0, ..., log p_{n_choices-1}]`` (JSON, 6 significant digits), pushed with the window's row by the same script | LTRIM to ``calibration_rows`` | ``window_ttl_s`` |
| ``{prefix}:cal:{<stream>}:labels`` | list | with ``calibration_rows``: the stream's last labels, each ``[n_choices, label]`` | LTRIM to ``calibration_rows`` | ``window_ttl_s`` |
| ``{prefix}:joint:{<stream>}`` | list | with ``joint_rows`` too: the stream's last labelled queries whole, each ``[n_choices, label, [[m, [log p_0, ...]], ...], [served model, ...]]`` (:meth:`CalibrationRows.to_list`), for the pools' joint fits | LTRIM to ``joint_rows`` | ``window_ttl_s`` |
| ``{prefix}:fit:{<stream>}`` | string | the stream's calibrations (and pools' joint fits) the learner fitted from those rows (:meth:`rlens.focal.calibration.StreamCalibration.state`, JSON), what the workers vote with | one per stream | ``window_ttl_s`` |
| ``{prefix}:pool:{<stream>}`` | string | the Decider's last pool for the stream, one ``0``/``1`` per model (every worker reads and writes it, so the Decider sees the same previous pool whichever worker serves the stream) | M bytes | ``window_ttl_s`` |
| ``{prefix}:asked:{<stream>}`` | string | the queries the stream was asked, counted while under ``first_probes`` (its first queries call every model, whichever worker serves them) | an integer | ``window_ttl_s`` |
| ``{prefix}:ready:<role>:<host>-<pid>`` | string | a worker or learner process whose subscribers have joined: the URL of its ``/metrics``, ``/healthz``, ``/readyz`` | one per process | 30 s, renewed every 2 s while the process runs; deleted on clean shutdown |
| ``{prefix}:ready`` | set | the ``<role>:<host>-<pid>`` of every readiness mark set (:func:`ready_urls` reads the marks from it, never scanning the keyspace; a member whose mark expired is removed when read) | one member per process | 30 s, renewed with each mark |
| ``{prefix}:replies:<reply topic>`` | string | a live gateway's reply topic: workers reply to no other (a query naming another is dead-lettered, so ``reply_to`` cannot make topics) | one per gateway replica | 30 s, renewed every 2 s while the gateway runs |
| ``{prefix}:costs:<strategy>`` | string | the pool's model names and costs, as the strategy's workers announce them (a gateway holds a key's budget by them) | one per strategy | 30 s, renewed every 2 s while a worker runs |
| ``{prefix}:owner:{<query id>}`` | string | the stream a query id was first asked on: a worker answers that id on no other stream (a token for one stream is no token for another) | one per query | ``dedup_ttl_s`` |
| ``{prefix}:lease:<consumer group>`` | string | the learner that holds its consumer group (fencing: one learner per group) | one per group | ``LEASE_TTL_S``, renewed by its holder |

An update is one Lua script: if the query's marker is new, push the row, trim to W, renew the TTL (and push its
calibration rows, if any, likewise); else do nothing. So feedback applied twice (a redelivered message, a learner
replaying after a crash) counts once, and readers never see a half-applied update. A missing key is an empty (cold) window. A row is checked before it is
written (labels and predictions are choice positions below :data:`rlens.messages.MAX_CHOICES`, the reward is
finite) and again when read: a row that does not fit (written by hand, by another pool) is skipped and counted,
never loaded. The readiness mark is best-effort: a Redis that is down only delays it.

Sizing Redis: a window costs about W x (12 + 3M) bytes and a marker about 100 bytes, so one stream with W=128
and 5 models is about 4 KB, and 1M queries a day keep about 100 MB of markers. Calibrations add about
M x R x (8 + 10 C) bytes of rows per stream (R rows per model, C choices: 5 models, 200 rows and 6 choices, about
70 KB) and the fits, about M x 12 C (C + 1) bytes (2.5 KB). Joint rows add about J x (20 + k (6 + 10 C)) bytes
per stream (J rows, k models called a query: 4,000 rows of 2 models and 4 choices, about 0.4 MB; of 5 models and 6
choices, 1.3 MB), and the pools' joint fits up to 8 x 12 C (k C + 1) bytes. Set ``maxmemory`` with
``maxmemory-policy volatile-ttl`` (every key here has a TTL): under pressure, the keys closest to expiry go first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlens.focal.calibration import StreamCalibration
from rlens.focal.features import LOG_FLOOR
from rlens.focal.window import OutcomeWindow
from rlens.messages import MAX_CHOICES
from rlens.redis_clients import run_scripts

log = logging.getLogger("rlens.windows")
LEASE_TTL_S = 30
READY_TTL_S = 30  # a readiness mark outlives its process by this much at most
RESTORED_STREAMS = 1024  # streams whose restored calibrations a worker keeps between batches

RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return 1
end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) and 1 or 0
"""

APPLY_OUTCOME = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[4]) then
  redis.call('RPUSH', KEYS[1], ARGV[1])
  redis.call('LTRIM', KEYS[1], -tonumber(ARGV[2]), -1)
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  for i = 3, #KEYS do
    redis.call('RPUSH', KEYS[i], ARGV[2 * i - 1])
    redis.call('LTRIM', KEYS[i], -tonumber(ARGV[2 * i]), -1)
    redis.call('EXPIRE', KEYS[i], ARGV[3])
  end
  return 1
end
return 0
"""
# log-probabilities in a calibration row: at least log(1e-6) - 1 (the floor, with rounding room), at most 0
LOG_PROB_FLOOR = -15.0


@dataclass(frozen=True)
class CalibrationRows:
    """One outcome's rows for the stream's calibrations: the choice count, the label, each called model's
    log-probabilities over the choices."""

    n_choices: int
    label: int
    log_probs: dict[int, list[float]]
    pool: tuple[int, ...] = ()  # the models whose answers were served (the pool's joint fits)

    def to_list(self) -> list:
        """JSON-ready (the learner's checkpointed backlog, a joint row in Redis)."""
        return [self.n_choices, self.label, [[m, p] for m, p in sorted(self.log_probs.items())], list(self.pool)]

    @classmethod
    def from_list(cls, values: list) -> CalibrationRows:
        pool = tuple(int(m) for m in values[3]) if len(values) > 3 else ()  # a backlog checkpointed before pools
        return cls(int(values[0]), int(values[1]), {int(m): list(p) for m, p in values[2]}, pool)


def ready_index_key(prefix: str) -> str:
    """The set of the readiness marks' names; each mark is this key, a colon, and its name (:func:`ready_urls`)."""
    return f"{prefix}:ready"


def ready_urls(redis: Any, prefix: str, role: str = "") -> dict[str, str]:
    """The URL of each process whose readiness mark is set (of ``role`` alone, if given), by the mark's name
    (``<role>:<host>-<pid>``), read through the ``{prefix}:ready`` set: a few reads whatever the keyspace holds, where
    a SCAN for the marks walks every key (21.6 s among a million markers, one command at a time). Members whose mark
    expired (a process that crashed) are removed. ``redis``: a blocking client (:func:`rlens.redis_clients.sync_redis`),
    for the command line and the local stack."""
    index = ready_index_key(prefix)
    urls = {}
    for raw in redis.smembers(index):
        name = raw.decode() if isinstance(raw, bytes) else raw
        if role and not name.startswith(f"{role}:"):
            continue
        url = redis.get(f"{index}:{name}")
        if url is None:
            redis.srem(index, raw)
        else:
            urls[name] = url.decode() if isinstance(url, bytes) else url
    return urls


def pool_costs_key(prefix: str, strategy: str) -> str:
    """Where the workers of a strategy announce their pool's model costs (JSON: models, costs)."""
    return f"{prefix}:costs:{strategy}"


def pushed_since(read: list[bytes], rows: list[bytes], size: int) -> int | None:
    """How many of ``rows`` (a window's rows now, oldest first, trimmed to ``size``) were pushed since ``read`` (its
    rows at an earlier read): the fewest such that the rest are ``read``'s newest, as many as a ring of ``size``
    holding ``read`` and then those keeps (all of them after an empty read). None where ``rows`` are not that (the
    window was trimmed by hand, or expired and started again), or where more than half of them would be new
    (parsing them all costs about as much)."""
    if not read:
        return len(rows) if len(rows) <= size else None
    for overlap in range(min(len(read), len(rows)), len(rows) // 2 - 1, -1):
        pushed = len(rows) - overlap
        if overlap and min(len(read) + pushed, size) == len(rows) and rows[:overlap] == read[len(read) - overlap :]:
            return pushed
    return None


@dataclass
class StreamStates:
    """What a batch's streams hold in Redis (:meth:`RedisWindows.load_with_pools`), by stream: the windows, the
    last pools and published calibrations found, and the queries asked (a stream not in it: none)."""

    windows: dict[str, OutcomeWindow]
    pools: dict[str, np.ndarray]
    fits: dict[str, StreamCalibration]
    asked: dict[str, int]


class RedisWindows:
    def __init__(
        self,
        redis: Redis,
        n_models: int,
        size: int,
        prefix: str = "rlens",
        window_ttl_s: int = 7 * 86400,
        dedup_ttl_s: int = 86400,
        calibration_rows: int = 0,
        joint_rows: int = 0,
    ):
        self.redis = redis
        self.n_models, self.size, self.prefix = n_models, size, prefix
        self.calibration_rows = calibration_rows  # rows kept per model for its calibration (0: none)
        self.joint_rows = joint_rows if calibration_rows else 0  # queries kept whole for joint fits (0: none)
        self.window_ttl_s, self.dedup_ttl_s = window_ttl_s, dedup_ttl_s
        self._apply = redis.register_script(APPLY_OUTCOME)
        self._renew = redis.register_script(RENEW_LEASE)
        self.skipped_rows = 0  # rows read that did not fit the pool or the bounds
        # each stream's last published calibrations as read and as restored, the newest RESTORED_STREAMS streams: a
        # worker reads them with every batch, and they change only when the learner publishes new fits
        self._restored: OrderedDict[str, tuple[bytes, StreamCalibration | None]] = OrderedDict()
        # each stream's pool as the last load found it, and when this process last wrote it (the newest
        # RESTORED_STREAMS streams): a pool the Decider keeps is written again only to renew its expiry
        self._pools_read: dict[str, bytes | None] = {}
        self._pools_written: OrderedDict[str, float] = OrderedDict()
        # each stream's window as the last load read it, every row fitting (its rows, the window, the window's
        # count then; the newest RESTORED_STREAMS streams): the next load extends it by the rows pushed since
        self._read: OrderedDict[str, tuple[list[bytes], OutcomeWindow, int]] = OrderedDict()
        # streams whose query count, or window, was last read at the limit asked for (the newest RESTORED_STREAMS):
        # counts only grow, so theirs is not read again
        self._settled: OrderedDict[str, int] = OrderedDict()

    def row_error(self, predictions: list[int], label: int, reward: float) -> str | None:
        """Why a row cannot enter a window of this pool, or None."""
        if len(predictions) != self.n_models:
            return f"predictions for {len(predictions)} models, the pool has {self.n_models}"
        if not all(-1 <= int(p) < MAX_CHOICES for p in predictions) or not -1 <= int(label) < MAX_CHOICES:
            return f"a prediction or the label is outside -1..{MAX_CHOICES - 1}"
        if not (isinstance(reward, (int, float)) and math.isfinite(reward) and abs(reward) <= 10):
            return f"reward {reward!r} is not a finite number within ±10"
        return None

    def window_key(self, stream: str) -> str:
        return f"{self.prefix}:win:{{{stream}}}"

    def applied_key(self, stream: str, query_id: str) -> str:
        return f"{self.prefix}:applied:{{{stream}}}:{query_id}"

    def pool_key(self, stream: str) -> str:
        return f"{self.prefix}:pool:{{{stream}}}"

    def calibration_key(self, stream: str, part: int | str) -> str:
        """Model ``part``'s calibration rows, or (``"labels"``) the stream's labels."""
        return f"{self.prefix}:cal:{{{stream}}}:{part}"

    def joint_key(self, stream: str) -> str:
        return f"{self.prefix}:joint:{{{stream}}}"

    def fit_key(self, stream: str) -> str:
        return f"{self.prefix}:fit:{{{stream}}}"

    async def load(self, streams: list[str]) -> dict[str, OutcomeWindow]:
        """The current window of each stream (one round trip); rows that do not fit the pool are skipped."""
        return (await self.load_with_pools(streams, pools=False)).windows

    def asked_key(self, stream: str) -> str:
        return f"{self.prefix}:asked:{{{stream}}}"

    async def load_with_pools(
        self, streams: list[str], pools: bool = True, fits: bool = False, asked: int = 0
    ) -> StreamStates:
        """Each stream's window and, where one was saved and fits this pool, its last pool (bool [M]), (with
        ``fits``) its calibrations as the learner published them and (with ``asked`` > 0) the queries it was asked
        (counted up to ``asked``; a count that is not an integer reads as ``asked``; a stream whose count or window
        was read at ``asked`` before is not read again), in one round trip."""
        settled = self._settled
        counted = [s for s in streams if settled.get(s, 0) < asked] if asked else []
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.lrange(self.window_key(stream), 0, -1)
                if pools:
                    pipe.get(self.pool_key(stream))
                if fits:
                    pipe.get(self.fit_key(stream))
            for stream in counted:
                pipe.get(self.asked_key(stream))
            raw = await pipe.execute()
        step = 1 + pools + fits
        raw, raw_counts = raw[: step * len(streams)], raw[step * len(streams) :]
        last_pools = {}
        if pools:
            self._pools_read = dict(zip(streams, raw[1::step]))
        for stream, value in zip(streams, raw[1::step] if pools else []):
            if isinstance(value, bytes) and len(value) == self.n_models and set(value) <= {48, 49} and 49 in value:
                last_pools[stream] = np.frombuffer(value, dtype=np.uint8) == 49
        calibrations = {}
        for stream, value in zip(streams, raw[step - 1 :: step] if fits else []):
            if value is not None and (calibration := self._restored_calibration(stream, value)) is not None:
                calibrations[stream] = calibration
        windows = self._windows(streams, raw[::step])
        counts = {stream: asked for stream in streams if asked and stream not in counted}
        for stream, value in zip(counted, raw_counts):
            if value is not None:
                counts[stream] = int(value) if value.isdigit() else asked
        for stream in counted:
            if max(counts.get(stream, 0), windows[stream].n_rows) >= asked:
                settled[stream] = asked
                settled.move_to_end(stream)
        while len(settled) > RESTORED_STREAMS:
            settled.popitem(last=False)
        return StreamStates(windows, last_pools, calibrations, counts)

    def _restored_calibration(self, stream: str, value: bytes) -> StreamCalibration | None:
        """:meth:`_calibration` of a stream's published value, restored again only when it changed."""
        known = self._restored.get(stream)
        if known is not None and known[0] == value:
            self._restored.move_to_end(stream)
            if known[1] is None:
                self.skipped_rows += 1
            return known[1]
        calibration = self._calibration(value)
        self._restored[stream] = (value, calibration)
        if len(self._restored) > RESTORED_STREAMS:
            self._restored.popitem(last=False)
        return calibration

    def _calibration(self, value: bytes) -> StreamCalibration | None:
        """Published calibrations, or None (counted as skipped) when they do not fit this pool."""
        try:
            state = json.loads(value)
            calibration = StreamCalibration.restored(self.n_models, state)
            for (model, n_choices), (_, theta) in calibration.fits.items():
                if not (0 <= model < self.n_models and 2 <= n_choices <= MAX_CHOICES) or theta.shape != (
                    n_choices + 1,
                    n_choices,
                ):
                    raise ValueError("a fit of another shape")
                if not np.isfinite(theta).all():
                    raise ValueError("a fit that is not finite")
            for n_choices, prior in calibration._priors.items():
                if not (2 <= n_choices <= MAX_CHOICES and prior.shape == (n_choices,) and (prior > 0).all()):
                    raise ValueError("label counts of another shape")
            joint = calibration.combiner.fits if calibration.combiner is not None else {}
            for (pool, n_choices), theta in joint.items():
                members = int(np.frombuffer(pool, dtype=bool).sum())
                if not 2 <= n_choices <= MAX_CHOICES or theta.shape != (members * n_choices + 1, n_choices):
                    raise ValueError("a joint fit of another shape")
                if not np.isfinite(theta).all():
                    raise ValueError("a joint fit that is not finite")
            return calibration
        except Exception:
            self.skipped_rows += 1
            return None

    async def load_calibration(self, stream: str, joint: bool = False) -> StreamCalibration:
        """The stream's calibration rows (every model's and the labels; with ``joint``, its queries kept whole) as a
        :class:`StreamCalibration` to fit; rows that do not fit are skipped (and counted)."""
        joint = joint and self.joint_rows > 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for part in [*range(self.n_models), "labels"]:
                pipe.lrange(self.calibration_key(stream, part), 0, -1)
            if joint:
                pipe.lrange(self.joint_key(stream), 0, -1)
            raw = await pipe.execute()
        calibration = StreamCalibration(
            self.n_models, max(self.calibration_rows, 1), joint_rows=self.joint_rows if joint else 0
        )
        if calibration.combiner is not None:
            for row in raw.pop():
                if (whole := self._joint_row(row)) is not None:
                    log_p = np.full((self.n_models, whole.n_choices), np.log(LOG_FLOOR))
                    called = np.zeros(self.n_models, dtype=bool)
                    for model, log_probs in whole.log_probs.items():
                        log_p[model], called[model] = log_probs, True
                    pool = np.zeros(self.n_models, dtype=bool)
                    pool[list(whole.pool)] = True
                    calibration.combiner.push(log_p, called, pool if pool.any() else None, whole.label)
        for model, rows in enumerate(raw[: self.n_models]):
            for row in rows:
                values = self._calibration_row(row)
                if values is None:
                    continue
                n_choices, label = int(values[0]), int(values[1])
                calibration.history[model].append((n_choices, np.asarray(values[2:]), label))
        for row in raw[-1]:
            values = self._calibration_row(row, labels_only=True)
            if values is not None:
                calibration.labels.append((int(values[0]), int(values[1])))
        return calibration

    def _joint_row(self, row: bytes) -> CalibrationRows | None:
        """A joint row, or None (skipped and counted) where it does not fit this pool."""
        try:
            values = json.loads(row)
            rows = CalibrationRows.from_list(values)
            if len(values) != 4 or self.calibration_error(rows) or not rows.log_probs:
                raise ValueError
            if not all(0 <= m < self.n_models for m in rows.pool):
                raise ValueError
            return rows
        except Exception:
            self.skipped_rows += 1
            return None

    def _calibration_row(self, row: bytes, labels_only: bool = False) -> list | None:
        try:
            values = json.loads(row)
            n_choices, label = values[0], values[1]
            if not (type(n_choices) is int and type(label) is int and 2 <= n_choices <= MAX_CHOICES):
                raise ValueError
            if not 0 <= label < n_choices or len(values) != (2 if labels_only else n_choices + 2):
                raise ValueError
            if not all(type(v) in (int, float) and LOG_PROB_FLOOR <= v <= 0 for v in values[2:]):
                raise ValueError
            return values
        except Exception:
            self.skipped_rows += 1
            return None

    async def save_calibration(self, stream: str, calibration: StreamCalibration) -> None:
        """Publish the stream's fitted calibrations (what the workers vote with)."""
        state = json.dumps(calibration.state(), separators=(",", ":"))
        await self.redis.set(self.fit_key(stream), state, ex=self.window_ttl_s)

    async def save_pools(self, pools: dict[str, np.ndarray], asked: dict[str, int] | None = None) -> None:
        """Each stream's latest pool (one round trip; the last writer wins), and ``asked``: the queries some streams
        were asked since they were read, added to their counts. A pool the last load found already stored is not
        written, unless this process last wrote it more than half its expiry ago."""
        now, renew_s = time.monotonic(), self.window_ttl_s / 2
        written = self._pools_written
        values = {stream: "".join("1" if chosen else "0" for chosen in pool).encode() for stream, pool in pools.items()}
        values = {
            stream: value
            for stream, value in values.items()
            if value != self._pools_read.get(stream) or now - written.get(stream, -renew_s) >= renew_s
        }
        asked = {stream: n for stream, n in (asked or {}).items() if n > 0}
        if not values and not asked:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream, value in values.items():
                pipe.set(self.pool_key(stream), value, ex=self.window_ttl_s)
            for stream, n in asked.items():
                pipe.incrby(self.asked_key(stream), n)
                pipe.expire(self.asked_key(stream), self.window_ttl_s)
            await pipe.execute()
        for stream in values:
            written[stream] = now
            written.move_to_end(stream)
        while len(written) > RESTORED_STREAMS:
            written.popitem(last=False)

    def _windows(self, streams: list[str], raw: list) -> dict[str, OutcomeWindow]:
        return {stream: self._window_of(stream, rows) for stream, rows in zip(streams, raw)}

    def _window_of(self, stream: str, rows: list[bytes]) -> OutcomeWindow:
        """The stream's window from its rows: where they are the last read's rows (less the oldest the update
        trimmed) and then the rows pushed since, that read's window extended by those (the same window as all the
        rows parsed, for a fraction of the work; a worker reads its streams' windows with every batch); else
        parsed whole. A window whose every row fit is kept for the next read."""
        known = self._read.pop(stream, None)
        # nobody pushed into the window kept since, and the rows read are its rows and new ones
        if (
            known is not None
            and known[1].count == known[2]
            and (pushed := pushed_since(known[0], rows, self.size)) is not None
        ):
            window = known[1]
            self._extend(window, rows[len(rows) - pushed :])
        else:
            window = self._window(rows)
        if window.n_rows == len(rows):
            self._read[stream] = (rows, window, window.count)
            if len(self._read) > RESTORED_STREAMS:
                self._read.popitem(last=False)
        return window

    def _window(self, rows: list[bytes]) -> OutcomeWindow:
        window = OutcomeWindow(self.n_models, self.size)
        self._extend(window, rows)
        return window

    def _extend(self, window: OutcomeWindow, rows: list[bytes]) -> None:
        """Push ``rows`` into ``window``, parsed in one go; rows that do not fit are skipped (and counted)."""
        if not rows:
            return
        try:
            values = np.array(json.loads(b"[" + b",".join(rows) + b"]"), dtype=np.float64)
        except Exception:  # some row is not a list of (float-sized) numbers, or nested too deep: row by row
            values = None
        if values is None or values.shape != (len(rows), self.n_models + 2):
            parsed = [self._parse_row(row) for row in rows]
            self.skipped_rows += sum(p is None for p in parsed)
            values = np.array([p for p in parsed if p is not None], dtype=np.float64).reshape(-1, self.n_models + 2)
        choices = np.delete(values, 1, axis=1)  # the label and the predictions
        fits = (choices == np.round(choices)).all(1) & (choices >= -1).all(1) & (choices < MAX_CHOICES).all(1)
        fits &= np.isfinite(values[:, 1]) & (np.abs(values[:, 1]) <= 10)
        self.skipped_rows += int((~fits).sum())
        values = values[fits]
        window.extend(values[:, 2:].astype(np.int64), values[:, 0].astype(np.int64), values[:, 1])

    def _parse_row(self, row: bytes) -> list | None:
        """The row's values, or None for a row that does not fit, whatever parsing it raises (a row of 1,000 "["
        raises RecursionError): one bad row must never cost the stream its window."""
        try:
            values = json.loads(row)
            if (
                isinstance(values, list)
                and len(values) == self.n_models + 2
                and all(type(v) is int for v in (values[0], *values[2:]))  # not bool, an int to isinstance
                and type(values[1]) in (int, float)
            ):
                if self.row_error(values[2:], values[0], float(values[1])) is None:
                    return [values[0], float(values[1]), *values[2:]]
        except Exception:
            pass
        return None

    async def keep_last(self, stream: str, k: int) -> None:
        """Forget all but the stream's last ``k`` outcomes (a reaction to drift: the old task's rows go)."""
        if k > 0:
            await self.redis.ltrim(self.window_key(stream), -k, -1)
        else:
            await self.redis.delete(self.window_key(stream))

    async def apply(self, stream: str, query_id: str, predictions: list[int], label: int, reward: float) -> bool:
        """Add one query's outcome to its stream's window, once; False if it was already applied. A row that does
        not fit (:meth:`row_error`) is a ValueError."""
        return (await self.apply_many([(stream, query_id, predictions, label, reward)]))[0]

    async def apply_many(self, outcomes: Sequence[Sequence]) -> list[bool]:
        """Several outcomes ``(stream, query id, predictions, label, reward[, calibration rows])`` in one round trip (a
        pipeline of the update script, run in order, each applied once); per outcome, False if it was already applied.
        Any row that does not fit is a ValueError before anything is sent."""
        for stream, query_id, predictions, label, reward, *calibration in outcomes:
            if error := self.row_error(predictions, label, reward) or self.calibration_error(*calibration[:1]):
                raise ValueError(f"query {query_id}: {error}")
        calls = []
        for stream, query_id, predictions, label, reward, *calibration in outcomes:
            row = json.dumps([int(label), float(reward), *map(int, predictions)], separators=(",", ":"))
            keys = [self.window_key(stream), self.applied_key(stream, query_id)]
            args: list[str | int] = [row, self.size, self.window_ttl_s, self.dedup_ttl_s]  # then (row, bound)s
            rows = calibration[0] if calibration and self.calibration_rows else None
            if rows is not None:
                for model, log_probs in sorted(rows.log_probs.items()):
                    keys.append(self.calibration_key(stream, model))
                    args += [json.dumps([rows.n_choices, rows.label, *log_probs], separators=(",", ":"))]
                    args += [self.calibration_rows]
                keys.append(self.calibration_key(stream, "labels"))
                args += [json.dumps([rows.n_choices, rows.label]), self.calibration_rows]
                if self.joint_rows:
                    keys.append(self.joint_key(stream))
                    args += [json.dumps(rows.to_list(), separators=(",", ":")), self.joint_rows]
            calls.append((keys, args))
        return [bool(applied) for applied in await run_scripts(self.redis, self._apply, calls)]

    def calibration_error(self, rows: CalibrationRows | None = None) -> str | None:
        """Why an outcome's calibration rows cannot be kept, or None."""
        if rows is None:
            return None
        if not (2 <= rows.n_choices <= MAX_CHOICES and 0 <= rows.label < rows.n_choices):
            return f"calibration rows for label {rows.label} of {rows.n_choices} choices"
        if not all(0 <= m < self.n_models for m in rows.pool):
            return f"a served model outside the pool's {self.n_models}"
        for model, log_probs in rows.log_probs.items():
            if not 0 <= model < self.n_models or len(log_probs) != rows.n_choices:
                return f"calibration row of model {model}: not one of the pool's, or not {rows.n_choices} values"
            if not all(math.isfinite(v) and LOG_PROB_FLOOR <= v <= 0 for v in log_probs):
                return f"calibration row of model {model}: a log-probability outside {LOG_PROB_FLOOR}..0"
        return None

    def ready_key(self, role: str, name: str) -> str:
        return f"{self.ready_index}:{role}:{name}"

    @property
    def ready_index(self) -> str:
        return ready_index_key(self.prefix)

    async def mark_ready(self, role: str, name: str, ready: bool = True, url: str = "", warn: bool = True) -> bool:
        """Announce (with the URL of its HTTP side) or withdraw a service process; ``rlens up`` and the tests wait
        for these marks. Best-effort: False when Redis is unreachable (the process works without it)."""
        try:
            if ready:
                await self.redis.set(self.ready_key(role, name), url or "1", ex=READY_TTL_S)
                await self.redis.sadd(self.ready_index, f"{role}:{name}")
                await self.redis.expire(self.ready_index, READY_TTL_S)
            else:
                await self.redis.delete(self.ready_key(role, name))
                await self.redis.srem(self.ready_index, f"{role}:{name}")
        except (RedisError, OSError) as exc:
            if warn:
                log.warning(
                    "Redis unreachable (%s): readiness mark of %s %s not %s",
                    exc,
                    role,
                    name,
                    "set" if ready else "removed",
                )
            return False
        return True

    async def lease(self, group: str, name: str, take_over: bool = False) -> str | None:
        """Take or renew the lease of consumer group ``group`` for ``name``; None if ours, else who holds it.
        ``take_over``: take it whoever holds it (the caller knows the holder is gone)."""
        key = f"{self.prefix}:lease:{group}"
        if take_over:
            await self.redis.set(key, name, ex=LEASE_TTL_S)
            return None
        if await self._renew(keys=[key], args=[name, LEASE_TTL_S]):
            return None
        holder = await self.redis.get(key)
        return (holder.decode() if isinstance(holder, bytes) else holder) if holder else "another learner"

    async def release(self, group: str, name: str) -> None:
        key = f"{self.prefix}:lease:{group}"
        try:
            if (await self.redis.get(key)) == name.encode():
                await self.redis.delete(key)
        except (RedisError, OSError):
            pass

    async def keep_ready(self, role: str, name: str, url: str = "", every_s: float = 2.0) -> None:
        """Keep the readiness mark set for as long as the task runs: renewed every ``every_s`` (its TTL is
        :data:`READY_TTL_S`), so it is back within ``every_s`` of Redis restarting empty."""
        marked = True
        while True:
            marked = await self.mark_ready(role, name, url=url, warn=marked)  # one warning per outage
            await asyncio.sleep(every_s)

    def reply_key(self, topic: str) -> str:
        return f"{self.prefix}:replies:{topic}"

    async def keep_reply_topic(self, topic: str, every_s: float = 2.0) -> None:
        """A gateway's task: register its reply topic for as long as it runs (renewed like the readiness mark)."""
        while True:
            try:
                await self.redis.set(self.reply_key(topic), "1", ex=READY_TTL_S)
            except (RedisError, OSError):
                pass  # the gateway's own readiness says Redis is down
            await asyncio.sleep(every_s)

    async def keep_pool_costs(
        self, strategy: str, models: list[str], costs: Sequence[float], every_s: float = 2.0
    ) -> None:
        """A worker's task: announce its pool's model costs for as long as it runs (what a gateway holds of a key's
        budget for a query depends on them), renewed like the readiness mark."""
        value = json.dumps({"models": list(models), "costs": [float(c) for c in costs]})
        while True:
            try:
                await self.redis.set(pool_costs_key(self.prefix, strategy), value, ex=READY_TTL_S)
            except (RedisError, OSError):
                pass  # the worker's own readiness says Redis is down
            await asyncio.sleep(every_s)

    def owner_key(self, query_id: str) -> str:
        return f"{self.prefix}:owner:{{{query_id}}}"

    async def admission(self, topics: set[str], claims: dict[str, str]) -> tuple[set[str], dict[str, str]]:
        """In one round trip: which of ``topics`` a live gateway registered, and each query id's stream (``claims``:
        query id → the stream a query asks on), claimed by the first query that names it (kept ``dedup_ttl_s``), so
        a query id is answered on one stream only. Raises RedisError when Redis is down."""
        ordered, ids = sorted(topics), sorted(claims)
        async with self.redis.pipeline(transaction=False) as pipe:
            for topic in ordered:
                pipe.exists(self.reply_key(topic))
            for query_id in ids:
                pipe.set(self.owner_key(query_id), claims[query_id], nx=True, get=True, ex=self.dedup_ttl_s)
            found = await pipe.execute()
        owners = {q: claims[q] if owner is None else owner.decode() for q, owner in zip(ids, found[len(ordered) :])}
        return {topic for topic, exists in zip(ordered, found) if exists}, owners
