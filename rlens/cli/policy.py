"""``rlens policy``: the versions on the policy topic (list, show), and an operator's promotion or rollback, signed
with the learner's key (the workers take it at once; the learner trains on from it)."""

from __future__ import annotations

import asyncio
import base64
import json
from datetime import datetime, timezone
from pathlib import Path

import typer
from pydantic import SecretStr
from rich.table import Table

from rlens.cli.common import DEFAULT_WORKDIR, console, errors, fail
from rlens.messages import Policy
from rlens.settings import Settings, settings

app = typer.Typer(
    help="Policy versions: list and show what the policy topic holds; promote one or roll back (needs the signing key).",
    no_args_is_help=True,
)
STACK = typer.Option(
    DEFAULT_WORKDIR,
    help="the work folder of an `rlens up` stack: its client.env and secrets.env give the address and keys "
    "(RLENS_* variables override them)",
)
LEARNER = typer.Option(
    None, help="the learner's HTTP address, for reward and accuracy per version (default: its readiness mark in Redis)"
)
EPOCH = typer.Option(None, help="the epoch of the version (default: the newest epoch that has it)")


def operator_settings(stack: Path) -> Settings:
    """The environment's settings, or the stack's in ``stack``; a local stack's policy keys where none are set."""
    from rlens.local.stack import SECRETS_ENV, client_settings, workdir_secrets

    s = client_settings(stack) or settings()
    if (stack / SECRETS_ENV).is_file():
        own = workdir_secrets(stack)
        if s.security.policy_verify_key is None and "policy_verify_key" in own:
            s = s.updated({"policy_verify_key": own["policy_verify_key"]})
        if s.security.policy_signing_key is None and "policy_signing_key" in own:
            s = s.updated({"policy_signing_key": SecretStr(own["policy_signing_key"])})
    return s


def read_history(s: Settings):
    from rlens.service.common.kafka import Topics, read_topic
    from rlens.service.common.policy import PolicyHistory
    from rlens.service.common.security import SecretsError, policy_verifier

    try:
        verifier = policy_verifier(s)
    except SecretsError as exc:
        fail(f"{exc} (the policies are verified with it)")
    topic = Topics.from_settings(s).policy
    try:
        records = asyncio.run(read_topic(s, topic))
    except Exception as exc:  # unreachable broker, no such topic, a timeout: one line
        fail(f"could not read {topic} at {s.kafka.bootstrap}: {type(exc).__name__}: {exc}")
    return PolicyHistory.of([r.value for r in records], verifier)


def version_stats(s: Settings, learner: str | None) -> dict[int, dict]:
    """Reward and accuracy per version from the learner's dashboard API; {} (and a note) when it cannot be asked."""
    import httpx

    url = learner or learner_url(s)
    if url is None:
        errors.print("no learner found (pass --learner URL): reward and accuracy per version are not shown")
        return {}
    token = s.security.admin_token.get_secret_value() if s.security.admin_token else None
    try:
        response = httpx.get(
            f"{url.rstrip('/')}/api/dashboard",
            headers={"authorization": f"Bearer {token}"} if token else {},
            timeout=10.0,
        )
        response.raise_for_status()
    except httpx.HTTPError as exc:
        errors.print(f"the learner at {url} did not answer ({exc}): reward and accuracy per version are not shown")
        return {}
    return {row["version"]: row for row in response.json().get("versions", [])}


def learner_url(s: Settings) -> str | None:
    from redis.exceptions import RedisError

    from rlens.redis_clients import sync_redis
    from rlens.service.common.windows import ready_urls

    redis = sync_redis(s.redis.url.get_secret_value(), socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        for url in ready_urls(redis, s.redis.prefix, "learner").values():
            if url.startswith("http"):
                return url
    except (RedisError, OSError):
        return None
    finally:
        redis.close()
    return None


def when(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def interval(row: dict | None, key: str, scale: float = 1.0) -> str:
    if row is None or row.get(key) is None:
        return ""
    digits = 1 if scale != 1.0 else 3
    low, high = row[f"{key}_low"] * scale, row[f"{key}_high"] * scale
    return f"{row[key] * scale:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def stage(p: Policy) -> str:
    """The policy's stage, with the share of the queries an rlae candidate serves itself."""
    return p.stage + (f" ({100 * p.share:.0f} % of the queries)" if p.share else "")


@app.command("list")
def policy_list(
    stack: Path = STACK,
    learner: str | None = LEARNER,
    as_json: bool = typer.Option(False, "--json", help="JSON lines instead of a table"),
) -> None:
    """Every version the policy topic holds, oldest first: stage, who published it and why, and what it served."""
    s = operator_settings(stack)
    history = read_history(s)
    stats = version_stats(s, learner)
    served = history.served()
    if as_json:
        for p in history.policies:
            row = p.model_dump(exclude={"weights_b64", "signature"}) | {"served": p is served}
            print(json.dumps(row | {"stats": stats.get(p.version)}))
        return
    table = Table(
        title=f"{s.kafka.topic_prefix}policy: {len(history.policies)} policies, {len(history.rejected)} rejected"
    )
    for column in (
        "version",
        "epoch",
        "stage",
        "origin",
        "published (UTC)",
        "sha256",
        "events",
        "reward",
        "accuracy %",
    ):
        table.add_column(column)
    table.add_column("note", overflow="fold")
    for p in history.policies:
        row = stats.get(p.version) if p.stage == "live" or p.share else None  # an rlae candidate serves its share
        table.add_row(
            f"v{p.version}" + (" (served)" if p is served else ""),
            str(p.epoch),
            stage(p),
            p.origin,
            when(p.created_at),
            p.sha256[:12],
            str(row["events"]) if row else "",
            interval(row, "reward"),
            interval(row, "accuracy", 100.0),
            p.note,
        )
    console.print(table)
    for reason in history.rejected[-5:]:
        errors.print(f"rejected record: {reason}")


@app.command("show")
def policy_show(
    version: int = typer.Argument(..., min=1, help="the policy version"),
    epoch: int | None = EPOCH,
    stack: Path = STACK,
    learner: str | None = LEARNER,
) -> None:
    """One version: what it is, its tensors, and what it served."""
    import torch
    from safetensors.torch import load as load_safetensors

    from rlens.service.common.policy import PolicyError

    s = operator_settings(stack)
    history = read_history(s)
    try:
        p = history.find(version, epoch)
    except PolicyError as exc:
        fail(str(exc))
    row = version_stats(s, learner).get(p.version)
    served = history.served()
    console.print(
        f"policy v{p.version}, epoch {p.epoch}: {p.strategy} over {', '.join(p.models)}\n"
        f"  stage {stage(p)}{' (served now)' if p is served else ''}, published {when(p.created_at)} UTC by the {p.origin}"
        f"{f' ({p.note})' if p.note else ''}\n  sha256 {p.sha256}, signature verified"
    )
    if row:
        console.print(
            f"  served {row['events']} joined queries: reward {interval(row, 'reward')}, "
            f"accuracy {interval(row, 'accuracy', 100.0) or 'n/a'} %"
        )
    tensors = load_safetensors(base64.b64decode(p.weights_b64))
    table = Table(title=f"{len(tensors)} tensors, {sum(t.numel() for t in tensors.values()):,} values")
    for column in ("tensor", "shape", "dtype", "L2 norm"):
        table.add_column(column)
    for name, t in tensors.items():
        table.add_row(
            name,
            "×".join(map(str, t.shape)),
            str(t.dtype).removeprefix("torch."),
            f"{torch.linalg.vector_norm(t.float()):.4g}",
        )
    console.print(table)


def set_live(s: Settings, history, target, note: str) -> None:
    """``target``'s weights live again under the version after every one in ``history``, signed with the learner's
    key."""
    from rlens.service.common.kafka import Topics, send_one
    from rlens.service.common.security import SecretsError, policy_signer

    try:
        signer = policy_signer(s)
    except SecretsError as exc:
        fail(f"{exc} (an operator's policy is signed with the learner's key)")
    policy = history.republish(target, signer, note)
    try:
        asyncio.run(send_one(s, Topics.from_settings(s).policy, policy.model_dump_json().encode()))
    except Exception as exc:
        fail(f"could not publish to {s.kafka.bootstrap}: {type(exc).__name__}: {exc}")
    console.print(
        f"published v{policy.version} (epoch {policy.epoch}): the weights of v{target.version} (epoch {target.epoch}), "
        f"live; {note}"
    )


@app.command("promote")
def policy_promote(
    version: int = typer.Argument(..., min=1, help="the version to serve (a candidate, or any past version)"),
    epoch: int | None = EPOCH,
    reason: str = typer.Option("", help="why, kept with the policy"),
    stack: Path = STACK,
) -> None:
    """Serve a version's weights now (under a new version number; the gated learner puts the replaced one on
    probation and rolls back on its own if this one does worse)."""
    from rlens.service.common.policy import PolicyError

    s = operator_settings(stack)
    history = read_history(s)
    try:
        target = history.find(version, epoch)
    except PolicyError as exc:
        fail(str(exc))
    set_live(s, history, target, f"promoted v{target.version} by an operator" + (f": {reason}" if reason else ""))


@app.command("rollback")
def policy_rollback(
    to: int | None = typer.Option(
        None, "--to", min=1, help="the version to go back to (default: the one served before)"
    ),
    epoch: int | None = EPOCH,
    reason: str = typer.Option("", help="why, kept with the policy"),
    stack: Path = STACK,
) -> None:
    """Serve the version served before the current one (or the one --to names) again."""
    from rlens.service.common.policy import PolicyError

    s = operator_settings(stack)
    history = read_history(s)
    if to is None:
        target = history.before_served()
        if target is None:
            fail("no earlier live policy on the policy topic to roll back to")
    else:
        try:
            target = history.find(to, epoch)
        except PolicyError as exc:
            fail(str(exc))
    set_live(s, history, target, f"rolled back to v{target.version} by an operator" + (f": {reason}" if reason else ""))
