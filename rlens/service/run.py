"""Building the service's parts from the settings, and running each process: the worker, the learner, the gateway."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import os
from pathlib import Path

import numpy as np
import torch

from rlens.redis_clients import async_redis, sync_redis
from rlens.focal.budget import lowest_spending
from rlens.focal.engine import FocalEngine
from rlens.checkpoint import CheckpointStore
from rlens.drift import DriftConfig, DriftMonitor
from rlens.models.pool import PoolConfig, Price, build_backend, build_rlae_decoder, load_pool_config, parse_pool_config
from rlens.rlae.agent import make_policy
from rlens.service.learner.core import LearnerCore
from rlens.service.learner.app import create_learner_app
from rlens.service.learner.lease import claim_group
from rlens.service.common.kafka import settle_idempotence, shard_topics
from rlens.ports import free_port
from rlens.service.common.logs import setup_logging
from rlens.service.common.tracing import model_span_attributes, setup_tracing
from rlens.service.learner.gate import Gate, GateConfig, default_events
from rlens.service.learner.ope_log import OPE_LOG, OpeLog
from rlens.service.learner.online import FocalOnlineTrainer, OnlineTrainer, RLAEOnlineTrainer
from rlens.service.common.health import admin_token
from rlens.service.common.security import check_exposure, feedback_tokens, policy_signer, policy_verifier
from rlens.service.common.windows import RedisWindows
from rlens.service.worker.base import Worker
from rlens.service.worker.core import FocalWorker
from rlens.service.worker.app import create_worker_app
from rlens.service.worker.cache import CachedBackend, OutputCache, recorded_answers
from rlens.config_file import config_path
from rlens.settings import Settings

log = logging.getLogger("rlens.service")


def pool_of(settings: Settings) -> PoolConfig:
    """The pool the settings give: inline (the configuration file's [[pool.models]]), or a pool file."""
    if settings.pool.models is not None:
        return parse_pool_config(
            {"models": settings.pool.models},
            f"[[pool.models]] in {config_path()}" if config_path() else "RLENS_POOL_MODELS",
        )
    if settings.pool.file is None:
        raise ValueError("no pool: set RLENS_POOL_FILE (or pass --pool), or [[pool.models]] in the configuration file")
    return load_pool_config(settings.pool.file)


def build_engine(settings: Settings, pool: PoolConfig) -> FocalEngine:
    engine = _engine(settings, pool)
    floor = lowest_spending(engine.cost_share, engine.cfg.probe_rate)
    budgets = [("RLENS_FOCAL_BUDGET", engine.cfg.budget)] + [
        (f"the budget of stream {stream!r}", budget) for stream, budget in engine.cfg.stream_budgets
    ]
    for name, budget in budgets:
        if budget is not None and budget < floor:
            log.warning(
                "%s %.3f is below the least this pool can spend (%.3f: its cheapest model alone, and the probes): "
                "the workers will spend about %.3f",
                name,
                budget,
                floor,
                floor,
            )
    return engine


def _engine(settings: Settings, pool: PoolConfig) -> FocalEngine:
    return FocalEngine(
        len(pool.models),
        np.array([m.cost for m in pool.models]),
        settings.focal_config(),
        seed=settings.service.seed,
    )


def build_windows(
    settings: Settings, n_models: int, size: int, calibration_rows: int = 0, joint_rows: int = 0
) -> RedisWindows:
    redis = async_redis(
        settings.redis.url.get_secret_value(), socket_timeout=5, socket_connect_timeout=2, health_check_interval=10
    )
    return RedisWindows(
        redis,
        n_models,
        size,
        settings.redis.prefix,
        settings.redis.window_ttl_s,
        settings.redis.dedup_ttl_s,
        calibration_rows,
        joint_rows,
    )


def rlae_policy(settings: Settings, n_models: int):
    """The RLAE policy every worker and the learner start from (the same weights, from the seed)."""
    from rlens.rlae.observe import obs_dim

    return make_policy(obs_dim(n_models), n_models, settings.rlae_config(), settings.service.seed)


def gated_without_evidence(settings: Settings) -> None:
    """rl_focal's gate judges candidates on the evidence the workers log: a clear error where they would log none."""
    if (
        settings.learner.promotion != "direct"
        and settings.service.strategy == "rl_focal"
        and not settings.worker.ope_logging
    ):
        raise ValueError(
            f"RLENS_PROMOTION={settings.learner.promotion} scores each candidate on the evidence rl_focal workers log with "
            "each query: RLENS_OPE_LOGGING must stay true (or promote directly)"
        )


def calibration_conflicts(settings: Settings) -> None:
    """rl_focal's calibrations are fitted on the called models' distributions the workers log: a clear error where
    they would log none."""
    if settings.service.strategy == "rl_focal" and settings.focal.calibration_rows and not settings.worker.ope_logging:
        raise ValueError(
            "RLENS_FOCAL_CALIBRATION_ROWS fits each model's calibration on the distributions rl_focal workers log "
            "with each query: RLENS_OPE_LOGGING must stay true (or set RLENS_FOCAL_CALIBRATION_ROWS=0)"
        )


def build_worker(settings: Settings) -> Worker:
    """The worker of ``settings.strategy``."""
    gated_without_evidence(settings)
    calibration_conflicts(settings)
    pool = pool_of(settings)
    names = [m.name for m in pool.models]
    verifier, tokens = policy_verifier(settings), feedback_tokens(settings)
    if settings.service.strategy == "rlae":
        from rlens.rlae.observe import SentenceEncoder
        from rlens.rlae.train import RLAEAgent
        from rlens.service.worker.rlae import RLAEWorker

        agent = RLAEAgent(
            rlae_policy(settings, len(names)).eval(), SentenceEncoder(), settings.rlae_config(), len(names)
        )
        windows = build_windows(settings, len(names), 1)  # only its readiness mark: rlae keeps no outcome windows
        return RLAEWorker(
            build_rlae_decoder(pool, settings.rlae.top_k),
            agent,
            names,
            windows,
            stop=settings.rlae.stop,
            explore=settings.rlae.explore,
            seed=settings.service.seed,
            verifier=verifier,
            tokens=tokens,
            costs=[m.cost for m in pool.models],
            split=settings.learner.gate_split,
            prices=prices_of(pool),
        )
    engine = build_engine(settings, pool)
    cache = output_cache(settings, pool)
    backends = {m.name: build_backend(m) for m in pool.models}
    if cache is not None:  # a replay backend is a recording already
        backends = {n: b if b.name == "replay" else CachedBackend(b, n, cache) for n, b in backends.items()}
    return FocalWorker(
        engine,
        names,
        backends,
        build_windows(settings, len(names), engine.cfg.window, engine.cfg.calibration_rows),
        deadline_s=settings.worker.deadline_s,
        model_concurrency=settings.worker.model_concurrency,
        circuit_failures=settings.worker.circuit_failures,
        circuit_cooldown_s=settings.worker.circuit_cooldown_s,
        sampling=settings.focal.sampling(),
        extractor=settings.focal.extractor,
        verifier=verifier,
        tokens=tokens,
        ope_logging=settings.worker.ope_logging,
        cache=cache,
        prices=prices_of(pool),
    )


def prices_of(pool: PoolConfig) -> dict[str, Price]:
    return {m.name: m.price for m in pool.models if m.price is not None}


def output_cache(settings: Settings, pool: PoolConfig) -> OutputCache | None:
    """The workers' model-output cache: the pool's recorded answers, and Redis unless RLENS_CACHE_TTL_S is 0; None
    when it has neither. Its Redis client is a blocking one: the backends run in threads."""
    recorded = recorded_answers(pool.recorded, [m.name for m in pool.models]) if pool.recorded else {}
    if not recorded and settings.cache.ttl_s == 0:
        return None
    redis = None
    if settings.cache.ttl_s:
        redis = sync_redis(
            settings.redis.url.get_secret_value(), socket_timeout=2, socket_connect_timeout=1, health_check_interval=10
        )
    return OutputCache(recorded, redis, settings.redis.prefix, settings.cache.ttl_s)


def drift_monitor(settings: Settings) -> DriftMonitor | None:
    if settings.drift.detector == "off":
        return None
    return DriftMonitor(DriftConfig(**settings.drift.config_fields(DriftConfig)))


def build_learner(settings: Settings, warm_start: Path | None = None) -> LearnerCore:
    """The learner of ``settings.strategy``, resumed from its newest checkpoint; a fresh one warm-started from
    ``warm_start`` if given (rl_focal: a recorded dataset; rlae: an `rlens rlae train` run directory)."""
    gated_without_evidence(settings)
    calibration_conflicts(settings)
    pool = pool_of(settings)
    names = [m.name for m in pool.models]
    signer, tokens = policy_signer(settings), feedback_tokens(settings)
    trainer: OnlineTrainer
    gate = None
    min_events, max_events, every = default_events(settings.service.strategy, settings.learner.promotion)
    config = GateConfig(
        settings.learner.gate_min_events or min_events,
        settings.learner.gate_max_events or max_events,
        every=min(every, settings.learner.gate_min_events or min_events),
        delta=settings.learner.gate_delta,
        drift_reset=settings.learner.gate_drift_reset,
        split=settings.learner.gate_split,
        holdback=settings.learner.gate_holdback if settings.learner.promotion == "holdback" else None,
        shadow_calls=settings.learner.gate_shadow_calls,
    )
    if settings.service.strategy == "rlae":
        trainer = RLAEOnlineTrainer(
            rlae_policy(settings, len(names)),
            settings.rlae_config(),
            names,
            settings.service.seed,
            settings.rlae.rehearsal,
        )
        window = 1
        if (
            settings.learner.promotion != "direct"
        ):  # an A/B split: the workers draw the share each candidate's policy names
            gate = Gate(config)
    else:
        engine = build_engine(settings, pool)
        trainer, window = FocalOnlineTrainer(engine, names, settings.focal.extractor), engine.cfg.window
        if settings.learner.promotion != "direct":  # scored in shadow
            gate = Gate(config, engine.cost_share, engine.cfg.alpha)
    calibration_rows = settings.focal.calibration_rows if settings.service.strategy == "rl_focal" else 0
    joint_rows = settings.focal.joint_rows if settings.service.strategy == "rl_focal" else 0
    role = settings.learner.role
    core = LearnerCore(
        trainer,
        names,
        build_windows(settings, len(names), window, calibration_rows, joint_rows),
        CheckpointStore(settings.learner.checkpoint_dir),
        signer,
        tokens,
        pending_limit=settings.learner.pending_limit,
        pending_ttl_s=settings.learner.pending_ttl_s,
        pending_bytes=settings.learner.pending_bytes,
        pending_per_stream=settings.learner.pending_per_stream,
        refit_interval_s=settings.learner.refit_interval_s,
        checkpoint_every_s=settings.learner.checkpoint_every_s,
        drift=drift_monitor(settings),
        drift_keep=settings.drift.keep if settings.drift.reaction == "trim" else None,
        ope_log=OpeLog(settings.learner.checkpoint_dir / OPE_LOG, settings.learner.ope_log_bytes)
        if settings.learner.ope_log_bytes and role != "trainer"  # the joins' log: where they are made
        else None,
        gate=gate if role != "shard" else None,  # the gate is the trainer's
        role=role,
        shard=settings.learner.shard,
    )
    if warm_start is not None and role != "shard":
        core.warm_start(warm_start)
    return core


def with_metrics_port(settings: Settings) -> Settings:
    """The settings with a concrete port for the process's HTTP side (a free one for port 0)."""
    return settings if settings.metrics.port else settings.updated({"metrics_port": free_port()})


def freeze_startup_objects() -> None:
    """Move what the start made (the imported modules: torch, transformers, pydantic; the engine and the pool) out
    of the garbage collector's sight (``gc.freeze``): otherwise every full collection scans those millions of
    objects, a 250-300 ms pause every 10-15 s during which no query is answered (BENCHMARKS.md)."""
    gc.collect()
    gc.freeze()


def uses_uvloop(settings: Settings) -> bool:
    """Whether the process runs on uvloop (``settings.service.event_loop``; auto: where it is installed)."""
    installed = importlib.util.find_spec("uvloop") is not None
    if settings.service.event_loop == "uvloop" and not installed:
        raise ValueError("RLENS_EVENT_LOOP=uvloop, but uvloop is not installed (pip install uvloop, or unset it)")
    return settings.service.event_loop != "asyncio" and installed


def run_app(app, settings: Settings, role: str) -> None:
    """Run a worker's or learner's app: its subscribers and, on ``settings.metrics_host:metrics_port``, its HTTP side."""
    setup_tracing(settings, role)
    import uvicorn

    from rlens.service.common.http_server import QuietServer

    # FastStream's app, served as ``app.run`` would, on a server that idles quietly; uvicorn's records go through
    # the process's one handler
    config = uvicorn.Config(
        app, host=settings.metrics.host, port=settings.metrics.port, log_level=logging.WARNING, log_config=None
    )
    factory = None
    if uses_uvloop(settings):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(QuietServer(config).serve())


def run_worker(settings: Settings) -> None:
    setup_logging(
        "worker", settings.service.strategy, settings.service.log_format
    )  # first: what the start does is logged too
    check_exposure(settings.metrics.host, admin_token(settings), "RLENS_METRICS_HOST")
    torch.set_num_threads(settings.service.torch_threads)
    settings = with_metrics_port(settings)
    worker = build_worker(settings)  # a configuration error first, then the broker
    settings = asyncio.run(settle_idempotence(settings))
    app = create_worker_app(settings, worker, model_span_attributes(pool_of(settings)))
    freeze_startup_objects()
    run_app(app, settings, "worker")


def run_learner(settings: Settings, warm_start: Path | None = None) -> None:
    setup_logging(
        "learner", settings.service.strategy, settings.service.log_format
    )  # first: what the start does is logged too
    check_exposure(settings.metrics.host, admin_token(settings), "RLENS_METRICS_HOST")
    # the learner's MAPPO update: 2.4x faster on one thread on a busy machine (BENCHMARKS.md)
    torch.set_num_threads(settings.service.torch_threads)
    if settings.learner.nice:  # on cores it shares with workers and a gateway, their requests go first
        os.nice(settings.learner.nice)
    settings = with_metrics_port(settings)
    core = build_learner(settings, warm_start)  # a configuration error first, then the broker
    settings = asyncio.run(settle_idempotence(settings))
    asyncio.run(claim_group(settings, core))  # before the app starts: a refused learner never joins the group
    partitions = asyncio.run(shard_topics(settings)) if settings.learner.role == "shard" else 0
    app = create_learner_app(settings, core, partitions)
    freeze_startup_objects()
    run_app(app, settings, "learner")


def run_gateway(settings: Settings) -> None:
    from rlens.service.common.http_server import serve
    from rlens.service.gateway.app import create_gateway_app
    from rlens.service.gateway.connections import guarded_protocol

    setup_logging("gateway", settings.service.strategy, settings.service.log_format)
    check_exposure(settings.gateway.host, admin_token(settings), "RLENS_GATEWAY_HOST")
    settings = asyncio.run(settle_idempotence(settings))
    if not settings.gateway.port:
        settings = settings.updated({"gateway_port": free_port()})
    setup_tracing(settings, "gateway")
    app = create_gateway_app(settings)
    freeze_startup_objects()
    serve(
        app,
        host=settings.gateway.host,
        port=settings.gateway.port,
        log_level="warning",
        log_config=None,  # its records go through the process's one handler
        limit_concurrency=settings.gateway.max_connections,
        timeout_keep_alive=max(1, round(settings.gateway.idle_timeout_s)),
        loop="uvloop" if uses_uvloop(settings) else "asyncio",
        http=guarded_protocol(settings.gateway.header_timeout_s, settings.gateway.max_connections_per_address),
    )
