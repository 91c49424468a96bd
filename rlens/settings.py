"""All of rlens's configuration in one pydantic-settings object: ``RLENS_*`` variables, over the configuration file
that ``RLENS_CONFIG`` names (:mod:`rlens.config_file`), over the defaults."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from rlens.focal.config import FocalConfig

if TYPE_CHECKING:
    from rlens.backends.base import GenerationRequest

PACKAGE_DATA = Path(__file__).parent / "data"
GATED_PROBE_RATE = 0.2  # rl_focal's probes under gated or holdback promotion, unless set: the evidence (BENCHMARKS.md)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLENS_", extra="ignore")

    shared_data: Path = Field(Path("../shared/datasets"), description="where the shared recorded datasets live")
    zoo_dir: Path = Field(
        Path.home() / ".cache" / "rlens" / "zoo", description="where `rlens zoo build` puts the model zoo"
    )
    demo_data: Path = Field(PACKAGE_DATA / "zoo_mc", description="the bundled dataset that `rlens demo` replays")
    http_timeout_s: float = Field(30.0, gt=0, description="openai backend: timeout of one HTTP attempt")
    http_retries: int = Field(2, ge=0, description="openai backend: retries after a transport error, timeout or 5xx")
    http_max_concurrency: int = Field(8, ge=1, description="openai backend: requests in flight per model server")

    # streaming service: Kafka
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers (comma-separated host:port)")
    kafka_security_protocol: str = Field("PLAINTEXT", description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")
    kafka_sasl_mechanism: str | None = Field(None, description="PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: Path | None = Field(None, description="CA bundle for SSL / SASL_SSL")
    kafka_acks: Literal["all", "1"] = Field(
        "all", description="producer acknowledgements: all (every in-sync replica; the default) or 1 (the leader only)"
    )
    kafka_idempotence: bool | Literal["auto"] = Field(
        "auto",
        description="idempotent producers (no duplicates from producer retries): auto (wherever the broker offers them: Apache Kafka does, tansu does not; the default), true (refuse to start on a broker without them) or false",
    )
    kafka_replication: int = Field(
        1,
        ge=1,
        description="replication factor of the topics the service creates (3 on a real cluster, with min.insync.replicas=2)",
    )
    topic_prefix: str = Field(
        "rlens.",
        description="topic names are this prefix + queries, answers, feedback, experience, policy, dead-letter",
    )
    kafka_partitions: int = Field(
        4,
        ge=1,
        description="partitions of the per-query topics the service creates (queries, answers, feedback, experience, dead letters)",
    )
    kafka_session_timeout_ms: int = Field(10_000, ge=1000, description="consumer-group session timeout")
    kafka_heartbeat_ms: int = Field(3_000, ge=100, description="consumer-group heartbeat interval")
    kafka_fetch_max_wait_ms: int = Field(
        500,
        ge=0,
        description="how long a fetch waits for data when there is none (Kafka answers as soon as data comes; "
        "`rlens up`'s embedded tansu, which often waits it out, uses 20)",
    )
    # streaming service: Redis windows
    redis_url: SecretStr = Field(
        SecretStr("redis://127.0.0.1:6379/0"),
        description="Redis for the sliding windows, budgets, rate limits, marks and leases: redis://user:password@host:port/db "
        "(rediss:// TLS), redis+sentinel://[:password@]host:port,host:port/<service>[/db] (the master the Sentinels "
        "name), or redis+cluster://[:password@]host:port,host:port (a Redis Cluster)",
    )
    redis_prefix: str = Field("rlens", description="prefix of every Redis key")
    window_ttl_s: int = Field(7 * 86400, ge=1, description="a stream's window expires after this long without feedback")
    dedup_ttl_s: int = Field(
        86400, ge=1, description="how long a query's applied outcome is remembered (duplicate feedback)"
    )
    # streaming service: trust (see rlens.service.common.security; `rlens secrets` generates all three)
    feedback_secret: SecretStr | None = Field(
        None, description="workers, learner, gateway: the HMAC key of the answers' feedback tokens"
    )
    policy_signing_key: SecretStr | None = Field(
        None, description="learner only: Ed25519 private key (base64) that signs policies"
    )
    policy_verify_key: str | None = Field(
        None, description="workers: the learner's Ed25519 public key (base64); only policies it verifies are loaded"
    )
    # streaming service: worker and learner
    strategy: Literal["rl_focal", "rlae"] = Field(
        "rl_focal",
        description="rl_focal: Decider + Fusion (multiple-choice queries, and open-ended ones over the models' sampled answers); rlae: open-ended queries (span-weighted token ensemble)",
    )
    pool_file: Path | None = Field(
        None, description="the pool file of the worker and the learner (see rlens.models.pool)"
    )
    pool: dict | None = Field(
        None,
        description='the pool itself, {"models": [...]} as in a pool file (the configuration file\'s '
        "[[pool.models]]); used before pool_file",
    )
    # consumer groups: derived from the topic prefix unless set, so that two deployments on one cluster (other
    # prefixes) never share a group; the default prefix gives the names of earlier releases
    worker_group: str = Field(
        "", description="the workers' consumer group on the queries topic (default: <topic prefix>-workers)"
    )
    learner_group: str = Field("", description="the learner's consumer group (default: <topic prefix>-learner)")
    learner_nice: int = Field(
        0,
        ge=0,
        le=19,
        description="the learner lowers its CPU priority by this much at its start (os.nice): on cores it shares with "
        "workers and a gateway, their requests go first and its updates take what is left (BENCHMARKS.md, the p99 "
        "with the learner); 0: none, as in a pod of its own",
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
    admin_token: SecretStr | None = Field(
        None,
        description="guards /metrics and the learner's dashboard in every process (Bearer, or Basic with it as the password); needed to bind them beyond loopback",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="where a worker or learner serves /metrics, /healthz and /readyz (0.0.0.0 in a container)",
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="their port; 0: a free one, announced in the process's readiness mark in Redis"
    )
    metrics_enabled: bool = Field(
        True, description="update the Prometheus metrics (false: /metrics stays empty; for measuring their cost)"
    )
    metrics_streams: int = Field(
        100, ge=1, description="stream keys that get their own metric labels; the rest share 'other'"
    )
    torch_threads: int = Field(
        1,
        ge=1,
        description="torch threads of a worker or learner process: one is fastest for the agents' tiny networks on a busy machine (raise it for in-process LLMs on an idle one)",
    )
    worker_batch: int = Field(32, ge=1, description="queries the worker takes per batch")
    worker_deadline_s: float = Field(60.0, gt=0, description="a query's models must answer within this")
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
    cache_ttl_s: int = Field(
        86400,
        ge=0,
        description="rl_focal workers: a model's answer to a question (its prompt and choices, or a deterministic "
        "generation's parameters) is kept in Redis this long and reused by every worker; 0: never cached (a pool's "
        "recorded answers are still used)",
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
    ope_logging: bool = Field(
        True,
        description="rl_focal workers: each query's experience carries what off-policy evaluation needs (its behaviour: "
        "propensity, greedy pool and answer, the called models' distributions) and a candidate's action in shadow, "
        "for `rlens ope` and gated promotion (which needs it); false saves their cost: 5 % of a worker's throughput "
        "on a broker, 9 % of its CPU time and 400 bytes a query (BENCHMARKS.md)",
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
    # the OpenAI-compatible gateway (`rlens gateway`; rlens.service.gateway)
    gateway_host: str = Field("127.0.0.1", description="where the gateway listens (0.0.0.0 in a container)")
    gateway_port: int = Field(
        8000, ge=0, le=65535, description="its port (0: a free one, announced in its readiness mark in Redis)"
    )
    gateway_id: str = Field(
        "",
        pattern=r"^[A-Za-z0-9._-]*$",
        max_length=100,
        description="this replica's name: its reply topic is <topic_prefix>replies.<id> (stable across restarts, e.g. a StatefulSet pod name; default: the host name)",
    )
    gateway_strategies: list[Literal["rl_focal", "rlae"]] | None = Field(
        None,
        description="strategies the deployment runs (JSON list; default: [RLENS_STRATEGY]); requests for another get a clear error",
    )
    gateway_keys_file: Path | None = Field(
        Path("rlens-keys.json"), description="the API keys (hashed; `rlens keys add`), re-read when it changes"
    )
    gateway_keys: str | None = Field(None, description="the API key records as JSON instead of a file (containers)")
    gateway_timeout_s: float = Field(
        30.0,
        gt=0,
        description="how long a request waits for its answer (then 504 with the query id: fetch it later at /v1/answers/{id})",
    )
    gateway_retention_s: int = Field(
        3600,
        ge=1,
        description="answers, idempotency keys and queries are kept this long: the late-answer fetch and the feedback window (keep it within RLENS_PENDING_TTL_S)",
    )
    gateway_max_waiting: int = Field(
        1000, ge=1, description="requests waiting for answers at once per replica; more get 503 with Retry-After"
    )
    gateway_max_body_bytes: int = Field(1_048_576, ge=1024, description="largest request body (413 above)")
    gateway_max_prompt_chars: int = Field(100_000, ge=1, le=100_000, description="longest prompt (413 above)")
    gateway_body_timeout_s: float = Field(
        10.0, gt=0, description="a request body must arrive whole within this (408 after; a slow sender holds no slot)"
    )
    gateway_max_connections: int = Field(
        2048, ge=16, description="connections and requests at once per replica; more get 503 at once"
    )
    gateway_idle_timeout_s: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed after this")
    gateway_header_timeout_s: float = Field(
        10.0, gt=0, description="a request whose headers have not all arrived by then is closed with a 408"
    )
    gateway_max_connections_per_address: int = Field(
        256, ge=1, description="connections one client address may hold at once (a new one past it: 503, closed)"
    )
    gateway_access_log_sample: float = Field(
        1.0,
        ge=0,
        le=1,
        description="share of requests in the access log (one line each: route, status, latency, key id, tenant, "
        "query id, cost; never the prompt); 0: no access log",
    )
    gateway_auth_failures_per_s: float = Field(
        5.0, gt=0, description="failed authentications per second per client address (bursts of 20); more get 429"
    )
    # drift detection (the learner; rlens.drift)
    drift_detector: Literal["adwin", "page_hinkley", "off"] = Field(
        "adwin", description="river's change detector per (stream, signal) on the joined outcomes; off: none"
    )
    drift_delta: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="ADWIN's confidence: smaller, fewer false alarms and later detections (0.05: chosen on zoo_mc, BENCHMARKS.md)",
    )
    drift_min_gap: int = Field(20, ge=1, description="values of one (stream, signal) between two of its detections")
    drift_reaction: Literal["trim", "none"] = Field(
        "none",
        description="on a drift of a stream's outcome or of one of its models: trim its window to the last RLENS_DRIFT_KEEP outcomes (the old task's rows go), or nothing (the default: trim helped on zoo_mc, not on the held-out bbh_dev; BENCHMARKS.md)",
    )
    drift_keep: int = Field(5, ge=0, description="outcomes a stream's window keeps when it is trimmed after a drift")
    focal_explore_rate: float = Field(
        FocalConfig.explore_rate,
        ge=0,
        le=1,
        description="rl_focal: share of queries on which both agents sample their actions "
        "(logged with their probabilities; only these train the policies); the rest are answered greedily",
    )
    focal_update_period: int = Field(
        FocalConfig.update_period,
        ge=1,
        description="rl_focal: the learner updates once this many explored transitions are joined",
    )
    focal_probe_rate: float | None = Field(
        None,
        ge=0,
        le=1,
        description="rl_focal: share of queries that also call the rest of the pool (fresh windows, exact evidence); "
        "unset, 0.05, or 0.2 under gated promotion, the rate its evidence was measured at (its estimates rank "
        "candidates well with 20 %, not with 5 %: BENCHMARKS.md, Off-policy evaluation)",
    )
    focal_budget: float | None = Field(
        None,
        gt=0,
        le=1,
        description="rl_focal: the mean share of the whole pool's cost spent per query, met online by each worker "
        "(an offset on the Decider's logits; rlens.focal.budget); none: the cost weight alone decides",
    )
    focal_stream_budgets: dict[str, Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=dict,
        description="rl_focal: streams with a budget of their own, {stream: share}, each met online by its own "
        "controller in each worker ([focal] stream_budgets = {name = share}; RLENS_FOCAL_STREAM_BUDGETS as JSON sets "
        "the streams it names over the file's); the other streams use focal_budget",
    )
    focal_alpha: float = Field(
        FocalConfig.alpha,
        ge=0,
        description="rl_focal: the reward's cost weight, reward = ±1 − alpha × the pool's share of the whole pool's cost",
    )
    focal_window: int = Field(
        FocalConfig.window, ge=8, le=4096, description="rl_focal: outcomes kept per stream in its Redis window"
    )
    focal_calibration_rows: int = Field(
        FocalConfig.calibration_rows,
        ge=0,
        le=4096,
        description="rl_focal: each model's last labelled outcomes per stream kept in Redis, from which the learner fits "
        "its calibration (refitted every 16 new rows) and the workers' greedy answers take the pool's calibrated vote "
        "(rlens.focal.calibration); 0: none. Needs RLENS_OPE_LOGGING (the called models' distributions): with "
        "RLENS_OPE_LOGGING=false set it to 0",
    )
    focal_joint_rows: int = Field(
        FocalConfig.joint_rows,
        ge=0,
        le=16_384,
        description="rl_focal: a stream's last labelled queries kept whole in Redis (each called model's "
        "log-probabilities), from which the learner fits, for the stream's 8 most served pools, a joint multinomial "
        "regression over the members' log-probabilities; a pool's joint fit replaces its calibrated vote where it "
        "predicted the stream's newest rows better (long streams; rlens.focal.calibration.PoolCombiner); 0: none. "
        "Needs RLENS_FOCAL_CALIBRATION_ROWS",
    )
    focal_samples: int = Field(
        5,
        ge=1,
        le=64,
        description="rl_focal, open-ended queries: texts each chosen model samples; their extracted answers make its distribution",
    )
    focal_temperature: float = Field(
        1.0, gt=0, le=10, description="rl_focal, open-ended queries: the models' sampling temperature"
    )
    focal_max_tokens: int = Field(
        16, ge=1, le=4096, description="rl_focal, open-ended queries: tokens per sample at most"
    )
    focal_stop: list[str] = Field(
        ["\n"],
        max_length=8,
        description="rl_focal, open-ended queries: a sample stops before the first of these strings (JSON list)",
    )
    focal_extractor: Literal["line", "number"] = Field(
        "line",
        description="rl_focal, open-ended queries: the answer in a sample (and in a feedback reference): its first line, or its first number",
    )
    # streaming service: the rlae strategy
    rlae_variant: Literal["ppo", "mappo"] = Field(
        "ppo", description="ppo (one agent, Dirichlet weights) or mappo (one agent per model, centralized critic)"
    )
    rlae_span: int = Field(4, ge=1, description="tokens per span: the agent sets the weights every this many tokens")
    rlae_max_tokens: int = Field(16, ge=1, description="tokens generated per query at most")
    rlae_stop: list[str] = Field(["\n"], description="generation stops before the first of these strings (JSON list)")
    rlae_top_k: int = Field(
        5, ge=1, le=20, description="pools of openai servers: top tokens asked of each server per step"
    )
    rlae_update_episodes: int = Field(64, ge=1, description="rewarded generations between two online PPO updates")
    rlae_lr: float = Field(1e-3, gt=0, description="learning rate of the online PPO updates")
    rlae_rehearsal: int = Field(
        400,
        ge=0,
        description="earlier episodes replayed in every update, in all, shared evenly by the (at most 16) streams updated most recently (against forgetting across task switches); 0: none",
    )
    rlae_explore: bool = Field(
        True,
        description="sample the weights from the policy (on-policy experience for the learner); false: the policy's mean",
    )
    rlae_observe: Literal["prompt", "text"] = Field(
        "prompt",
        description="what the agent's MiniLM embeds: the prompt once per query, or prompt + text at every span",
    )

    @field_validator("kafka_bootstrap")
    @classmethod
    def _host_ports(cls, bootstrap: str) -> str:
        for server in bootstrap.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"{server.strip()!r} is not host:port (e.g. 127.0.0.1:9092; several: a comma between)")
        return bootstrap

    @field_validator("redis_url")
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

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then ``RLENS_*`` variables (and an env file), then the same as ``RLENS_<GROUP>_<KEY>`` (the
        file's groups: ``RLENS_KAFKA_TOPIC_PREFIX``), then the configuration file, then defaults."""
        return (
            init_settings,
            env_settings,
            dotenv_settings,
            GroupedVariables(settings_cls),
            ConfigFileSource(settings_cls),
            file_secret_settings,
        )

    @property
    def probe_rate(self) -> float:
        """``focal_probe_rate``, or its default: :data:`GATED_PROBE_RATE` under gated or holdback promotion, else
        ``FocalConfig.probe_rate``."""
        if self.focal_probe_rate is not None:
            return self.focal_probe_rate
        return GATED_PROBE_RATE if self.promotion != "direct" else FocalConfig.probe_rate

    def group(self, role: Literal["workers", "learner", "gateway"], name: str = "") -> str:
        """The consumer group of a role: ``worker_group`` / ``learner_group`` when set, else the topic prefix's
        (``rlens.`` gives ``rlens-workers``, ``rlens-learner``, ``rlens-gateway-<name>``)."""
        explicit = {"workers": self.worker_group, "learner": self.learner_group}.get(role)
        return explicit or f"{self.topic_prefix.rstrip('.-_') or 'rlens'}-{role}" + (f"-{name}" if name else "")

    def focal_sampling(self) -> GenerationRequest:
        """How the rl_focal worker asks each chosen model about an open-ended query (id and prompt filled per query)."""
        from rlens.backends.base import GenerationRequest  # the backends' package is not needed to read settings

        return GenerationRequest(
            id="-",
            prompt="",
            n=self.focal_samples,
            temperature=self.focal_temperature,
            max_tokens=self.focal_max_tokens,
            stop=self.focal_stop,
        )


class GroupedVariables(PydanticBaseSettingsSource):
    """Settings named by their group in the file (:func:`rlens.config_file.grouped_variables`): ``[kafka]
    topic_prefix`` as ``RLENS_KAFKA_TOPIC_PREFIX`` beside ``RLENS_TOPIC_PREFIX``."""

    def get_field_value(self, field, field_name: str):  # every value comes from __call__
        return None, field_name, False

    def __call__(self) -> dict:
        import os

        from rlens.config_file import grouped_variables

        aliases = grouped_variables(list(self.settings_cls.model_fields))
        return {name: os.environ[variable] for variable, name in aliases.items() if variable in os.environ}


class ConfigFileSource(PydanticBaseSettingsSource):
    """The file ``RLENS_CONFIG`` names (:func:`rlens.config_file.read_config`); nothing when it is not set."""

    def get_field_value(self, field, field_name: str):  # every value comes from __call__
        return None, field_name, False

    def __call__(self) -> dict:
        from rlens.config_file import config_path, read_config

        path = config_path()
        return read_config(path, list(self.settings_cls.model_fields)) if path else {}


def settings() -> Settings:
    return Settings()
