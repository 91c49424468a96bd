"""The production processes: ``rlens worker``, ``rlens learner``, ``rlens gateway``, and ``rlens secrets``."""

from __future__ import annotations

from pathlib import Path

import typer

from rlens.cli.common import CONFIG, POOL, fail, service_settings
from rlens.progress import quiet_transformers
from rlens.records.recorded import DatasetError
from rlens.settings import settings


def worker(pool: Path | None = POOL, config: Path | None = CONFIG) -> None:
    """Run an ensemble worker: queries from Kafka, answers and experience to Kafka (stops cleanly on SIGTERM)."""
    from rlens.models.pool import PoolConfigError
    from rlens.service.run import run_worker

    quiet_transformers()
    try:
        run_worker(service_settings(pool))
    except (PoolConfigError, ValueError) as exc:
        fail(str(exc))


def learner(
    pool: Path | None = POOL,
    config: Path | None = CONFIG,
    warm_start: Path | None = typer.Option(
        None,
        help="when there is no checkpoint yet, start from: a recorded dataset or an `rlens replay` run's policy "
        "(rl_focal), an `rlens rlae train` run (rlae)",
    ),
) -> None:
    """Run the learner: joins experience with feedback, updates windows and policy, checkpoints, publishes."""
    from rlens.models.pool import PoolConfigError
    from rlens.service.run import run_learner

    try:
        run_learner(service_settings(pool), warm_start)
    except (
        PoolConfigError,
        DatasetError,
        ValueError,
        RuntimeError,
    ) as exc:  # RuntimeError: its directory or group is taken
        fail(str(exc))


def gateway(
    config: Path | None = CONFIG,
    port: int | None = typer.Option(None, help="port (default: $RLENS_GATEWAY_PORT, 8000)"),
    keys: Path | None = typer.Option(
        None, "--keys", help="API keys file (default: $RLENS_GATEWAY_KEYS_FILE, rlens-keys.json)"
    ),
) -> None:
    """Run the OpenAI-compatible gateway: /v1/chat/completions, /v1/completions, /v1/models, /v1/feedback,
    /v1/answers/{id} in front of the Kafka service (stops cleanly on SIGTERM)."""
    from rlens.service.gateway.api_keys import KeysError
    from rlens.service.run import run_gateway
    from rlens.service.common.kafka import BrokerRefused
    from rlens.service.common.security import SecretsError

    s = settings()
    s = s.updated({k: v for k, v in {"gateway_port": port, "gateway_keys_file": keys}.items() if v is not None})
    try:
        run_gateway(s)
    except (KeysError, SecretsError, BrokerRefused) as exc:
        fail(str(exc))


def secrets() -> None:
    """Print fresh values of the service's secrets as RLENS_* lines (an env file): the feedback secret for the
    workers, the learner and the gateway; the policy signing key for the learner only; the verify key for the workers."""
    from rlens.service.common.security import generate_secrets

    print("# rlens service secrets: RLENS_POLICY_SIGNING_KEY belongs to the learner alone")
    for name, value in generate_secrets().items():
        print(f"{name}={value}")
