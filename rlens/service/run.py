"""Building the service's parts from the settings, and running the worker and the learner as processes."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from redis.asyncio import Redis

from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.pool import PoolConfig, build_backend, load_pool_config
from rlens.checkpoint import CheckpointStore
from rlens.service.learner import LearnerCore, create_learner_app
from rlens.service.windows import RedisWindows
from rlens.service.worker import WorkerCore, create_worker_app
from rlens.settings import Settings


def pool_of(settings: Settings) -> PoolConfig:
    if settings.pool_file is None:
        raise ValueError("no pool file: set RLENS_POOL_FILE (or pass --pool)")
    return load_pool_config(settings.pool_file)


def build_engine(settings: Settings, pool: PoolConfig, config: FocalConfig | None = None) -> FocalEngine:
    return FocalEngine(len(pool.models), [m.cost for m in pool.models], config or FocalConfig(), seed=settings.seed)


def build_windows(settings: Settings, n_models: int, size: int) -> RedisWindows:
    redis = Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=10)
    return RedisWindows(redis, n_models, size, settings.redis_prefix, settings.window_ttl_s, settings.dedup_ttl_s)


def build_worker(settings: Settings) -> WorkerCore:
    pool = pool_of(settings)
    engine = build_engine(settings, pool)
    backends = {m.name: build_backend(m) for m in pool.models}
    return WorkerCore(engine, [m.name for m in pool.models], backends, build_windows(settings, len(pool.models), engine.cfg.window), settings.worker_deadline_s)


def build_learner(settings: Settings, warm_start: Path | None = None) -> LearnerCore:
    """The learner, resumed from its newest checkpoint; a fresh one warm-started from ``warm_start`` if given."""
    pool = pool_of(settings)
    engine = build_engine(settings, pool)
    core = LearnerCore(
        engine, [m.name for m in pool.models], build_windows(settings, len(pool.models), engine.cfg.window),
        CheckpointStore(settings.checkpoint_dir), settings.pending_limit, settings.pending_ttl_s,
    )
    if warm_start is not None and core.version == 0:
        from rlens.dataset import load_dataset
        from rlens.focal.schedule import warm_start as run_warm_start

        data = load_dataset(warm_start)
        if data.model_names != core.models:
            raise ValueError(f"warm-start dataset models {data.model_names} are not the pool's {core.models}")
        run_warm_start(engine, data)
        engine.reset_windows()
        core.version = 1
        core.checkpoint()
    return core


def run_app(app) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(app.run(log_level=logging.WARNING))


def run_worker(settings: Settings) -> None:
    run_app(create_worker_app(settings, build_worker(settings)))


def run_learner(settings: Settings, warm_start: Path | None = None) -> None:
    run_app(create_learner_app(settings, build_learner(settings, warm_start)))
