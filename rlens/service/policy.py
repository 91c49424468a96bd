"""Policy weights on the wire: safetensors bytes (never pickle), base64 in a :class:`Policy` message, SHA-256 checked.

:func:`encode_policy` packs a strategy's policy tensors; :func:`decode_policy` verifies the strategy, the pool, the
checksum and every tensor's name and shape against what the receiving worker runs before anything is loaded, so a
worker never runs a torn or foreign policy.
"""

from __future__ import annotations

import base64
import hashlib
import time

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rlens.messages import Policy


class PolicyError(ValueError):
    """A policy message that must not be loaded."""


def encode_policy(tensors: dict[str, torch.Tensor], version: int, models: list[str], strategy: str) -> Policy:
    blob = save_safetensors({k: v.contiguous() for k, v in tensors.items()})
    return Policy(
        strategy=strategy, version=version, created_at=time.time(), n_models=len(models), models=models,
        sha256=hashlib.sha256(blob).hexdigest(), weights_b64=base64.b64encode(blob).decode(),
    )


def decode_policy(policy: Policy, expected: dict[str, torch.Size], models: list[str], strategy: str) -> dict[str, torch.Tensor]:
    """The verified tensors of ``policy`` for a worker whose tensors have the ``expected`` shapes; else :class:`PolicyError`."""
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
    got = {k: v.shape for k, v in tensors.items()}
    if expected != got:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
        raise PolicyError(f"policy v{policy.version}: tensors do not fit this worker (missing {missing[:3]}, extra {extra[:3]}, wrong shape {wrong[:3]})")
    return tensors
