"""One learner per consumer group: a lease in Redis, taken before the learner's app starts and renewed while it runs."""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from rlens.redis_clients import async_redis
from rlens.service.common.windows import LEASE_TTL_S, RedisWindows
from rlens.service.learner.core import LearnerCore
from rlens.settings import Settings

log = logging.getLogger("rlens.learner")


def lease_holder(core: LearnerCore) -> str:
    """How a learner names itself in its group's lease: process | checkpoint directory."""
    return f"{core.name}|{core.checkpoints.directory.resolve()}"


async def claim_group(settings: Settings, core: LearnerCore) -> None:
    """One learner per consumer group: take the group's lease in Redis, or RuntimeError naming who holds it. A holder
    on our checkpoint directory is gone (we hold that directory's lock): a restart after a crash takes over."""
    windows = RedisWindows(
        async_redis(settings.redis.url.get_secret_value(), socket_connect_timeout=2),
        core.windows.n_models,
        1,
        settings.redis.prefix,
    )
    me = lease_holder(core)
    try:
        holder = await windows.lease(settings.group("learner"), me)
        if holder is not None and holder.split("|", 1)[-1] == me.split("|", 1)[-1]:
            holder = await windows.lease(settings.group("learner"), me, take_over=True)
    except (RedisError, OSError) as exc:
        log.warning(
            "Redis unreachable (%s): cannot check that no other learner runs in group %s",
            exc,
            settings.group("learner"),
        )
        holder = None
    finally:
        await windows.redis.aclose()
    if holder is not None:
        raise RuntimeError(
            f"learner {holder.split('|')[0]} holds consumer group {settings.group('learner')!r}: one learner per group (stop it, or wait {LEASE_TTL_S} s after it died)"
        )


async def keep_lease(settings: Settings, core: LearnerCore) -> None:
    """Renew the group's lease every LEASE_TTL_S / 3 s; say so if another learner took it."""
    group, me = settings.group("learner"), lease_holder(core)
    while True:
        await asyncio.sleep(LEASE_TTL_S / 3)
        try:
            if holder := await core.windows.lease(group, me):
                log.error("learner %s took consumer group %s", holder, group)
        except (RedisError, OSError) as exc:
            log.warning("Redis unreachable (%s): lease of group %s not renewed", exc, group)
