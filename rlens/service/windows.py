"""Per-stream outcome windows in Redis: what every worker reads and the learner writes.

Keys (``{prefix}`` from the settings, default ``rlens``; the stream key in braces is a Redis Cluster hash tag,
so both keys of one stream live in one slot and the update script may touch both):

| key | type | content | bound | TTL |
|---|---|---|---|---|
| ``{prefix}:win:{<stream>}`` | list | the last W outcomes, oldest first, each ``[label, reward, p_0, ..., p_{M-1}]`` (JSON; ``p_m`` is model m's predicted choice, -1 where not called) | LTRIM to W | ``window_ttl_s``, renewed on every update |
| ``{prefix}:applied:{<stream>}:<query id>`` | string | marks a query whose outcome is in the window | one per query | ``dedup_ttl_s`` |
| ``{prefix}:ready:<role>:<host>-<pid>`` | string | a worker or learner process whose subscribers have joined | one per process | a day; deleted on clean shutdown |

An update is one Lua script: if the query's marker is new, push the row, trim to W, renew the TTL; else do
nothing. So feedback applied twice (a redelivered message, a learner replaying after a crash) counts once, and
readers never see a half-applied update. A missing key is an empty (cold) window.
"""

from __future__ import annotations

import json

import numpy as np
from redis.asyncio import Redis

from rlens.focal.window import OutcomeWindow

APPLY_OUTCOME = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[4]) then
  redis.call('RPUSH', KEYS[1], ARGV[1])
  redis.call('LTRIM', KEYS[1], -tonumber(ARGV[2]), -1)
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
"""


class RedisWindows:
    def __init__(self, redis: Redis, n_models: int, size: int, prefix: str = "rlens", window_ttl_s: int = 7 * 86400, dedup_ttl_s: int = 86400):
        self.redis = redis
        self.n_models, self.size, self.prefix = n_models, size, prefix
        self.window_ttl_s, self.dedup_ttl_s = window_ttl_s, dedup_ttl_s
        self._apply = redis.register_script(APPLY_OUTCOME)

    def window_key(self, stream: str) -> str:
        return f"{self.prefix}:win:{{{stream}}}"

    def applied_key(self, stream: str, query_id: str) -> str:
        return f"{self.prefix}:applied:{{{stream}}}:{query_id}"

    async def load(self, streams: list[str]) -> dict[str, OutcomeWindow]:
        """The current window of each stream (one round trip); rows that do not fit the pool are skipped."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.lrange(self.window_key(stream), 0, -1)
            raw = await pipe.execute()
        windows = {}
        for stream, rows in zip(streams, raw):
            window = OutcomeWindow(self.n_models, self.size)
            for row in rows:
                values = json.loads(row)
                if len(values) == self.n_models + 2:
                    window.push(np.asarray(values[2:], dtype=np.int64), int(values[0]), float(values[1]))
            windows[stream] = window
        return windows

    async def apply(self, stream: str, query_id: str, predictions: list[int], label: int, reward: float) -> bool:
        """Add one query's outcome to its stream's window, once; False if it was already applied."""
        if len(predictions) != self.n_models:
            raise ValueError(f"predictions for {len(predictions)} models, the pool has {self.n_models}")
        row = json.dumps([int(label), float(reward), *map(int, predictions)], separators=(",", ":"))
        keys = [self.window_key(stream), self.applied_key(stream, query_id)]
        return bool(await self._apply(keys=keys, args=[row, self.size, self.window_ttl_s, self.dedup_ttl_s]))

    def ready_key(self, role: str, name: str) -> str:
        return f"{self.prefix}:ready:{role}:{name}"

    async def mark_ready(self, role: str, name: str, ready: bool = True) -> None:
        """Announce (or withdraw) a service process; ``rlens up`` and the tests wait for these marks."""
        if ready:
            await self.redis.set(self.ready_key(role, name), "1", ex=86400)
        else:
            await self.redis.delete(self.ready_key(role, name))
