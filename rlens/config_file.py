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

A group's keys are the fields of its model in :mod:`rlens.settings` (``[kafka] bootstrap`` is
``settings.kafka.bootstrap``, ``RLENS_KAFKA_BOOTSTRAP``).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from pathlib import Path
from typing import Any, Mapping


CONFIG_ENV = "RLENS_CONFIG"


class ConfigError(ValueError):
    """A configuration file that cannot be used (one line per problem)."""


# RLENS_* variables that are not settings: the configuration file's path, and the test and Kafka scripts' own
OTHER_VARIABLES = frozenset(
    {
        "RLENS_CONFIG",
        "RLENS_KAFKA_RUN",
        "RLENS_KAFKA_CACHE",
        "RLENS_KAFKA_JVM",
        "RLENS_TEST_KAFKA_BOOTSTRAP",
        "RLENS_TEST_LITELLM",
        "RLENS_SKIP_SMOLLM2",
    }
)


def unknown_variables(environ: Mapping[str, str], known: set[str]) -> list[str]:
    """One line for each ``RLENS_*`` variable that sets nothing (a typo, a guessed name), with the closest name;
    ``known``: the settings' variables."""
    known = known | OTHER_VARIABLES
    return [
        f"{variable} is not a setting of rlens and changes nothing{_suggest(variable, sorted(known))}"
        for variable in sorted(v for v in environ if v.upper().startswith("RLENS_") and v.upper() not in known)
    ]


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def read_config(path: Path, groups: Mapping[str, tuple[str, ...]]) -> dict[str, dict[str, Any]]:
    """The settings ``path`` sets, by group and key; :class:`ConfigError` naming every unknown group or key (of
    ``groups``: group → its keys) with the valid ones."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    out: dict[str, dict[str, Any]] = {}
    problems = []
    for group, values in data.items():
        if group not in groups:
            problems.append(f"unknown group [{group}]{_suggest(group, list(groups))}; groups: {', '.join(groups)}")
            continue
        if not isinstance(values, dict):
            problems.append(f"{group} must be a group ([{group}]), not a value")
            continue
        for key, value in values.items():
            if key in groups[group]:
                out.setdefault(group, {})[key] = value
            else:
                problems.append(
                    f"[{group}] {key}: unknown{_suggest(key, list(groups[group]))}; [{group}] takes "
                    f"{', '.join(sorted(groups[group]))}"
                )
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems))
    return out


def located(loc: tuple) -> str:
    """Where a validation error's location sits in the file: ``[group] key``."""
    return f"[{loc[0]}] {loc[1]}" if len(loc) >= 2 else str(loc[0]) if loc else "the settings"


def config_path() -> Path | None:
    value = os.environ.get(CONFIG_ENV)
    return Path(value) if value else None
