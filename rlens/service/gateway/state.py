"""What the gateway keeps in Redis, shared by its replicas: queries asked, answers, idempotency keys, feedback
given and the per-key rate buckets. Every key expires (``RLENS_GATEWAY_ANSWER_TTL_S``), so memory stays bounded.

Keys (under ``<prefix>:gw:``): ``q:<id>`` the query's owner and shape (a hash), ``a:<id>`` its first answer (JSON;
later duplicates of an at-least-once answer never replace it), ``idem:<tenant>:<sha256>`` the query id of an
``Idempotency-Key``, ``fb:<id>`` that the query has feedback, ``rate:<key id>`` a token bucket.
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel
from redis.asyncio import Redis

from rlens.messages import Answer

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


class QueryRecord(BaseModel):
    """Who asked a query and what it was: enough to check its feedback and to answer only its tenant."""

    tenant: str
    stream: str
    model: str  # the API model named (its strategy is openai_api.MODELS[model])
    chat: bool
    n_choices: int = 0  # 0: open-ended
    published: bool = False
    key_id: str = ""  # the API key that asked it (its answer's cost is charged to it)


class GatewayState:
    def __init__(self, redis: Redis, prefix: str, ttl_s: int):
        self.redis, self.ttl_s = redis, ttl_s
        self.prefix = f"{prefix}:gw"
        self._take = redis.register_script(TAKE_TOKEN)

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

    async def spend(self, charges: list[tuple[str, float]]) -> None:
        """Add each answer's cost to its key's spending (kept for as long as the key lives), in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key_id, cost in charges:
                pipe.incrbyfloat(self._k("spent", key_id), cost)
            await pipe.execute()

    async def spent(self, key_id: str) -> float:
        return float(await self.redis.get(self._k("spent", key_id)) or 0.0)

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
