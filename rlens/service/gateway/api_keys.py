"""The gateway's API keys: stored hashed, each bound to a tenant, the stream keys it may use and its rate limit.

A key reads ``rlk_<id>_<secret>``: the id finds its record, the secret's SHA-256 is compared in constant time (the
secret is 32 random bytes, so a plain hash is as strong as a slow one). Records live in a JSON file (``rlens keys
add / list / revoke``; the gateway re-reads it when it changes, so a revoked key stops working within a second) or
in ``RLENS_GATEWAY_KEYS`` (the same JSON, for containers). A key's ``streams`` are patterns (``fnmatch``: ``*``,
``support-*``); its tenant owns the queries it asks, and no other tenant can read their answers or rate them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import OrderedDict
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, TypeAdapter

PREFIX = "rlk_"
log = logging.getLogger("rlens.gateway")


class KeyRecord(BaseModel):
    """One API key as stored: never the key itself, only its hash."""

    id: str = Field(pattern=r"^[a-z0-9]{8}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[^/]+$")  # its streams are @<tenant>/<stream>
    streams: list[str] = Field(min_length=1, description="stream keys this key may use (fnmatch patterns)")
    rate_per_s: float = Field(20.0, gt=0, description="sustained requests per second")
    burst: int = Field(40, ge=1, description="requests allowed at once above the sustained rate")
    budget: float | None = Field(
        None,
        gt=0,
        description="cost units this key may spend in all (each answer: the pool costs of the models it called); "
        "None: no limit",
    )
    budget_period: Literal["total", "daily", "monthly"] = Field(
        "total", description="when the budget starts again: never (total), every UTC day, or every UTC month"
    )
    created_at: float = 0.0
    revoked: bool = False

    def allows(self, stream: str) -> bool:
        return any(fnmatch.fnmatchcase(stream, pattern) for pattern in self.streams)


RECORDS = TypeAdapter(list[KeyRecord])


class KeysError(ValueError):
    """A keys file or variable that cannot be used, or a key id that does not exist."""


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_key(
    tenant: str,
    streams: list[str],
    rate_per_s: float = 20.0,
    burst: int = 40,
    budget: float | None = None,
    budget_period: str = "total",
) -> tuple[str, KeyRecord]:
    """A fresh key (shown once) and its record (what is stored)."""
    key_id = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
    secret = secrets.token_urlsafe(32)
    record = KeyRecord(
        id=key_id,
        sha256=_hash(secret),
        tenant=tenant,
        streams=streams,
        rate_per_s=rate_per_s,
        burst=burst,
        budget=budget,
        budget_period=budget_period,
        created_at=time.time(),
    )
    return f"{PREFIX}{key_id}_{secret}", record


def read_records(path: Path) -> list[KeyRecord]:
    if not path.is_file():
        return []
    try:
        return RECORDS.validate_json(path.read_bytes())
    except ValueError as exc:
        raise KeysError(f"{path} is not a valid keys file: {exc}") from exc


def write_records(path: Path, records: list[KeyRecord]) -> None:
    """Replace the file atomically (mode 0600): a gateway reading it never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(RECORDS.dump_json(records, indent=1))
    os.replace(tmp, path)


def add_key(
    path: Path,
    tenant: str,
    streams: list[str],
    rate_per_s: float = 20.0,
    burst: int = 40,
    budget: float | None = None,
    budget_period: str = "total",
) -> tuple[str, KeyRecord]:
    key, record = new_key(tenant, streams, rate_per_s, burst, budget, budget_period)
    write_records(path, [*read_records(path), record])
    return key, record


def revoke_key(path: Path, key_id: str) -> KeyRecord:
    records = read_records(path)
    found = [r for r in records if r.id == key_id]
    if not found:
        raise KeysError(f"no key {key_id!r} in {path}")
    write_records(path, [r.model_copy(update={"revoked": True}) if r.id == key_id else r for r in records])
    return found[0]


class KeyStore:
    """Looks keys up for the gateway: from ``RLENS_GATEWAY_KEYS`` (JSON) or a file, re-read when the file changes."""

    def __init__(self, path: Path | None = None, inline: str | None = None):
        if path is None and inline is None:
            raise KeysError(
                "the gateway has no API keys: set RLENS_GATEWAY_KEYS_FILE (make keys with `rlens keys add`) or RLENS_GATEWAY_KEYS"
            )
        self.path = path
        self._stamp: tuple[int, int] | None = None  # the file's (mtime, size) when last read
        self._stamp_good: tuple[int, int] | None = None  # ... when last read whole
        self._by_id: dict[str, KeyRecord] = {}
        if inline is not None:
            try:
                self._index(RECORDS.validate_json(inline))
            except ValueError as exc:
                raise KeysError(f"RLENS_GATEWAY_KEYS is not a valid JSON list of key records: {exc}") from exc
        elif path is not None:
            if not path.is_file():
                raise KeysError(
                    f"no API keys file at {path}: make a key with `rlens keys add --tenant NAME --file {path}`"
                )
            self.refresh()

    def _index(self, records: list[KeyRecord]) -> None:
        self._by_id = {r.id: r for r in records if not r.revoked}

    def refresh(self) -> None:
        """Re-read the file if it changed since the last read (keeps the last good records if it is unreadable)."""
        if self.path is None:
            return
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            self._stamp = stamp  # a bad file is reported once, not on every request
            try:
                self._index(read_records(self.path))
            except KeysError as exc:
                if self._stamp_good is None:  # the first read: nothing good to keep (the constructor raises)
                    raise
                log.error("%s; keeping the %d keys read before", exc, len(self._by_id))
                return
            self._stamp_good = stamp

    def lookup(self, key: str | None) -> KeyRecord | None:
        """The record of a presented key, or None (missing, malformed, unknown, revoked or wrong secret)."""
        if not key or not key.startswith(PREFIX) or key.count("_") < 2:
            return None
        key_id, secret = key[len(PREFIX) :].split("_", 1)
        record = self._by_id.get(key_id)
        if record is None or not hmac.compare_digest(record.sha256, _hash(secret)):
            return None
        return record


class FailedAuth:
    """Failed authentications per client address, as token buckets in this process (``rate`` per second, bursts
    of ``burst``): an address that keeps guessing keys gets 429. At most ``max_addresses`` are tracked; the least
    recently seen go first."""

    def __init__(self, rate: float, burst: int = 20, max_addresses: int = 10_000):
        self.rate, self.burst, self.max_addresses = rate, burst, max_addresses
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (tokens, when)

    def _tokens(self, address: str, now: float) -> float:
        tokens, then = self._buckets.get(address, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - then) * self.rate)

    def take(self, address: str) -> bool:
        """Count one failure of ``address``; False when its bucket was already empty (answer 429)."""
        now = time.monotonic()
        tokens = self._tokens(address, now)
        self._buckets[address] = (max(tokens - 1.0, 0.0), now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)
        return tokens >= 1.0
