"""The configuration file (``rlens.toml``): every setting of :class:`rlens.settings.Settings` in nested groups, and
the pool. ``RLENS_CONFIG`` (or ``--config``) names it; ``RLENS_*`` variables override what it says.

    [kafka]
    bootstrap = "kafka-0:9092,kafka-1:9092"
    [focal]
    alpha = 0.24
    [[pool.models]]
    name = "llama"
    backend = "openai"
    cost = 1.0
    options = { base_url = "http://llama:8000/v1", model = "llama-3.1-8b" }

A group's key is the setting's name without the group's prefix (``[kafka] bootstrap`` is ``kafka_bootstrap``,
``RLENS_KAFKA_BOOTSTRAP``); :data:`SECTIONS` says which setting is in which group.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from pathlib import Path
from typing import Any, Mapping


CONFIG_ENV = "RLENS_CONFIG"

# group → the settings it holds; a key is the setting without the group's prefix ("kafka_acks" → [kafka] acks)
GROUPS: dict[str, tuple[str, ...]] = {
    "service": (
        "strategy",
        "log_format",
        "otel_endpoint",
        "trace_dir",
        "seed",
        "torch_threads",
        "shared_data",
        "zoo_dir",
        "demo_data",
    ),
    "pool": ("pool_file",),  # or the models themselves: [[pool.models]]
    "kafka": (
        "kafka_bootstrap",
        "kafka_security_protocol",
        "kafka_sasl_mechanism",
        "kafka_sasl_username",
        "kafka_sasl_password",
        "kafka_ssl_cafile",
        "kafka_acks",
        "kafka_idempotence",
        "kafka_replication",
        "topic_prefix",
        "kafka_partitions",
        "kafka_session_timeout_ms",
        "kafka_heartbeat_ms",
        "kafka_fetch_max_wait_ms",
    ),
    "redis": ("redis_url", "redis_prefix", "window_ttl_s", "dedup_ttl_s"),
    "security": ("feedback_secret", "policy_signing_key", "policy_verify_key", "admin_token"),
    "metrics": ("metrics_host", "metrics_port", "metrics_enabled", "metrics_streams"),
    "http": ("http_timeout_s", "http_retries", "http_max_concurrency"),
    "worker": (
        "worker_group",
        "worker_batch",
        "worker_deadline_s",
        "model_concurrency",
        "circuit_failures",
        "circuit_cooldown_s",
        "ope_logging",
    ),
    "learner": (
        "learner_group",
        "learner_nice",
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
    ),
    "gateway": (),  # every gateway_* setting
    "drift": (),  # every drift_* setting
    "focal": (),  # every focal_* setting
    "rlae": (),  # every rlae_* setting
    "cache": (),  # every cache_* setting
}
PREFIXED = ("gateway", "drift", "focal", "rlae", "cache")


class ConfigError(ValueError):
    """A configuration file that cannot be used (one line per problem)."""


def sections(fields: list[str]) -> dict[str, dict[str, str]]:
    """group → {key in the file: setting name}, for every setting in ``fields``."""
    out: dict[str, dict[str, str]] = {}
    for group, names in GROUPS.items():
        names = tuple(f for f in fields if f.startswith(f"{group}_")) if group in PREFIXED else names
        out[group] = {n.removeprefix(f"{group}_"): n for n in names}
    return out


# RLENS_* variables that are not settings: the configuration file's path, and the test and Kafka scripts' own
OTHER_VARIABLES = frozenset(
    {
        "RLENS_CONFIG",
        "RLENS_KAFKA_RUN",
        "RLENS_KAFKA_CACHE",
        "RLENS_TEST_KAFKA_BOOTSTRAP",
        "RLENS_TEST_LITELLM",
        "RLENS_SKIP_SMOLLM2",
    }
)


def grouped_variables(fields: list[str]) -> dict[str, str]:
    """``RLENS_<GROUP>_<KEY>`` → setting name, for each setting whose variable is not that already (``[kafka]
    topic_prefix`` is ``RLENS_TOPIC_PREFIX``, and ``RLENS_KAFKA_TOPIC_PREFIX`` too): the name a reader of the file
    guesses."""
    out = {}
    for group, keys in sections(fields).items():
        for key, name in keys.items():
            variable = f"RLENS_{group}_{key}".upper()
            if variable != f"RLENS_{name}".upper():
                out[variable] = name
    return out


def unknown_variables(environ: Mapping[str, str], fields: list[str]) -> list[str]:
    """One line for each ``RLENS_*`` variable that sets nothing (a typo, a guessed name), with the closest name."""
    known = {f"RLENS_{name}".upper() for name in fields} | set(grouped_variables(fields)) | OTHER_VARIABLES
    return [
        f"{variable} is not a setting of rlens and changes nothing{_suggest(variable, sorted(known))}"
        for variable in sorted(v for v in environ if v.startswith("RLENS_") and v not in known)
    ]


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def read_config(path: Path, fields: list[str]) -> dict[str, Any]:
    """The settings ``path`` sets, by setting name (the pool's models under ``pool``); :class:`ConfigError` naming
    every unknown group or key with the valid ones."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    groups, flat, problems = sections(fields), {}, []
    for group, values in data.items():
        if group not in groups:
            problems.append(f"unknown group [{group}]{_suggest(group, list(groups))}; groups: {', '.join(groups)}")
            continue
        if not isinstance(values, dict):
            problems.append(f"{group} must be a group ([{group}]), not a value")
            continue
        for key, value in values.items():
            if group == "pool" and key == "models":
                flat["pool"] = {"models": value}
            elif key in groups[group]:
                flat[groups[group][key]] = value
            else:
                valid = list(groups[group]) + (["models"] if group == "pool" else [])
                problems.append(
                    f"[{group}] {key}: unknown{_suggest(key, valid)}; [{group}] takes {', '.join(sorted(valid))}"
                )
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems))
    return flat


def located(field: str, fields: list[str]) -> str:
    """Where a setting sits in the file: ``[group] key``."""
    for group, keys in sections(fields).items():
        for key, name in keys.items():
            if name == field:
                return f"[{group}] {key}"
    return "[pool] models" if field == "pool" else field


def config_path() -> Path | None:
    value = os.environ.get(CONFIG_ENV)
    return Path(value) if value else None


def nested(values: dict[str, Any], fields: list[str]) -> dict[str, dict[str, Any]]:
    """Settings by name → by group and key (what ``rlens config show`` prints, its secrets redacted)."""
    out: dict[str, dict[str, Any]] = {}
    for group, keys in sections(fields).items():
        out[group] = {key: values[name] for key, name in keys.items() if name in values}
    if values.get("pool") is not None:
        out["pool"]["models"] = values["pool"]["models"]
    return out
