"""Policy weights on the wire: safetensors bytes (never pickle), base64 in a :class:`Policy` message, signed.

:func:`encode_policy` packs and signs a strategy's policy tensors (the learner's key); :func:`decode_policy`
verifies the signature (the learner's public key), the strategy, the pool, the checksum and every tensor's name,
shape and dtype, and that every value is finite, before anything is loaded: a worker never runs a forged, torn,
foreign or non-finite policy. :class:`PolicyHistory` reads the policy topic's records as the workers do: what is
served, what an operator can set live again (``rlens policy``).
"""

from __future__ import annotations

import base64
import hashlib
import time
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from pydantic import ValidationError

from rlens.messages import Policy
from rlens.service.common.security import PolicySigner, PolicyVerifier


class PolicyError(ValueError):
    """A policy message that must not be loaded."""


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return sorted(k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))


def encode_policy(
    tensors: dict[str, torch.Tensor],
    version: int,
    epoch: int,
    models: list[str],
    strategy: str,
    signer: PolicySigner,
    stage: str = "live",
    note: str = "",
    share: float | None = None,
    shadow_calls: float | None = None,
) -> Policy:
    blob = save_safetensors({k: v.contiguous() for k, v in tensors.items()})
    unsigned = Policy(
        strategy=strategy,
        epoch=epoch,
        version=version,
        created_at=time.time(),
        n_models=len(models),
        models=models,
        sha256=hashlib.sha256(blob).hexdigest(),
        signature="",
        weights_b64=base64.b64encode(blob).decode(),
        stage=stage,
        note=note,
        share=share,
        shadow_calls=shadow_calls,
    )
    return unsigned.model_copy(update={"signature": signer.sign(unsigned.signed_bytes())})


def decode_policy(
    policy: Policy, expected: dict[str, torch.Tensor], models: list[str], strategy: str, verifier: PolicyVerifier
) -> dict[str, torch.Tensor]:
    """The verified tensors of ``policy`` for a worker whose current tensors are ``expected`` (names, shapes,
    dtypes); else :class:`PolicyError`."""
    if not verifier.verify(policy.signed_bytes(), policy.signature):
        raise PolicyError(
            f"policy v{policy.version} (epoch {policy.epoch}): bad signature (not signed by this deployment's learner)"
        )
    if policy.strategy != strategy:
        raise PolicyError(f"policy v{policy.version} is an {policy.strategy} policy, this worker runs {strategy}")
    if policy.models != models:
        raise PolicyError(f"policy v{policy.version} is for models {policy.models}, this pool is {models}")
    try:
        blob = base64.b64decode(policy.weights_b64, validate=True)
    except ValueError as exc:
        raise PolicyError(f"policy v{policy.version}: weights are not base64 ({exc})") from None
    if hashlib.sha256(blob).hexdigest() != policy.sha256:
        raise PolicyError(f"policy v{policy.version}: SHA-256 mismatch (torn or altered weights)")
    try:
        tensors = load_safetensors(blob)
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise PolicyError(f"policy v{policy.version}: not a safetensors blob ({exc})") from None
    want = {k: (v.shape, v.dtype) for k, v in expected.items()}
    got = {k: (v.shape, v.dtype) for k, v in tensors.items()}
    if want != got:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise PolicyError(
            f"policy v{policy.version}: tensors do not fit this worker (missing {missing[:3]}, extra {extra[:3]}, wrong shape or dtype {wrong[:3]})"
        )
    if bad := non_finite(tensors):
        raise PolicyError(f"policy v{policy.version}: non-finite values in {bad[:3]}")
    return tensors


@dataclass
class PolicyHistory:
    """The policy topic's verified policies in topic order, read by the workers' rule: the live policy with the
    largest (epoch, version) is served. Bounded by the topic's retention (``RLENS_POLICY_KEEP_BYTES``)."""

    policies: list[Policy]
    rejected: list[str]  # why each other record is not a usable policy

    @classmethod
    def of(cls, values: list[bytes], verifier: PolicyVerifier) -> "PolicyHistory":
        policies, rejected = [], []
        for value in values:
            try:
                policy = Policy.model_validate_json(value)
            except ValidationError as exc:
                rejected.append(f"not a Policy message ({exc.error_count()} errors)")
                continue
            if verifier.verify(policy.signed_bytes(), policy.signature):
                policies.append(policy)
            else:
                rejected.append(f"v{policy.version} (epoch {policy.epoch}): bad signature")
        return cls(policies, rejected)

    def served(self) -> Policy | None:
        live = [p for p in self.policies if p.stage == "live"]
        return max(live, key=lambda p: (p.epoch, p.version)) if live else None

    def find(self, version: int, epoch: int | None = None) -> Policy:
        """Policy ``version`` (of the newest epoch that has one, unless ``epoch`` says which)."""
        found = [p for p in self.policies if p.version == version and epoch in (None, p.epoch)]
        if not found:
            held = ", ".join(f"v{p.version}" for p in self.policies[-10:]) or "none"
            raise PolicyError(
                f"no policy v{version}{f' of epoch {epoch}' if epoch is not None else ''} on the policy topic "
                f"(the newest it holds: {held})"
            )
        return max(found, key=lambda p: p.epoch)

    def before_served(self) -> Policy | None:
        """The live policy served before the one served now (other weights than it)."""
        served = self.served()
        if served is None:
            return None
        order = (served.epoch, served.version)
        older = [p for p in self.policies if p.stage == "live" and (p.epoch, p.version) < order]
        older = [p for p in older if p.sha256 != served.sha256]
        return max(older, key=lambda p: (p.epoch, p.version)) if older else None

    def next_order(self) -> tuple[int, int]:
        """An (epoch, version) above every policy on the topic: the workers take it over anything published so far."""
        if not self.policies:
            return time.time_ns() // 1_000_000, 1
        epoch = max(p.epoch for p in self.policies)
        return epoch, max(p.version for p in self.policies if p.epoch == epoch) + 1

    def republish(self, policy: Policy, signer: PolicySigner, note: str) -> Policy:
        """``policy``'s weights, live again under the next (epoch, version), signed, marked as an operator's."""
        epoch, version = self.next_order()
        unsigned = policy.model_copy(
            update={
                "epoch": epoch,
                "version": version,
                "stage": "live",
                "origin": "operator",
                "note": note[:300],
                "created_at": time.time(),
                "signature": "",
            }
        )
        return unsigned.model_copy(update={"signature": signer.sign(unsigned.signed_bytes())})
