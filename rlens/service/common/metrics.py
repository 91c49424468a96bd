"""The Prometheus metrics of each process (worker, learner, gateway), each in its own registry; served at
``/metrics`` by :mod:`rlens.service.common.health`. Stream keys become label values through :class:`StreamLabels`: the first ``RLENS_METRICS_STREAMS`` distinct keys
keep their names, later ones share the label ``other``, so a flood of stream keys cannot grow the registry.
"""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


OTHER = "other"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


# dead-letter reasons (their opening words) -> the label of their kind: a small, fixed set
DEAD_LETTER_KINDS = (
    ("invalid JSON", "unreadable"),
    ("unreadable", "unreadable"),
    ("not a valid", "invalid"),
    ("multiple-choice query", "wrong_strategy"),
    ("query id", "duplicate"),
    ("answering failed", "failed"),
    ("reply_to", "invalid"),
    ("learner failed", "failed"),
    ("policy v", "policy_rejected"),
    ("feedback token", "forged_feedback"),
    ("experience does not fit", "experience_mismatch"),
    ("unmatched", "evicted"),
    ("experience expired", "expired"),
    ("feedback expired", "expired"),
    ("feedback for", "feedback_mismatch"),
    ("label ", "feedback_mismatch"),
)


def dead_letter_kind(reason: str) -> str:
    return next((kind for opening, kind in DEAD_LETTER_KINDS if reason.startswith(opening)), "other")


def failure_kind(reason: str) -> str:
    """A model failure's kind: ``deadline`` (no answer in time), ``refused`` (circuit open or threads stuck),
    ``no_answer`` (open-ended: no sample held an answer), ``error``."""
    if reason.startswith("no answer within"):
        return "deadline"
    if reason.startswith("none of its"):
        return "no_answer"
    return "refused" if reason.startswith("ModelUnavailable") else "error"


class StreamLabels:
    """Stream key → label value: the first ``limit`` distinct keys by name, the rest as ``other``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.known: set[str] = set()

    def __call__(self, stream: str) -> str:
        if stream in self.known:
            return stream
        if len(self.known) < self.limit:
            self.known.add(stream)
            return stream
        return OTHER


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, streams: StreamLabels):
        self.stream = streams
        self.queries = Counter("rlens_worker_queries", "queries taken, by stream", ["stream"], registry=registry)
        self.answers = Counter("rlens_worker_answers", "answers published, by stream", ["stream"], registry=registry)
        self.no_model_answered = Counter(
            "rlens_worker_no_model_answered",
            "answers with no model behind them (every called model failed)",
            registry=registry,
        )
        self.dead_letters = Counter(
            "rlens_worker_dead_letters", "messages dead-lettered, by kind", ["kind"], registry=registry
        )
        self.batch_size = Histogram(
            "rlens_worker_batch_size", "queries per batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry
        )
        self.stage_seconds = Histogram(
            "rlens_worker_stage_seconds",
            "seconds per batch in each stage",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.models_called = Histogram(
            "rlens_worker_models_called", "models called per query", buckets=tuple(range(0, 21)), registry=registry
        )
        self.model_selected = Counter(
            "rlens_worker_model_selected", "queries whose pool held the model", ["model"], registry=registry
        )
        self.model_failures = Counter(
            "rlens_worker_model_failures",
            "calls of a model that failed, by kind (deadline, refused, error)",
            ["model", "kind"],
            registry=registry,
        )
        self.model_cache = Counter(
            "rlens_worker_model_cache",
            "model-output cache lookups, by model and result (recorded, hit, miss, error)",
            ["model", "result"],
            registry=registry,
        )
        self.policy_version = Gauge("rlens_worker_policy_version", "version of the policy in use", registry=registry)
        self.policy_epoch = Gauge(
            "rlens_worker_policy_epoch", "epoch (learner start, ms) of the policy in use", registry=registry
        )
        self.window_reliability = Gauge(
            "rlens_worker_window_reliability",
            "each model's reliability in a stream's window (Laplace-smoothed accuracy when called), as the worker last read it",
            ["stream", "model"],
            registry=registry,
        )
        self.reply_failures = Counter(
            "rlens_worker_reply_failures",
            "answers a gateway's reply topic did not take in time (they are on the answers topic)",
            registry=registry,
        )
        self.queries_lag = Gauge(
            "rlens_worker_queries_lag",
            "queries waiting on this worker's partitions of the queries topic (consumer lag, by its last fetch): what "
            "workers scale on",
            registry=registry,
        )
        self.policies_rejected = Counter(
            "rlens_worker_policies_rejected",
            "policies refused (forged, non-finite, not for this pool)",
            registry=registry,
        )
        self.shadow_calls = Counter(
            "rlens_worker_shadow_calls",
            "model calls made only so that the champion a promotion replaced, on probation, is scored exactly "
            "(RLENS_GATE_SHADOW_CALLS)",
            registry=registry,
        )
        self.first_probes = Counter(
            "rlens_worker_first_probes",
            "queries that called every model for being among their stream's first (RLENS_FOCAL_FIRST_PROBES)",
            registry=registry,
        )

    def count_batch(self, queries, out, dead, worker) -> None:
        """A batch's metrics, summed per label first (one update per label value, not per query): its queries,
        stage times, answers, chosen models, failures, dead letters, the policy and the windows' reliabilities."""
        self.batch_size.observe(len(queries) + len(dead))
        for stream, n in Tally(self.stream(q.stream) for q in queries).items():
            self.queries.labels(stream).inc(n)
        for stage, seconds in out.stages.items():
            self.stage_seconds.labels(stage).observe(seconds)
        for stream, n in Tally(self.stream(a.stream) for a in out.answers).items():
            self.answers.labels(stream).inc(n)
        for model, n in Tally(model for a in out.answers for model in a.chosen_models).items():
            self.model_selected.labels(model).inc(n)
        failures = Tally((f.model, failure_kind(f.reason)) for a in out.answers for f in a.failures)
        for (model, kind), n in failures.items():
            self.model_failures.labels(model, kind).inc(n)
        for a in out.answers:
            self.models_called.observe(len(a.called_models))
        if unanswered := sum(not a.answered_models for a in out.answers):
            self.no_model_answered.inc(unanswered)
        if out.shadow_calls:
            self.shadow_calls.inc(out.shadow_calls)
        if out.first_probes:
            self.first_probes.inc(out.first_probes)
        for kind, n in Tally(dead_letter_kind(letter.reason) for letter in dead).items():
            self.dead_letters.labels(kind).inc(n)
        self.policy_version.set(worker.policy_version)
        self.policy_epoch.set(worker.policy_epoch)
        for stream, window in worker.windows_read().items():
            label = self.stream(stream)
            for model, reliability in zip(worker.models, window.reliability().tolist()):
                self.window_reliability.labels(label, model).set(reliability)


class LearnerMetrics:
    def __init__(self, registry: CollectorRegistry, streams: StreamLabels):
        self.stream = streams
        self.records = Counter(
            "rlens_learner_records",
            "experience, feedback and (the trainer) transitions records read, by topic kind",
            ["kind"],
            registry=registry,
        )
        self.joined = Counter(
            "rlens_learner_joined",
            "transitions joined (experience with its feedback), by stream",
            ["stream"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "rlens_learner_dead_letters", "records dead-lettered, by kind", ["kind"], registry=registry
        )
        self.batch_size = Histogram(
            "rlens_learner_batch_size",
            "records per batch read, by topic kind (each batch has a fixed cost: RLENS_LEARNER_FETCH_MIN_BYTES)",
            ["kind"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )
        self.feedback_delay = Histogram(
            "rlens_learner_feedback_delay_seconds",
            "feedback record time minus experience record time, per join",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300, 1800, 3600),
            registry=registry,
        )
        self.reward = Gauge(
            "rlens_learner_reward",
            "rolling mean reward (EWMA, weight 0.05 per join), by stream",
            ["stream"],
            registry=registry,
        )
        self.pending = Gauge("rlens_learner_pending", "unmatched halves held, by kind", ["kind"], registry=registry)
        self.window_backlog = Gauge("rlens_learner_window_backlog", "outcomes waiting for Redis", registry=registry)
        self.updates = Counter(
            "rlens_learner_updates", "policy updates, by outcome (applied, undone)", ["outcome"], registry=registry
        )
        self.update_seconds = Histogram(
            "rlens_learner_update_seconds", "seconds per update", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.policy_version = Gauge(
            "rlens_learner_policy_version", "newest policy version published", registry=registry
        )
        self.checkpoint_age = Gauge(
            "rlens_learner_checkpoint_age_seconds", "seconds since the newest checkpoint", registry=registry
        )
        self.accuracy = Gauge(
            "rlens_learner_accuracy",
            "rolling share of right answers (EWMA, weight 0.05 per join), by stream",
            ["stream"],
            registry=registry,
        )
        self.model_accuracy = Gauge(
            "rlens_learner_model_accuracy",
            "rolling share of right top choices of each called model (EWMA, weight 0.05), by stream and model",
            ["stream", "model"],
            registry=registry,
        )
        self.confidence = Gauge(
            "rlens_learner_confidence",
            "rolling label-free confidence of the answers (EWMA, weight 0.05), by stream",
            ["stream"],
            registry=registry,
        )
        self.candidates = Counter(
            "rlens_learner_candidates",
            "candidate policies the gate decided on (gated promotion), by verdict: promote, drop, roll_back (an alert), passed",
            ["outcome"],
            registry=registry,
        )
        self.candidate_events = Gauge(
            "rlens_learner_candidate_events",
            "queries scored in shadow for the candidate being judged",
            registry=registry,
        )
        self.candidate_estimate = Gauge(
            "rlens_learner_candidate_estimate",
            "the candidate's reward minus the champion's, per query, and its 95 % bounds (bound: value, low, high)",
            ["bound"],
            registry=registry,
        )
        self.version_reward = Gauge(
            "rlens_learner_version_reward",
            "mean reward of the joined queries each served policy version answered (the newest 20 versions)",
            ["version"],
            registry=registry,
        )
        self.version_accuracy = Gauge(
            "rlens_learner_version_accuracy",
            "share of right answers of each served policy version (the newest 20 versions)",
            ["version"],
            registry=registry,
        )
        self.version_events = Gauge(
            "rlens_learner_version_events",
            "joined queries each served policy version answered (the newest 20 versions)",
            ["version"],
            registry=registry,
        )
        self.drift_events = Counter(
            "rlens_learner_drift_events",
            "drift detections, by stream and signal (outcome, confidence, model:<name>)",
            ["stream", "signal"],
            registry=registry,
        )
        self.last_update = Gauge(
            "rlens_learner_last_update",
            "statistics of the newest update: policy_loss, value_loss, entropy, and each agent's (decider_policy_loss, decider_entropy, fusion_...)",
            ["stat"],
            registry=registry,
        )
        self._reward: dict[str, float] = {}
        self._signals: dict[tuple[str, str], float] = {}

    def observe_join(self, stream: str, reward: float, delay_s: float) -> None:
        label = self.stream(stream)
        self.joined.labels(label).inc()
        self.feedback_delay.observe(max(delay_s, 0.0))
        mean = self._reward.get(label)
        self._reward[label] = reward if mean is None else mean + 0.05 * (reward - mean)
        self.reward.labels(label).set(self._reward[label])

    def observe_version(self, row: dict, let_go: int | None) -> None:
        """One version's tally (:class:`rlens.service.learner.versions.VersionStats`); the version let go leaves."""
        version = str(row["version"])
        self.version_events.labels(version).set(row["events"])
        self.version_reward.labels(version).set(row["reward"])
        if row["accuracy"] is not None:
            self.version_accuracy.labels(version).set(row["accuracy"])
        if let_go is not None:
            for gauge in (self.version_events, self.version_reward, self.version_accuracy):
                try:
                    gauge.remove(str(let_go))
                except KeyError:
                    pass

    def observe_signals(self, stream: str, signals: dict[str, float]) -> None:
        """Rolling means of the drift signals: accuracy, each model's accuracy, confidence."""
        label = self.stream(stream)
        for signal, value in signals.items():
            mean = self._signals.get((label, signal))
            mean = value if mean is None else mean + 0.05 * (value - mean)
            self._signals[(label, signal)] = mean
            if signal == "outcome":
                self.accuracy.labels(label).set(mean)
            elif signal == "confidence":
                self.confidence.labels(label).set(mean)
            else:
                self.model_accuracy.labels(label, signal.removeprefix("model:")).set(mean)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "rlens_gateway_requests", "HTTP requests, by route and status code", ["route", "code"], registry=registry
        )
        self.request_seconds = Histogram(
            "rlens_gateway_request_seconds",
            "seconds per request, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.waiting = Gauge("rlens_gateway_waiting", "requests waiting for their answers", registry=registry)
        self.timeouts = Counter(
            "rlens_gateway_timeouts", "requests answered 504 (no answer in time)", registry=registry
        )
        self.rate_limited = Counter("rlens_gateway_rate_limited", "requests refused with 429", registry=registry)
        self.budget_refused = Counter(
            "rlens_gateway_budget_refused", "requests refused with 429: the key's budget is spent", registry=registry
        )
        self.cost = Counter(
            "rlens_gateway_cost",
            "the pool's cost units of the answers each API key got (its models called), by key id",
            ["key"],
            registry=registry,
        )
        self.model_calls = Counter(
            "rlens_gateway_model_calls",
            "model calls behind the answers each API key got, by key id",
            ["key"],
            registry=registry,
        )
        self.overhead_seconds = Histogram(
            "rlens_gateway_overhead_seconds",
            "seconds rlens added to an answered request beyond the models' own time (gateway, Kafka, worker)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.stage_seconds = Histogram(
            "rlens_gateway_stage_seconds",
            "seconds of an answered request in each stage (rlens.service.gateway.timing)",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.idempotent_replays = Counter(
            "rlens_gateway_idempotent_replays", "requests that repeated an Idempotency-Key", registry=registry
        )
        self.replies = Counter(
            "rlens_gateway_replies",
            "answers read from the reply topic, by outcome (stored, duplicate, unknown, forged, unreadable)",
            ["outcome"],
            registry=registry,
        )
        self.feedback = Counter(
            "rlens_gateway_feedback",
            "feedback requests, by outcome (accepted, duplicate)",
            ["outcome"],
            registry=registry,
        )
