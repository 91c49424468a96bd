"""Supervised pre-training of the Fusion agent on labelled recorded outputs (the warm start is offline and has the
labels, so the Fusion starts from the cross-entropy optimum of its own features; MAPPO then refines it)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from rlens.focal.agents import Fusion
from rlens.focal.features import padded_choices


def fit_fusion(
    fusion: Fusion,
    optimizer: torch.optim.Optimizer,
    features: list[np.ndarray],
    labels: list[int],
    epochs: int,
    minibatch_size: int,
    max_grad_norm: float,
    generator: torch.Generator,
) -> dict[str, float]:
    """``epochs`` of minibatch cross-entropy of the Fusion's answer distribution against ``labels``, on per-question
    features [C_i, F] of any choice counts; returns the last epoch's mean loss and accuracy."""
    padded, mask = padded_choices(features)
    x, valid, y = torch.from_numpy(padded), torch.from_numpy(mask), torch.tensor(labels)
    loss_sum = correct = 0.0
    for _ in range(epochs):
        loss_sum = correct = 0.0
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(labels), minibatch_size):
            mb = order[start : start + minibatch_size]
            scores = fusion.scores(x[mb], valid[mb])
            loss = F.cross_entropy(scores, y[mb])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(fusion.parameters(), max_grad_norm)
            optimizer.step()
            loss_sum += float(loss.detach()) * len(mb)
            correct += float((scores.argmax(-1) == y[mb]).sum())
    return {"loss": loss_sum / len(labels), "accuracy": correct / len(labels)}
