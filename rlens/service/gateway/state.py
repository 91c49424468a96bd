"""What the gateway keeps in Redis, shared by its replicas: queries asked, answers, idempotency keys, feedback
given and the per-key rate buckets. Every key but spending expires (``RLENS_GATEWAY_RETENTION_S``), so memory stays
bounded.

Keys (under ``<prefix>:gw:``): ``q:<id>`` the query's owner and shape (a hash), ``a:<id>`` its first answer (JSON;
later duplicates of an at-least-once answer never replace it), ``idem:<tenant>:<sha256>`` the query id of an
``Idempotency-Key``, ``fb:<id>`` that the query has feedback, ``rate:<key id>`` a token bucket, ``spent:{<key
id>}:<period>`` what a key spent in a budget period (``total``, a day ``2026-11-27`` or a month ``2026-11``),
``hold:{<key id>}`` the cost held for its queries not yet answered (query id → amount and expiry), ``restored:{<key
id>}`` that the key's spending is whole (a Redis that restarted empty has no mark: the key's spending is then
restored from the ``spending`` topic before its next hold, :mod:`.spending`).

Budgets cap: a query of a key with a budget holds what it may cost before it is published (:meth:`GatewayState.
reserve`, one script: the period's spending plus every live hold plus this one stay within the budget), and the
answer settles it (:meth:`GatewayState.settle`: the hold released, the answer's cost spent). Concurrent requests
cannot overspend: what one holds, the others cannot.
"""

from __future__ import annotations

import hashlib
import json
import time

from pydantic import BaseModel
from redis.asyncio import Redis

from rlens.messages import Answer
from rlens.redis_clients import run_scripts
from rlens.service.common.windows import pool_costs_key

# A token bucket refilled at ARGV[1] per second up to ARGV[2]; Redis's own clock, so replicas agree.
# Returns 0 when a token was taken, else the seconds until one is there.
TAKE_TOKEN = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 't', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 't', tostring(tokens), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return tostring(wait)
"""


# A query's hold on its key's budget. KEYS: the period's spending, the key's holds, the key's restored mark. ARGV:
# query id, the most it may cost, the least an answer can cost, the budget, how long a hold lives. Expired holds are
# dropped first. Returns {1, held} (the hold taken: the most it may cost, cut to what is left), {0, left} (refused:
# less than the least an answer can cost is left) or {-1, 0} (no mark: Redis lost the key's spending).
RESERVE = """
if redis.call('EXISTS', KEYS[3]) == 0 then return {-1, '0'} end
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
local spent = tonumber(redis.call('GET', KEYS[1]) or '0')
local holds = redis.call('HGETALL', KEYS[2])
local held = 0
for i = 1, #holds, 2 do
  local amount, expires = string.match(holds[i + 1], '(%S+) (%S+)')
  if tonumber(expires) < now then redis.call('HDEL', KEYS[2], holds[i]) else held = held + tonumber(amount) end
end
local left = tonumber(ARGV[4]) - spent - held
local take = math.min(tonumber(ARGV[2]), left)
if take < tonumber(ARGV[3]) - 1e-9 then return {0, tostring(left)} end
redis.call('HSET', KEYS[2], ARGV[1], tostring(take) .. ' ' .. tostring(now + tonumber(ARGV[5])))
redis.call('EXPIRE', KEYS[2], math.ceil(tonumber(ARGV[5])))
return {1, tostring(take)}
"""
# An answer's settlement. KEYS: the period's spending, the key's holds. ARGV: query id, its cost, the spending's TTL
# (0: none). The hold is released and the cost spent, in one step.
SETTLE = """
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('INCRBYFLOAT', KEYS[1], ARGV[2])
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 1
"""
# A key's spending given back. KEYS: the period's spending, the key's restored mark. ARGV: the spending found
# elsewhere, the spending's TTL (0: none). The larger of the two is kept, and the key marked restored.
RESTORE = """
local spent = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), tonumber(ARGV[1]))
redis.call('SET', KEYS[1], tostring(spent))
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
redis.call('SET', KEYS[2], '1')
return tostring(spent)
"""
PERIOD_TTL_S = {"total": 0, "daily": 2 * 86400, "monthly": 62 * 86400}
PERIODS = tuple(PERIOD_TTL_S)


def period_stamp(period: str, now: float | None = None) -> str:
    """The budget period ``now`` falls in (UTC): ``total``, a day or a month."""
    if period == "total":
        return "total"
    day = time.strftime("%Y-%m-%d", time.gmtime(time.time() if now is None else now))
    return day if period == "daily" else day[:7]


def period_of(stamp: str) -> str:
    """The budget period a stamp is of (``total``, ``2026-11-27``: daily, ``2026-11``: monthly)."""
    return "total" if stamp == "total" else "daily" if len(stamp) == 10 else "monthly"


class SpendingLost(Exception):
    """Redis has no restored mark for the key: it lost the key's spending, which must be restored before a hold."""


class QueryRecord(BaseModel):
    """Who asked a query and what it was: enough to check its feedback and to answer only its tenant."""

    tenant: str
    stream: str
    model: str  # the API model named (its strategy is openai_api.MODELS[model])
    chat: bool
    n_choices: int = 0  # 0: open-ended
    published: bool = False
    key_id: str = ""  # the API key that asked it (its answer's cost is charged to it)
    budget_period: str = ""  # the key's budget period, when the query holds part of its budget
    traceparent: str = ""  # the request's trace (W3C), which its feedback's span links to


class GatewayState:
    def __init__(self, redis: Redis, prefix: str, ttl_s: int):
        self.redis, self.ttl_s = redis, ttl_s
        self.service_prefix, self.prefix = prefix, f"{prefix}:gw"
        self._take = redis.register_script(TAKE_TOKEN)
        self._reserve = redis.register_script(RESERVE)
        self._settle = redis.register_script(SETTLE)
        self._restore = redis.register_script(RESTORE)

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def remember_query(self, query_id: str, record: QueryRecord) -> None:
        await self.redis.set(self._k("q", query_id), record.model_dump_json(), ex=self.ttl_s)

    async def query(self, query_id: str) -> QueryRecord | None:
        raw = await self.redis.get(self._k("q", query_id))
        return QueryRecord.model_validate_json(raw) if raw else None

    async def mark_published(self, query_id: str, record: QueryRecord) -> None:
        await self.remember_query(query_id, record.model_copy(update={"published": True}))

    async def idempotent(self, tenant: str, key: str, request_digest: str, new_id: str) -> tuple[str, str] | None:
        """Bind ``key`` to ``new_id`` unless it is bound already: None if it was new, else (query id, request digest)
        of the first request with that key."""
        name = self._k("idem", tenant, hashlib.sha256(key.encode()).hexdigest())
        if await self.redis.set(name, f"{new_id} {request_digest}", nx=True, ex=self.ttl_s):
            return None
        raw = await self.redis.get(name)
        if raw is None:  # expired in between: bind it now
            await self.redis.set(name, f"{new_id} {request_digest}", ex=self.ttl_s)
            return None
        query_id, digest = (raw.decode() if isinstance(raw, bytes) else raw).split(" ", 1)
        return query_id, digest

    async def records(self, query_ids: list[str]) -> list[QueryRecord | None]:
        """Each query's record if it was asked through a gateway (and is within retention), in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for query_id in query_ids:
                pipe.get(self._k("q", query_id))
            return [QueryRecord.model_validate_json(raw) if raw else None for raw in await pipe.execute()]

    def _of_key(self, name: str, key_id: str, *rest: str) -> str:
        """An API key's Redis key ``name``; all of one API key's keys in one hash slot (its id as the hash tag)."""
        return self._k(name, f"{{{key_id}}}", *rest)

    def _budget_keys(self, key_id: str, period: str) -> list[str]:
        """The current period's spending key, the key's holds and its restored mark."""
        spent, restored = self._stamp_keys(key_id, period_stamp(period))
        return [spent, self._of_key("hold", key_id), restored]

    def _stamp_keys(self, key_id: str, stamp: str) -> list[str]:
        """A period stamp's spending key and the key's restored mark."""
        return [self._of_key("spent", key_id, stamp), self._of_key("restored", key_id)]

    async def pool_costs(self, strategy: str) -> list[float] | None:
        """The model costs the strategy's workers announce (None before any worker runs)."""
        raw = await self.redis.get(pool_costs_key(self.service_prefix, strategy))
        return [float(c) for c in json.loads(raw)["costs"]] if raw else None

    async def reserve(
        self, key_id: str, period: str, query_id: str, most: float, least: float, budget: float
    ) -> tuple[bool, float]:
        """Hold up to ``most`` of the key's budget for a query, atomically: (True, the amount held, cut to what is
        left) or (False, what is left) when less than ``least`` (the cheapest answer) is left. Raises
        :class:`SpendingLost` when Redis lost the key's spending."""
        taken, amount = await self._reserve(
            keys=self._budget_keys(key_id, period), args=[query_id, most, least, budget, self.ttl_s]
        )
        if int(taken) < 0:
            raise SpendingLost(key_id)
        return bool(int(taken)), float(amount)

    async def restore_spending(self, found: list[tuple[str, str, float]]) -> list[float]:
        """Each (key id, period stamp, spending found elsewhere): the key's spending in that period raised to what
        was found if below it, and the key marked restored, in one round trip; what each key spent now."""
        calls = [
            (self._stamp_keys(key_id, stamp), [amount, PERIOD_TTL_S[period_of(stamp)]])
            for key_id, stamp, amount in found
        ]
        return [float(spent) for spent in await run_scripts(self.redis, self._restore, calls)]

    async def legacy_spending(self, key_id: str) -> float:
        """What an rlens before budget periods kept as the key's spending (``spent:<key id>``; 0 when none)."""
        return float(await self.redis.get(self._k("spent", key_id)) or 0.0)

    async def forget_legacy_spending(self, key_id: str) -> None:
        await self.redis.delete(self._k("spent", key_id))

    async def release(self, key_id: str, query_id: str) -> None:
        """Give back a hold whose query was never published."""
        await self.redis.hdel(self._k("hold", f"{{{key_id}}}"), query_id)

    async def settle(self, charges: list[tuple[str, str, str, float]]) -> None:
        """Each answer's (key id, budget period, query id, cost): its hold released and its cost spent, in one round
        trip (a key without a budget: its spending counted in ``total``)."""
        calls = []
        for key_id, period, query_id, cost in charges:
            period = period or "total"
            calls.append((self._budget_keys(key_id, period)[:2], [query_id, cost, PERIOD_TTL_S[period]]))
        await run_scripts(self.redis, self._settle, calls)

    async def spent(self, key_id: str, period: str = "total") -> float:
        """What the key spent in the budget period now."""
        return float(await self.redis.get(self._budget_keys(key_id, period)[0]) or 0.0)

    async def store_answers(self, answers: list[Answer]) -> list[bool]:
        """Keep each query's first answer, in one round trip; False where one was kept already (an at-least-once
        duplicate)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for answer in answers:
                pipe.set(self._k("a", answer.query_id), answer.model_dump_json(), nx=True, ex=self.ttl_s)
            return [bool(stored) for stored in await pipe.execute()]

    async def answer(self, query_id: str) -> Answer | None:
        raw = await self.redis.get(self._k("a", query_id))
        return Answer.model_validate_json(raw) if raw else None

    async def claim_feedback(self, query_id: str) -> bool:
        """True if this is the query's first feedback (claimed now), False if it has feedback already."""
        return bool(await self.redis.set(self._k("fb", query_id), 1, nx=True, ex=self.ttl_s))

    async def release_feedback(self, query_id: str) -> None:
        """Undo a claim whose feedback could not be published, so the client's retry can give it again."""
        await self.redis.delete(self._k("fb", query_id))

    async def take_token(self, key_id: str, rate_per_s: float, burst: int) -> float:
        """0.0 if the key may make a request now, else the seconds until it may."""
        return float(await self._take(keys=[self._k("rate", key_id)], args=[rate_per_s, burst]))


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:32]
