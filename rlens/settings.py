"""All of rlens's configuration in one pydantic-settings object of groups: ``settings.kafka.bootstrap``. A group is
a ``[group]`` of the configuration file (:mod:`rlens.config_file`) and the prefix of its variables
(``RLENS_KAFKA_BOOTSTRAP``); a group's ``SHORT`` keys are also read from ``RLENS_<KEY>`` alone (``RLENS_TOPIC_PREFIX``,
the names of earlier releases). ``RLENS_*`` variables override the file that ``RLENS_CONFIG`` names, which overrides
the defaults. To add a setting, add a field to its group."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from rlens.focal.config import FocalConfig

if TYPE_CHECKING:
    from rlens.backends.base import GenerationRequest
    from rlens.rlae.agent import RLAEConfig

PACKAGE_DATA = Path(__file__).parent / "data"
GATED_PROBE_RATE = 0.2  # rl_focal's probes under gated or holdback promotion, unless set: the evidence (BENCHMARKS.md)


class Group(BaseModel):
    """One group of settings: the file's ``[group]``, the variables ``RLENS_<GROUP>_<KEY>``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    SHORT: ClassVar[frozenset[str]] = frozenset()  # keys whose variable is also RLENS_<KEY> (earlier releases' names)

    def config_fields(self, config: type) -> dict[str, Any]:
        """This group's values of the fields that the algorithm's config dataclass ``config`` has too."""
        names = {f for f in getattr(config, "__dataclass_fields__")}
        return {key: value for key, value in self if key in names}


class ServiceSettings(Group):
    """What every process is and how it logs and traces."""

    SHORT = frozenset(
        {
            "strategy",
            "log_format",
            "otel_endpoint",
            "trace_dir",
            "seed",
            "torch_threads",
            "event_loop",
            "shared_data",
            "zoo_dir",
            "demo_data",
        }
    )

    strategy: Literal["rl_focal", "rlae"] = Field(
        "rl_focal",
        description="rl_focal: Decider + Fusion (multiple-choice queries, and open-ended ones over the models' sampled answers); rlae: open-ended queries (span-weighted token ensemble)",
    )
    log_format: Literal["auto", "json", "text"] = Field(
        "auto",
        description="the service processes' log records: JSON lines, or text lines; auto: text on a terminal, JSON "
        "otherwise (a container, a log file)",
    )
    otel_endpoint: str | None = Field(
        None,
        description="OpenTelemetry traces to this OTLP/HTTP endpoint (e.g. http://collector:4318/v1/traces; the "
        "`otel` extra); the SDK's own OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_* variables work too; none of them: no traces",
    )
    trace_dir: Path | None = Field(
        None, description="each process's spans as JSON lines in <dir>/<role>-<pid>.jsonl (tests, a quick look)"
    )
    seed: int = Field(0, description="seed of the engines' initial weights and of their sampling")
    torch_threads: int = Field(
        1,
        ge=1,
        description="torch threads of a worker or learner process: one is fastest for the agents' tiny networks on a busy machine (raise it for in-process LLMs on an idle one)",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="the service processes' event loop: uvloop (less CPU a request, BENCHMARKS.md) or Python's own; "
        "auto: uvloop where it is installed (Linux, macOS)",
    )
    shared_data: Path = Field(Path("../shared/datasets"), description="where the shared recorded datasets live")
    zoo_dir: Path = Field(
        Path.home() / ".cache" / "rlens" / "zoo", description="where `rlens zoo build` puts the model zoo"
    )
    demo_data: Path = Field(PACKAGE_DATA / "zoo_mc", description="the bundled dataset that `rlens demo` replays")


class PoolSettings(Group):
    """The pool of models: a pool file, or the models themselves (the file's ``[[pool.models]]``)."""

    file: Path | None = Field(None, description="the pool file of the worker and the learner (see rlens.models.pool)")
    models: list[dict] | None = Field(
        None,
        description="the pool's models as in a pool file's \"models\" (the configuration file's [[pool.models]]; "
        "RLENS_POOL_MODELS: a JSON list); used before the pool file",
    )


class KafkaSettings(Group):
    """The Kafka cluster, the topics and the consumers' timings."""

    SHORT = frozenset({"topic_prefix"})

    bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers (comma-separated host:port)")
    security_protocol: str = Field("PLAINTEXT", description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")
    sasl_mechanism: str | None = Field(None, description="PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = Field(None, description="CA bundle for SSL / SASL_SSL")
    acks: Literal["all", "1"] = Field(
        "all", description="producer acknowledgements: all (every in-sync replica; the default) or 1 (the leader only)"
    )
    idempotence: bool | Literal["auto"] = Field(
        "auto",
        description="idempotent producers (no duplicates from producer retries): auto (wherever the broker offers them: Apache Kafka does, tansu does not; the default), true (refuse to start on a broker without them) or false",
    )
    replication: int = Field(
        1,
        ge=1,
        description="replication factor of the topics the service creates (3 on a real cluster, with min.insync.replicas=2)",
    )
    topic_prefix: str = Field(
        "rlens.",
        description="topic names are this prefix + queries, answers, feedback, experience, policy, dead-letter",
    )
    partitions: int = Field(
        4,
        ge=1,
        description="partitions of the per-query topics the service creates (queries, answers, feedback, experience, dead letters)",
    )
    session_timeout_ms: int = Field(10_000, ge=1000, description="consumer-group session timeout")
    heartbeat_ms: int = Field(3_000, ge=100, description="consumer-group heartbeat interval")
    embedded: Literal["auto", "kafka", "tansu"] = Field(
        "auto",
        description="the broker `rlens up` starts when no bootstrap is set: kafka (Apache Kafka 4.1.1, its data in the work folder; Java 17+, its jars fetched from Maven Central once), tansu (the `local` extra's, memory only: its latency grows under load), auto (kafka where Java and its jars are here, else tansu)",
    )
    fetch_max_wait_ms: int = Field(
        500,
        ge=0,
        description="how long a fetch on the request path (the workers' queries, the gateway's replies) waits for "
        "data when there is none (Kafka answers as soon as data comes, so the wait sets only how often an idle "
        "consumer asks: `rlens up`'s own Apache Kafka uses 5000; its embedded tansu, which often waits it out, 20)",
    )
    background_fetch_max_wait_ms: int = Field(
        500,
        ge=0,
        description="the same for the consumers off the request path (the learner's; every process's policy "
        "reader waits the longer of the two), which need no record within milliseconds; on tansu a record waits up "
        "to this long for them, and every idle consumer fetches 1000 / this many times a second (`rlens up` on "
        "tansu uses 250)",
    )

    @field_validator("bootstrap")
    @classmethod
    def _host_ports(cls, bootstrap: str) -> str:
        for server in bootstrap.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"{server.strip()!r} is not host:port (e.g. 127.0.0.1:9092; several: a comma between)")
        return bootstrap


class RedisSettings(Group):
    """The Redis of the sliding windows, budgets, rate limits, marks and leases."""

    SHORT = frozenset({"window_ttl_s", "dedup_ttl_s"})

    url: SecretStr = Field(
        SecretStr("redis://127.0.0.1:6379/0"),
        description="Redis for the sliding windows, budgets, rate limits, marks and leases: redis://user:password@host:port/db "
        "(rediss:// TLS), redis+sentinel://[:password@]host:port,host:port/<service>[/db] (the master the Sentinels "
        "name), or redis+cluster://[:password@]host:port,host:port (a Redis Cluster)",
    )
    prefix: str = Field("rlens", description="prefix of every Redis key")
    window_ttl_s: int = Field(7 * 86400, ge=1, description="a stream's window expires after this long without feedback")
    dedup_ttl_s: int = Field(
        86400, ge=1, description="how long a query's applied outcome is remembered (duplicate feedback)"
    )

    @field_validator("url")
    @classmethod
    def _redis_scheme(cls, url: SecretStr) -> SecretStr:
        from rlens.redis_clients import parse_redis_url

        try:
            parse_redis_url(url.get_secret_value())
        except ValueError as exc:  # the message names the scheme or the part that is wrong, never the password
            raise ValueError(
                f"{exc}; e.g. redis://host:port/db (rediss:// TLS, unix://path), "
                "redis+sentinel://host:port,host:port/<service>, redis+cluster://host:port,host:port"
            ) from None
        return url


class SecuritySettings(Group):
    """The service's secrets (see rlens.service.common.security; ``rlens secrets`` generates them)."""

    SHORT = frozenset({"feedback_secret", "policy_signing_key", "policy_verify_key", "admin_token"})

    feedback_secret: SecretStr | None = Field(
        None, description="workers, learner, gateway: the HMAC key of the answers' feedback tokens"
    )
    policy_signing_key: SecretStr | None = Field(
        None, description="learner only: Ed25519 private key (base64) that signs policies"
    )
    policy_verify_key: str | None = Field(
        None, description="workers: the learner's Ed25519 public key (base64); only policies it verifies are loaded"
    )
    admin_token: SecretStr | None = Field(
        None,
        description="guards /metrics and the learner's dashboard in every process (Bearer, or Basic with it as the password); needed to bind them beyond loopback",
    )


class MetricsSettings(Group):
    """Where each worker and learner serves ``/metrics``, ``/healthz`` and ``/readyz``."""

    host: str = Field(
        "127.0.0.1",
        description="where a worker or learner serves /metrics, /healthz and /readyz (0.0.0.0 in a container)",
    )
    port: int = Field(
        0, ge=0, le=65535, description="their port; 0: a free one, announced in the process's readiness mark in Redis"
    )
    enabled: bool = Field(
        True, description="update the Prometheus metrics (false: /metrics stays empty; for measuring their cost)"
    )
    streams: int = Field(100, ge=1, description="stream keys that get their own metric labels; the rest share 'other'")


class HttpSettings(Group):
    """The ``openai`` backend's HTTP client."""

    timeout_s: float = Field(30.0, gt=0, description="openai backend: timeout of one HTTP attempt")
    retries: int = Field(2, ge=0, description="openai backend: retries after a transport error, timeout or 5xx")
    max_concurrency: int = Field(8, ge=1, description="openai backend: requests in flight per model server")


class WorkerSettings(Group):
    """The workers: batches, deadlines, circuits and the evidence they log."""

    SHORT = frozenset({"model_concurrency", "circuit_failures", "circuit_cooldown_s", "ope_logging"})

    group: str = Field(
        "", description="the workers' consumer group on the queries topic (default: <topic prefix>-workers)"
    )
    batch: int = Field(32, ge=1, description="queries the worker takes per batch")
    deadline_s: float = Field(60.0, gt=0, description="a query's models must answer within this")
    model_concurrency: int = Field(
        8,
        ge=1,
        description="threads per model: its calls run in these (a hung model holds only its own); when all are stuck past the deadline, its calls fail at once",
    )
    circuit_failures: int = Field(
        5,
        ge=1,
        description="missed deadlines in a row that open a model's circuit (its calls then fail at once; errors answered in time never do)",
    )
    circuit_cooldown_s: float = Field(
        30.0, gt=0, description="how long an open circuit refuses calls before one is let through"
    )
    ope_logging: bool = Field(
        True,
        description="rl_focal workers: each query's experience carries what off-policy evaluation needs (its behaviour: "
        "propensity, greedy pool and answer, the called models' distributions) and a candidate's action in shadow, "
        "for `rlens ope` and gated promotion (which needs it); false saves their cost: 5 % of a worker's throughput "
        "on a broker, 9 % of its CPU time and 400 bytes a query (BENCHMARKS.md)",
    )


class LearnerSettings(Group):
    """The learner: its group, checkpoints, promotion gate and pending halves."""

    SHORT = frozenset(
        {
            "checkpoint_dir",
            "checkpoint_every_s",
            "promotion",
            "gate_min_events",
            "gate_max_events",
            "gate_delta",
            "gate_split",
            "gate_holdback",
            "gate_shadow_calls",
            "gate_drift_reset",
            "policy_keep_bytes",
            "ope_log_bytes",
            "pending_limit",
            "pending_ttl_s",
            "pending_bytes",
            "pending_per_stream",
        }
    )

    group: str = Field(
        "",
        description="the learner's consumer group (default: <topic prefix>-learner); a shard's is this with "
        "-shard-<index>, the trainer's with -trainer",
    )
    role: Literal["all", "shard", "trainer"] = Field(
        "all",
        description="all, one learner does everything; shard, it joins the experience and feedback partitions p with "
        "p mod RLENS_LEARNER_SHARDS = RLENS_LEARNER_SHARD (the Redis windows, calibrations, drift, the OPE log and "
        "the metrics of those queries) and hands each joined query to the trainer on the transitions topic; "
        "trainer, it trains on the transitions (each query once), runs the gate and publishes the policies",
    )
    shards: int = Field(
        1, ge=1, le=256, description="learner shards (RLENS_LEARNER_ROLE=shard): how many processes share the joins"
    )
    shard: int = Field(0, ge=0, description="this shard's index, from 0 to RLENS_LEARNER_SHARDS - 1")
    nice: int = Field(
        0,
        ge=0,
        le=19,
        description="the learner lowers its CPU priority by this much at its start (os.nice): on cores it shares with "
        "workers and a gateway, their requests go first and its updates take what is left (BENCHMARKS.md, the p99 "
        "with the learner); 0: none, as in a pod of its own",
    )
    fetch_min_bytes: int = Field(
        1,
        ge=1,
        description="the learner's fetches of experience and feedback wait (up to RLENS_KAFKA_BACKGROUND_FETCH_MAX_WAIT_MS) "
        "until this many bytes came: fewer, larger batches, each with its fixed cost (a Redis round trip, the refit "
        "check, the broker's fetch). 1: a fetch returns as soon as any record came. At several hundred queries a "
        "second 65536 saved 10 % of the learner's CPU (BENCHMARKS.md), but every join comes up to that wait later: a "
        "gate's evidence, a closed loop and a quiet stream's window wait for it",
    )
    refit_interval_s: float = Field(
        2.0,
        ge=0,
        description="a stream's calibrations are fitted again at most this often (once 16 new rows came): a fit costs "
        "about 15 ms of CPU, which a busy stream would otherwise pay every few queries; 0: every 16 rows",
    )
    checkpoint_dir: Path = Field(Path("out/learner"), description="the learner's checkpoints")
    checkpoint_every_s: float = Field(
        5.0,
        gt=0,
        description="the learner checkpoints at most this often (and on shutdown); Kafka offsets are committed up to the newest checkpoint",
    )
    promotion: Literal["direct", "gated", "holdback"] = Field(
        "direct",
        description="direct, every update goes live; gated, an update is a candidate, scored against the champion "
        "(rl_focal: in shadow on the champion's queries; rlae: serving a random RLENS_GATE_SPLIT of the queries itself), "
        "and goes live only when its lower 95 % bound of reward against the champion is at least -RLENS_GATE_DELTA "
        "(after RLENS_GATE_MIN_EVENTS labelled queries of its own; dropped after RLENS_GATE_MAX_EVENTS); the champion "
        "it replaced is then scored the same way over RLENS_GATE_MIN_EVENTS queries and restored if it was better by "
        "more than the delta; holdback, every update serves at once (rlae: on all but RLENS_GATE_HOLDBACK of the "
        "queries, where the champion serves; rl_focal: on every query, the champion scored in shadow beside it), and "
        "the learner's updates are rolled back (and the learner reset, its next updates judged as gated until one "
        "does as well) when the champion leads them by more than the delta with confidence (looked at from "
        "RLENS_GATE_MIN_EVENTS of its queries), or become the champion when not worse",
    )
    gate_min_events: int | None = Field(
        None,
        ge=10,
        description="guarded promotion: labelled queries of evidence before a verdict (rl_focal: scored in shadow, "
        "holdback: the line's; rlae: the candidate's own, holdback: the champion's); unset, the strategy's: rl_focal "
        "400, rlae 50 gated and 25 holdback (rlens.service.learner.gate.default_events)",
    )
    gate_max_events: int | None = Field(
        None,
        ge=10,
        description="guarded promotion: a candidate not promoted by then is dropped, and a champion on probation not "
        "shown worse than the one it replaced has passed if its estimate is within RLENS_GATE_DELTA (else it is "
        "watched on, up to ten times as long) (rl_focal; an rlae candidate is judged once, after "
        "RLENS_GATE_MIN_EVENTS of its own queries); holdback: the line's evidence starts again "
        "after this many of its queries (rlae: the champion's) without a verdict; unset, the strategy's: rl_focal "
        "4,000 (1,200 holdback), rlae 50",
    )
    gate_delta: float = Field(
        0.02, ge=0, description="gated promotion: the reward a candidate may lose, at the lower bound"
    )
    gate_split: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="gated promotion, rlae: the share of the queries a candidate serves itself while it is judged (an "
        "A/B split; the champion serves the rest); the learner's setting, named in each candidate's signed policy "
        "(a worker's own is used only for a policy without one); holdback: an untrusted learner's challengers",
    )
    gate_holdback: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="holdback promotion (rlae): the share of the queries the champion keeps serving as the control "
        "(the learner's newest update serves the rest)",
    )
    gate_shadow_calls: float = Field(
        1.0,
        ge=0,
        le=1,
        description="guarded promotion, rl_focal: while a promoted policy is on probation, the share of the queries "
        "on which the workers also call the models that the champion it replaced needs and the served pool lacks, so "
        "that the two are compared exactly, query by query: a worse policy is rolled back sooner, at the price of "
        "those calls (not counted against a stream's budget; rlens_worker_shadow_calls_total; BENCHMARKS.md, the "
        "safety net); 0: none",
    )
    gate_drift_reset: bool = Field(
        False,
        description="gated promotion: a drift detection restarts the candidate's evidence (bench.robustness.gate: "
        "it did not help on the bundled stream)",
    )
    policy_keep_bytes: int = Field(
        2**30,
        ge=64 * 2**20,
        description="the policy topic keeps its newest policies up to this many bytes, made so on a real Kafka cluster "
        "(retention.bytes, no time limit): the versions `rlens policy` can set live again (an rl_focal policy takes "
        "about 0.2 MB, an RLAE-MAPPO one up to 3.3 MB)",
    )
    ope_log_bytes: int = Field(
        64 * 2**20,
        ge=0,
        description="rl_focal: the learner's log of joined queries for `rlens ope` (<checkpoint dir>/ope-log.jsonl), "
        "rotated past this many bytes (one older file kept); 0: no log",
    )
    pending_limit: int = Field(100_000, ge=1, description="experience / feedback held while waiting for the other half")
    pending_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="an unmatched experience or feedback is dead-lettered this long after its record's timestamp (event time)",
    )
    pending_bytes: int = Field(
        256 * 2**20,
        ge=2**20,
        description="bytes of unmatched experience, and of unmatched feedback, held at most (oldest dropped first)",
    )
    pending_per_stream: int = Field(
        10_000, ge=1, description="unmatched halves one stream key may hold (past that, its own oldest is dropped)"
    )

    @model_validator(mode="after")
    def _one_shard_each(self) -> "LearnerSettings":
        if self.shard >= self.shards:
            raise ValueError(
                f"RLENS_LEARNER_SHARD={self.shard} is not below RLENS_LEARNER_SHARDS={self.shards}: shards are "
                f"numbered from 0"
            )
        if self.shards > 1 and self.role != "shard":
            raise ValueError(
                f"RLENS_LEARNER_SHARDS={self.shards} with RLENS_LEARNER_ROLE={self.role}: run one process per shard "
                "with RLENS_LEARNER_ROLE=shard and RLENS_LEARNER_SHARD=<index>, and one with RLENS_LEARNER_ROLE=trainer"
            )
        if self.role != "all" and self.gate_drift_reset:
            raise ValueError(
                "RLENS_GATE_DRIFT_RESET needs RLENS_LEARNER_ROLE=all: the shards detect drift, the trainer's gate "
                "does not hear of it"
            )
        return self


class GatewaySettings(Group):
    """The OpenAI-compatible gateway (``rlens gateway``; rlens.service.gateway)."""

    host: str = Field("127.0.0.1", description="where the gateway listens (0.0.0.0 in a container)")
    port: int = Field(
        8000, ge=0, le=65535, description="its port (0: a free one, announced in its readiness mark in Redis)"
    )
    id: str = Field(
        "",
        pattern=r"^[A-Za-z0-9._-]*$",
        max_length=100,
        description="this replica's name: its reply topic is <topic_prefix>replies.<id> (stable across restarts, e.g. a StatefulSet pod name; default: the host name)",
    )
    strategies: list[Literal["rl_focal", "rlae"]] | None = Field(
        None,
        description="strategies the deployment runs (JSON list; default: [RLENS_STRATEGY]); requests for another get a clear error",
    )
    keys_file: Path | None = Field(
        Path("rlens-keys.json"), description="the API keys (hashed; `rlens keys add`), re-read when it changes"
    )
    keys: str | None = Field(None, description="the API key records as JSON instead of a file (containers)")
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="how long a request waits for its answer (then 504 with the query id: fetch it later at /v1/answers/{id})",
    )
    retention_s: int = Field(
        3600,
        ge=1,
        description="answers, idempotency keys and queries are kept this long: the late-answer fetch and the feedback window (keep it within RLENS_PENDING_TTL_S)",
    )
    max_waiting: int = Field(
        1000, ge=1, description="requests waiting for answers at once per replica; more get 503 with Retry-After"
    )
    max_body_bytes: int = Field(1_048_576, ge=1024, description="largest request body (413 above)")
    max_prompt_chars: int = Field(100_000, ge=1, le=100_000, description="longest prompt (413 above)")
    body_timeout_s: float = Field(
        10.0, gt=0, description="a request body must arrive whole within this (408 after; a slow sender holds no slot)"
    )
    max_connections: int = Field(
        2048, ge=16, description="connections and requests at once per replica; more get 503 at once"
    )
    idle_timeout_s: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed after this")
    header_timeout_s: float = Field(
        10.0, gt=0, description="a request whose headers have not all arrived by then is closed with a 408"
    )
    max_connections_per_address: int = Field(
        256, ge=1, description="connections one client address may hold at once (a new one past it: 503, closed)"
    )
    access_log_sample: float = Field(
        1.0,
        ge=0,
        le=1,
        description="share of requests in the access log (one line each: route, status, latency, key id, tenant, "
        "query id, cost; never the prompt); 0: no access log",
    )
    auth_failures_per_s: float = Field(
        5.0, gt=0, description="failed authentications per second per client address (bursts of 20); more get 429"
    )


class DriftSettings(Group):
    """Drift detection in the learner (rlens.drift)."""

    detector: Literal["adwin", "page_hinkley", "off"] = Field(
        "adwin", description="river's change detector per (stream, signal) on the joined outcomes; off: none"
    )
    delta: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="ADWIN's confidence: smaller, fewer false alarms and later detections (0.05: chosen on zoo_mc, BENCHMARKS.md)",
    )
    min_gap: int = Field(20, ge=1, description="values of one (stream, signal) between two of its detections")
    reaction: Literal["trim", "none"] = Field(
        "none",
        description="on a drift of a stream's outcome or of one of its models: trim its window to the last RLENS_DRIFT_KEEP outcomes (the old task's rows go), or nothing (the default: trim helped on zoo_mc, not on the held-out bbh_dev; BENCHMARKS.md)",
    )
    keep: int = Field(5, ge=0, description="outcomes a stream's window keeps when it is trimmed after a drift")


class FocalSettings(Group):
    """RL-Focal's serving settings; those named like :class:`~rlens.focal.config.FocalConfig`'s fields are its."""

    explore_rate: float = Field(
        FocalConfig.explore_rate,
        ge=0,
        le=1,
        description="rl_focal: share of queries on which both agents sample their actions "
        "(logged with their probabilities; only these train the policies); the rest are answered greedily",
    )
    update_period: int = Field(
        FocalConfig.update_period,
        ge=1,
        description="rl_focal: the learner updates once this many explored transitions are joined",
    )
    probe_rate: float | None = Field(
        None,
        ge=0,
        le=1,
        description="rl_focal: share of queries that also call the rest of the pool (fresh windows, exact evidence); "
        "unset, 0.05, or 0.2 under gated promotion, the rate its evidence was measured at (its estimates rank "
        "candidates well with 20 %, not with 5 %: BENCHMARKS.md, Off-policy evaluation)",
    )
    first_probes: int = Field(
        FocalConfig.first_probes,
        ge=0,
        le=1024,
        description="rl_focal: a stream's first queries that call every model too, so that no model is judged on two "
        "or three rows (counted in Redis; not while the stream's budget is overspent, nor on a query with a budget of "
        "its own; 16 chosen on the task-switch validation sets, BENCHMARKS.md); 0: none",
    )
    budget: float | None = Field(
        FocalConfig.budget,
        gt=0,
        le=1,
        description="rl_focal: the mean share of the whole pool's cost spent per query, met online by each worker "
        "(an offset on the Decider's logits; rlens.focal.budget); none: the cost weight alone decides",
    )
    budget_cap: bool = Field(
        FocalConfig.budget_cap,
        description="rl_focal: the budgets as caps: only spending above a budget is pushed down, spending under it is "
        "left to the cost weight (alpha); false: each budget is met on average, spending under it pushed up too",
    )
    stream_budgets: dict[str, Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=dict,
        description="rl_focal: streams with a budget of their own, {stream: share}, each met online by its own "
        "controller in each worker ([focal] stream_budgets = {name = share}; RLENS_FOCAL_STREAM_BUDGETS as JSON sets "
        "the streams it names over the file's); the other streams use focal_budget",
    )
    alpha: float = Field(
        FocalConfig.alpha,
        ge=0,
        description="rl_focal: the reward's cost weight, reward = ±1 − alpha × the pool's share of the whole pool's cost",
    )
    window: int = Field(
        FocalConfig.window, ge=8, le=4096, description="rl_focal: outcomes kept per stream in its Redis window"
    )
    calibration_rows: int = Field(
        FocalConfig.calibration_rows,
        ge=0,
        le=4096,
        description="rl_focal: each model's last labelled outcomes per stream kept in Redis, from which the learner fits "
        "its calibration (refitted every 16 new rows, at most every RLENS_LEARNER_REFIT_INTERVAL_S) and the workers' greedy answers take the pool's calibrated vote "
        "(rlens.focal.calibration); 0: none. Needs RLENS_OPE_LOGGING (the called models' distributions): with "
        "RLENS_OPE_LOGGING=false set it to 0",
    )
    joint_rows: int = Field(
        FocalConfig.joint_rows,
        ge=0,
        le=16_384,
        description="rl_focal: a stream's last labelled queries kept whole in Redis (each called model's "
        "log-probabilities), from which the learner fits, for the stream's 8 most served pools, a joint multinomial "
        "regression over the members' log-probabilities; a pool's joint fit replaces its calibrated vote where it "
        "predicted the stream's newest rows better (long streams; rlens.focal.calibration.PoolCombiner); 0: none. "
        "Needs RLENS_FOCAL_CALIBRATION_ROWS",
    )
    samples: int = Field(
        5,
        ge=1,
        le=64,
        description="rl_focal, open-ended queries: texts each chosen model samples; their extracted answers make its distribution",
    )
    temperature: float = Field(
        1.0, gt=0, le=10, description="rl_focal, open-ended queries: the models' sampling temperature"
    )
    max_tokens: int = Field(16, ge=1, le=4096, description="rl_focal, open-ended queries: tokens per sample at most")
    stop: list[str] = Field(
        ["\n"],
        max_length=8,
        description="rl_focal, open-ended queries: a sample stops before the first of these strings (JSON list)",
    )
    extractor: Literal["line", "number"] = Field(
        "line",
        description="rl_focal, open-ended queries: the answer in a sample (and in a feedback reference): its first line, or its first number",
    )

    @field_validator("budget", mode="before")
    @classmethod
    def _none(cls, value: object) -> object:
        """``none`` (any case) for no budget: the configuration file has no null, a variable no None."""
        return None if isinstance(value, str) and value.strip().lower() == "none" else value

    def sampling(self) -> GenerationRequest:
        """How the rl_focal worker asks each chosen model about an open-ended query (id and prompt filled per query)."""
        from rlens.backends.base import GenerationRequest  # the backends' package is not needed to read settings

        return GenerationRequest(
            id="-", prompt="", n=self.samples, temperature=self.temperature, max_tokens=self.max_tokens, stop=self.stop
        )


class RLAESettings(Group):
    """RLAE's serving and online-training settings; those named like ``RLAEConfig``'s fields are its."""

    variant: Literal["ppo", "mappo"] = Field(
        "ppo", description="ppo (one agent, Dirichlet weights) or mappo (one agent per model, centralized critic)"
    )
    span: int = Field(4, ge=1, description="tokens per span: the agent sets the weights every this many tokens")
    max_tokens: int = Field(16, ge=1, description="tokens generated per query at most")
    stop: list[str] = Field(["\n"], description="generation stops before the first of these strings (JSON list)")
    top_k: int = Field(5, ge=1, le=20, description="pools of openai servers: top tokens asked of each server per step")
    update_episodes: int = Field(64, ge=1, description="rewarded generations between two online PPO updates")
    lr: float = Field(1e-3, gt=0, description="learning rate of the online PPO updates")
    rehearsal: int = Field(
        400,
        ge=0,
        description="earlier episodes replayed in every update, in all, shared evenly by the (at most 16) streams updated most recently (against forgetting across task switches); 0: none",
    )
    explore: bool = Field(
        True,
        description="sample the weights from the policy (on-policy experience for the learner); false: the policy's mean",
    )
    observe: Literal["prompt", "text"] = Field(
        "prompt",
        description="what the agent's MiniLM embeds: the prompt once per query, or prompt + text at every span",
    )


class CacheSettings(Group):
    """The shared cache of the models' answers (rl_focal workers)."""

    ttl_s: int = Field(
        86400,
        ge=0,
        description="rl_focal workers: a model's answer to a question (its prompt and choices, or a deterministic "
        "generation's parameters) is kept in Redis this long and reused by every worker; 0: never cached (a pool's "
        "recorded answers are still used)",
    )


class Settings(BaseSettings):
    """Every group of settings; ``settings.<group>.<key>``."""

    model_config = SettingsConfigDict(extra="forbid")

    service: ServiceSettings = Field(default_factory=ServiceSettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    learner: LearnerSettings = Field(default_factory=LearnerSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    drift: DriftSettings = Field(default_factory=DriftSettings)
    focal: FocalSettings = Field(default_factory=FocalSettings)
    rlae: RLAESettings = Field(default_factory=RLAESettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments (by group), then ``RLENS_*`` variables, then the configuration file, then defaults."""
        env_file = getattr(dotenv_settings, "env_file", None)  # Settings(_env_file=path): variables under the process's
        return init_settings, Variables(settings_cls, env_file), ConfigFileSource(settings_cls)

    @classmethod
    def group_keys(cls) -> dict[str, tuple[str, ...]]:
        """group → its keys."""
        return {group: tuple(groups()[group].model_fields) for group in cls.model_fields}

    def updated(self, changes: Mapping[str, Any] | None = None, **more: Any) -> Settings:
        """A validated copy with ``changes``: a variable's name without ``RLENS_`` (``kafka_bootstrap``,
        ``topic_prefix``) → its value, or a group's name → some of its keys and values."""
        data = {group: {key: getattr(model, key) for key in model.model_fields_set} for group, model in self}
        table = variables()
        for name, value in {**(changes or {}), **more}.items():
            if name in data and isinstance(value, Mapping):
                data[name].update(value)
            elif (variable := f"RLENS_{name}".upper()) in table:
                group, key = table[variable]
                data[group][key] = value
            else:
                raise ValueError(f"{name}: no setting is named so (a variable's name without RLENS_, or a group's)")
        return type(self).model_validate(data)

    def as_variables(self, names: tuple[str, ...] | None = None) -> dict[str, str]:
        """Each setting that is not None as the variable that sets it (``RLENS_<KEY>`` for a ``SHORT`` key, else
        ``RLENS_<GROUP>_<KEY>``) → its value as a variable holds it (JSON for lists and dicts; secrets revealed);
        ``names``: only these settings (variables without ``RLENS_``)."""
        wanted = None if names is None else {variables()[f"RLENS_{name}".upper()] for name in names}
        out = {}
        for group, model in self:
            for key in type(model).model_fields:
                value = getattr(model, key)
                if value is not None and (wanted is None or (group, key) in wanted):
                    out[variable_of(group, key)] = variable_value(value)
        return out

    @property
    def probe_rate(self) -> float:
        """``[focal] probe_rate``, or its default: :data:`GATED_PROBE_RATE` under gated or holdback promotion, else
        ``FocalConfig.probe_rate``."""
        if self.focal.probe_rate is not None:
            return self.focal.probe_rate
        return GATED_PROBE_RATE if self.learner.promotion != "direct" else FocalConfig.probe_rate

    def focal_config(self) -> FocalConfig:
        """The RL-Focal config of the service: the ``[focal]`` group's values of FocalConfig's fields."""
        values = self.focal.config_fields(FocalConfig)
        return FocalConfig(
            **{
                **values,
                "probe_rate": self.probe_rate,
                "stream_budgets": tuple(sorted(values["stream_budgets"].items())),
            }
        )

    def rlae_config(self) -> RLAEConfig:
        """The RLAE config of the service: the ``[rlae]`` group's values of RLAEConfig's fields (``update_episodes``
        is its ``episodes_per_update``)."""
        from rlens.rlae.agent import RLAEConfig

        return RLAEConfig(**self.rlae.config_fields(RLAEConfig), episodes_per_update=self.rlae.update_episodes)

    def group(self, role: Literal["workers", "learner", "gateway"], name: str = "") -> str:
        """The consumer group of a role: ``[worker] group`` / ``[learner] group`` when set, else the topic prefix's
        (``rlens.`` gives ``rlens-workers``, ``rlens-learner``, ``rlens-gateway-<name>``)."""
        explicit = {"workers": self.worker.group, "learner": self.learner.group}.get(role)
        # each learner shard and the trainer: a group (and a lease) of its own
        if role == "learner" and self.learner.role != "all":
            name = f"shard-{self.learner.shard}" if self.learner.role == "shard" else "trainer"
            if explicit:
                return f"{explicit}-{name}"
        return explicit or f"{self.kafka.topic_prefix.rstrip('.-_') or 'rlens'}-{role}" + (f"-{name}" if name else "")


def groups() -> dict[str, type[Group]]:
    """group name → its model."""
    return {name: field.annotation for name, field in Settings.model_fields.items()}  # type: ignore[misc]


def variables() -> dict[str, tuple[str, str]]:
    """Every ``RLENS_*`` variable that sets something → (group, key): ``RLENS_<GROUP>_<KEY>``, and ``RLENS_<KEY>``
    for a group's ``SHORT`` keys."""
    out = {}
    for group, model in groups().items():
        for key in model.model_fields:
            out[f"RLENS_{group}_{key}".upper()] = (group, key)
            if key in model.SHORT:
                out[f"RLENS_{key}".upper()] = (group, key)
    return out


def variable_of(group: str, key: str) -> str:
    """The variable that documents a setting: ``RLENS_<KEY>`` for a group's ``SHORT`` key, else
    ``RLENS_<GROUP>_<KEY>``."""
    return f"RLENS_{key}".upper() if key in groups()[group].SHORT else f"RLENS_{group}_{key}".upper()


def variable_value(value: Any) -> str:
    """A setting's value as an ``RLENS_*`` variable holds it."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, (list, dict, tuple)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def is_json(annotation: Any) -> bool:
    """Whether a setting of this type is JSON in a variable: a list or a dict, optional or not."""
    if get_origin(annotation) in (Union, UnionType):
        return any(is_json(arg) for arg in get_args(annotation))
    return get_origin(annotation) in (list, dict, tuple) or annotation in (list, dict, tuple)


class Variables(PydanticBaseSettingsSource):
    """The ``RLENS_*`` variables (:func:`variables`), by group; a ``SHORT`` name over the grouped one. Lists and
    dicts are JSON. ``env_file``: ``RLENS_*=...`` lines under the process's own variables."""

    def __init__(self, settings_cls: type[BaseSettings], env_file: Any = None):
        super().__init__(settings_cls)
        self.env_file = Path(env_file) if isinstance(env_file, (str, Path)) else None

    def get_field_value(self, field, field_name: str):  # every value comes from __call__
        return None, field_name, False

    def __call__(self) -> dict:
        lines = self.env_file.read_text().splitlines() if self.env_file and self.env_file.is_file() else []
        pairs = [line.split("=", 1) for line in lines if "=" in line and not line.lstrip().startswith("#")]
        environ = {
            name.strip().upper(): value
            for name, value in [*pairs, *os.environ.items()]
            if name.strip().upper().startswith("RLENS_")
        }
        out: dict[str, dict[str, Any]] = {}
        table = variables()
        grouped = [(v, gk) for v, gk in table.items() if v == f"RLENS_{gk[0]}_{gk[1]}".upper()]
        short = [(v, gk) for v, gk in table.items() if v != f"RLENS_{gk[0]}_{gk[1]}".upper()]
        for variable, (group, key) in grouped + short:
            if variable not in environ:
                continue
            value: Any = environ[variable]
            if is_json(groups()[group].model_fields[key].annotation):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"{variable}: not valid JSON ({exc})") from None
            out.setdefault(group, {})[key] = value
        return out


class ConfigFileSource(PydanticBaseSettingsSource):
    """The file ``RLENS_CONFIG`` names (:func:`rlens.config_file.read_config`); nothing when it is not set."""

    def get_field_value(self, field, field_name: str):  # every value comes from __call__
        return None, field_name, False

    def __call__(self) -> dict:
        from rlens.config_file import config_path, read_config

        path = config_path()
        return read_config(path, Settings.group_keys()) if path else {}


def settings() -> Settings:
    return Settings()
