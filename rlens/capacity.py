"""The capacity model: from a load (queries a second, streams, the pool, feedback) to the workers, partitions, learner
shards, gateways, Redis memory and operations and Kafka bytes a deployment needs, from unit costs measured here
(docs/capacity.md says where each comes from). Pure: ``rlens capacity`` prints it."""

from __future__ import annotations

import math

from pydantic import BaseModel, Field, model_validator

DAY_S = 86_400


class UnitCosts(BaseModel):
    """What one unit of each part handles, and the bytes each record and Redis row takes (BENCHMARKS.md,
    docs/capacity.md: `bench.service.worker_core`, `bench.service.learner_shards`, `bench.gateway.gateway`,
    `bench.service.message_sizes`)."""

    worker_queries_per_s: float = 4_600  # a worker's own code on one core, models that answer at once
    shard_joins_per_s: float = 330  # a learner shard with each experience's behaviour (calibrations, the OPE log)
    trainer_per_s: float = 1_160  # the trainer's transitions a second at 5 % explored
    gateway_requests_per_s: float = 600  # one gateway, the whole stack on two shared cores
    query_bytes: int = 212  # each record of `queries` (key, value, headers)
    answer_bytes: int = 986  # `answers`, and again on the asking gateway's reply topic
    experience_bytes: int = 2_566
    feedback_bytes: int = 181
    marker_bytes: int = 160  # a query's once-only marker and its owner mark in Redis
    redis_round_trips_per_query: float = 4  # window read, pool save, the gateway's rate bucket and hold
    redis_round_trips_per_feedback: float = 1  # one script


class Load(BaseModel):
    """The load and the deployment's settings the model reads."""

    queries_per_s: float = Field(gt=0)
    streams: int = Field(ge=1, description="stream keys active within the window TTL")
    models: int = Field(ge=1, description="M, the pool's models")
    called: float = Field(gt=0, description="K, models called per query on average")
    latency_s: float = Field(ge=0, description="L, a model call's latency at the model servers")
    feedback: float = Field(ge=0, le=1, description="F, the share of queries that get feedback")
    choices: int = Field(ge=2, description="C, choices per question")
    feedback_days: float = Field(ge=0, description="how long feedback has been flowing (a stream's joint rows grow)")
    retention_days: float = Field(ge=0, description="Kafka's retention")
    window: int = Field(ge=1, description="W, outcomes kept per stream")
    calibration_rows: int = Field(ge=0, description="R, each model's calibration rows per stream")
    joint_rows: int = Field(ge=0, description="J, a stream's whole queries kept for the joint fits")
    model_concurrency: int = Field(ge=1, description="a worker's calls in flight per model")
    dedup_ttl_s: float = Field(ge=0, description="how long a query's marker lives")
    replication: int = Field(ge=1, description="the topics' replication factor")

    @model_validator(mode="after")
    def _called_from_the_pool(self) -> Load:
        if self.called > self.models:
            raise ValueError(f"called {self.called:g} is more than the pool's {self.models} models")
        return self


class RedisPerStream(BaseModel):
    """A stream's Redis bytes, part by part."""

    window: float
    calibration_rows: float
    fits: float
    joint_rows: float

    @property
    def total(self) -> float:
        return self.window + self.calibration_rows + self.fits + self.joint_rows


class Capacity(BaseModel):
    """What the load needs (a spare worker and a spare gateway counted in)."""

    workers: int
    partitions: int
    learner_shards: int
    trainer_keeps_up: bool
    gateways: int
    kafka_produced_bytes_per_s: float
    kafka_written_bytes_per_s: float  # times the replication
    kafka_retained_bytes: float
    redis_per_stream: RedisPerStream
    redis_streams_bytes: float
    redis_markers_bytes: float
    redis_operations_per_s: float


def plan(load: Load, costs: UnitCosts = UnitCosts()) -> Capacity:
    """The deployment ``load`` needs under ``costs``."""
    q, m, c = load.queries_per_s, load.models, load.choices
    workers = max(math.ceil(q * load.latency_s / load.model_concurrency), math.ceil(q / costs.worker_queries_per_s))
    workers += 1  # one to lose
    joins = q * load.feedback
    shards = max(1, math.ceil(joins / costs.shard_joins_per_s))
    partitions = max(8 * math.ceil(1.2 * workers / 8), shards)  # the peak worker count with room, in eights
    labelled = joins * DAY_S * load.feedback_days / load.streams  # a stream's labelled queries so far
    per_stream = RedisPerStream(
        window=load.window * (12 + 3 * m),
        calibration_rows=m * load.calibration_rows * (8 + 10 * c),
        fits=12 * m * c * (c + 1),
        joint_rows=min(labelled, load.joint_rows) * (20 + load.called * (6 + 10 * c)),
    )
    record_bytes = (
        costs.query_bytes + 2 * costs.answer_bytes + costs.experience_bytes + load.feedback * costs.feedback_bytes
    )
    produced = q * record_bytes
    return Capacity(
        workers=workers,
        partitions=partitions,
        learner_shards=shards,
        trainer_keeps_up=joins <= costs.trainer_per_s,
        gateways=math.ceil(q / costs.gateway_requests_per_s) + 1,
        kafka_produced_bytes_per_s=produced,
        kafka_written_bytes_per_s=produced * load.replication,
        kafka_retained_bytes=produced * load.replication * DAY_S * load.retention_days,
        redis_per_stream=per_stream,
        redis_streams_bytes=per_stream.total * load.streams,
        redis_markers_bytes=q * load.dedup_ttl_s * costs.marker_bytes,
        redis_operations_per_s=q * costs.redis_round_trips_per_query + joins * costs.redis_round_trips_per_feedback,
    )
