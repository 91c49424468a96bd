"""The service's trust boundaries: signed policies, feedback bound to its answer, secrets kept out of logs.

- **Policies** are signed by the learner with an Ed25519 private key (``RLENS_POLICY_SIGNING_KEY``, the learner's
  alone); workers hold only the public key (``RLENS_POLICY_VERIFY_KEY``), so a process that can write to the
  ``policy`` topic, a worker included, cannot make a policy that workers load.
- **Feedback** carries the answer's ``feedback_token``: HMACs of the query id and of the query id with its stream,
  under ``RLENS_FEEDBACK_SECRET`` (workers, learner and gateway share it). The learner checks the first before
  anything else, so feedback for a query comes only from whoever received an answer to that id, and a forged one is
  dead-lettered and never blocks the true one; it checks the second when the feedback joins its query, so a token
  issued for one stream rates no other. Workers answer a query id on the stream it was first asked on only (Redis
  keeps each id's stream), and a query on a tenant's stream has its token only on its gateway's reply topic (the
  shared ``answers`` topic carries its answer without it), so no application can rate a gateway tenant's answers.
- **Tenants' streams**: the gateway asks on ``@<tenant>/<stream>`` and signs the query (an HMAC over its id and
  stream); workers dead-letter a query on such a stream without a valid signature, so no application on Kafka,
  nor another tenant, can move a tenant's windows.
- **Answers on reply topics** are signed by the worker (an HMAC over the whole answer under a key derived from the
  same secret); a gateway takes none without a valid signature, so whoever can write a reply topic cannot answer
  a client.
- :func:`generate_secrets` makes the three values (``rlens secrets``); :func:`redact_url` hides passwords in URLs,
  :func:`redact_secrets` every secret in a configuration (``rlens config show``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

if TYPE_CHECKING:
    from rlens.settings import Settings
    from rlens.messages import Answer, Query, Spending

TOKEN_BYTES = 16


class SecretsError(ValueError):
    """A secret that is missing or malformed in the settings."""


def _key_bytes(value: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise SecretsError(f"{what} must be 32 bytes in base64 (generate them with `rlens secrets`)")
    return raw


class PolicySigner:
    """The learner's side: signs a policy's :meth:`~rlens.messages.Policy.signed_bytes`."""

    def __init__(self, private_key_b64: str):
        self._key = Ed25519PrivateKey.from_private_bytes(_key_bytes(private_key_b64, "RLENS_POLICY_SIGNING_KEY"))

    def sign(self, data: bytes) -> str:
        return base64.b64encode(self._key.sign(data)).decode()

    def verifier(self) -> "PolicyVerifier":
        raw = self._key.public_key().public_bytes_raw()
        return PolicyVerifier(base64.b64encode(raw).decode())


class PolicyVerifier:
    """The workers' side: checks a signature against the learner's public key."""

    def __init__(self, public_key_b64: str):
        self._key = Ed25519PublicKey.from_public_bytes(_key_bytes(public_key_b64, "RLENS_POLICY_VERIFY_KEY"))

    def verify(self, data: bytes, signature_b64: str) -> bool:
        try:
            self._key.verify(base64.b64decode(signature_b64, validate=True), data)
        except (InvalidSignature, ValueError):
            return False
        return True


def _mac(key: bytes, message: Answer | Spending) -> str:
    """A message's MAC under ``key``: over its JSON with its ``signature`` empty."""
    content = message.model_copy(update={"signature": ""}).model_dump_json().encode()
    return hmac.new(key, content, hashlib.sha256).hexdigest()


def _carries_its_mac(key: bytes, message: Answer | Spending) -> bool:
    return bool(message.signature) and hmac.compare_digest(_mac(key, message), message.signature)


class FeedbackTokens:
    """What the shared feedback secret makes. ``token(query_id)``: what an answer carries and its feedback must
    present (``valid`` checks one in constant time). ``sign(answer)``: an HMAC over the whole answer (query id and
    content, every field but the signature), under a key of its own derived from the secret, so that only a worker
    can make an answer a gateway accepts, an empty one included (``signed`` checks it). ``sign_spending``: the same
    for a gateway's spending record, so that a Kafka writer cannot raise what a key spent."""

    def __init__(self, secret: str):
        if len(secret) < 16:
            raise SecretsError(
                "RLENS_FEEDBACK_SECRET must be at least 16 characters (generate one with `rlens secrets`)"
            )
        self._secret = secret.encode()
        self._answer_key = hmac.new(self._secret, b"rlens answer signature", hashlib.sha256).digest()
        self._query_key = hmac.new(self._secret, b"rlens query signature", hashlib.sha256).digest()
        self._stream_key = hmac.new(self._secret, b"rlens feedback stream", hashlib.sha256).digest()
        self._spending_key = hmac.new(self._secret, b"rlens spending record", hashlib.sha256).digest()

    def token(self, query_id: str, stream: str) -> str:
        """Two MACs: one of the query id (checked as feedback arrives, before its query's stream may be known), one
        of the query id and its stream (checked when the feedback joins its query): a token for one stream is none
        for another's query of the same id."""
        bound = hmac.new(self._stream_key, f"{query_id}\0{stream}".encode(), hashlib.sha256).hexdigest()
        return self._issued_mac(query_id) + bound[: 2 * TOKEN_BYTES]

    def _issued_mac(self, query_id: str) -> str:
        return hmac.new(self._secret, query_id.encode(), hashlib.sha256).hexdigest()[: 2 * TOKEN_BYTES]

    def issued(self, query_id: str, token: str) -> bool:
        """Whether ``token`` was issued for ``query_id`` on some stream (constant time)."""
        return len(token) == 4 * TOKEN_BYTES and hmac.compare_digest(
            self._issued_mac(query_id), token[: 2 * TOKEN_BYTES]
        )

    def valid(self, query_id: str, stream: str, token: str) -> bool:
        """Whether ``token`` is the one issued for ``query_id`` on ``stream`` (constant time)."""
        return hmac.compare_digest(self.token(query_id, stream), token)

    def sign(self, answer: Answer) -> Answer:
        return answer.model_copy(update={"signature": _mac(self._answer_key, answer)})

    def signed(self, answer: Answer) -> bool:
        return _carries_its_mac(self._answer_key, answer)

    def sign_spending(self, record: Spending) -> Spending:
        return record.model_copy(update={"signature": _mac(self._spending_key, record)})

    def signed_spending(self, record: Spending) -> bool:
        return _carries_its_mac(self._spending_key, record)

    def query_signature(self, query_id: str, stream: str) -> str:
        """What a gateway's query carries: only a holder of the secret may use a tenant's stream key."""
        return hmac.new(self._query_key, f"{query_id}\0{stream}".encode(), hashlib.sha256).hexdigest()

    def query_signed(self, query: Query) -> bool:
        return hmac.compare_digest(self.query_signature(query.query_id, query.stream), query.signature)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def admin_allowed(authorization: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries the admin token: ``Bearer <token>`` (Prometheus, curl) or HTTP
    Basic with the token as password (a browser's login prompt, for the dashboard). No token set: everyone."""
    if token is None:
        return True
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() == "basic":
        try:
            value = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except ValueError:
            return False
    elif scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


def check_exposure(host: str, token: str | None, setting: str) -> None:
    """Refuse to serve the monitoring routes (metrics and the dashboard list every tenant's stream names) beyond
    loopback without the admin token."""
    if token is None and host not in LOOPBACK:
        raise SecretsError(
            f"{setting}={host} would show /metrics and /dashboard (every tenant's stream names) to anyone who reaches "
            "it: set RLENS_ADMIN_TOKEN (scrapers send it as a bearer token), or bind to 127.0.0.1"
        )


def generate_secrets() -> dict[str, str]:
    """Fresh values of the three secrets, as RLENS_* variable names → values."""
    private = Ed25519PrivateKey.generate()
    return {
        "RLENS_FEEDBACK_SECRET": secrets.token_urlsafe(32),
        "RLENS_POLICY_SIGNING_KEY": base64.b64encode(private.private_bytes_raw()).decode(),
        "RLENS_POLICY_VERIFY_KEY": base64.b64encode(private.public_key().public_bytes_raw()).decode(),
    }


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: ``redis://:pw@host:6379/0`` → ``redis://:***@host:6379/0``
    (several hosts too: ``redis+sentinel://:pw@s1:26379,s2:26379/master``)."""
    parts = urlsplit(url)
    credentials, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return urlunsplit(parts._replace(netloc=f"{credentials.partition(':')[0]}:***@{hosts}"))


REDACTED = "**********"
# a setting, pool option or header whose name says it holds a secret
SECRET_NAME = re.compile(r"(key|secret|password|passwd|token|authorization|cookie|credential)s?$", re.IGNORECASE)


def redact_secrets(value: Any, name: str = "") -> Any:
    """A JSON-like value with every secret in it hidden, wherever it sits: a value whose name says it is a secret
    (``api_key``, ``password``, a header such as ``Authorization``), and a password inside any URL."""
    if isinstance(value, dict):
        return {k: redact_secrets(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_secrets(v, name) for v in value]
    if value is None or isinstance(value, bool):
        return value
    if hasattr(value, "get_secret_value") or (name and SECRET_NAME.search(name) and isinstance(value, str)):
        return REDACTED
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value


def _secret(settings: Settings, name: str) -> str:
    value = getattr(settings.security, name)
    if value is None:
        raise SecretsError(
            f"RLENS_{name.upper()} is not set: generate the service's secrets with `rlens secrets` (`rlens up` makes its own)"
        )
    return value if isinstance(value, str) else value.get_secret_value()


def feedback_tokens(settings: Settings) -> FeedbackTokens:
    return FeedbackTokens(_secret(settings, "feedback_secret"))


def policy_verifier(settings: Settings) -> PolicyVerifier:
    return PolicyVerifier(_secret(settings, "policy_verify_key"))


def policy_signer(settings: Settings) -> PolicySigner:
    return PolicySigner(_secret(settings, "policy_signing_key"))
