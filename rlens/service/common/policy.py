"""Policy weights on the wire: safetensors bytes (never pickle), base64 in a :class:`Policy` message, signed.

:func:`encode_policy` packs and signs a strategy's policy tensors (the learner's key); :func:`decode_policy`
verifies the signature (the learner's public key), the strategy, the pool, the checksum and every tensor's name,
shape and dtype, and that every value is finite, before anything is loaded: a worker never runs a forged, torn,
foreign or non-finite policy.
"""

from __future__ import annotations

import base64
import hashlib
import time

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

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
