"""The agents' greedy actions in NumPy: the serving hot path without torch's per-call dispatch.

A greedy query needs one small forward of each agent; through torch that costs a few hundred microseconds of
dispatch for a few microseconds of arithmetic. :class:`GreedyActor` reads the agents' weights as NumPy views of the
torch parameters (shared memory: every optimiser step and ``load_state_dict`` is seen at once, nothing to refresh)
and computes the same functions as :meth:`Decider.logits` / :meth:`Decider.sample` (greedy) and
:meth:`Fusion.scores` / :meth:`Fusion.act` (greedy). Results equal torch's up to float32 rounding (tested), so an
action differs only on an exact tie. Sampled (explored) actions stay in torch, with its seeded generator.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from rlens.focal.agents import Decider, Fusion


def _layers(net: nn.Sequential) -> list[tuple[np.ndarray, np.ndarray]]:
    """(weight.T, bias) views of each linear layer of a Linear/Tanh stack."""
    return [
        (layer.weight.detach().numpy().T, layer.bias.detach().numpy()) for layer in net if isinstance(layer, nn.Linear)
    ]


def _mlp(x: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Linear layers with tanh between them and after every layer but the last."""
    for i, (w, b) in enumerate(layers):
        x = x @ w + b
        if i < len(layers) - 1:
            x = np.tanh(x)
    return x


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


class GreedyActor:
    """Greedy pools and answers from the current weights of ``decider`` and ``fusion``."""

    def __init__(self, decider: Decider, fusion: Fusion):
        self.decider, self.fusion = decider, fusion
        self.trunk = _layers(decider.trunk)
        self.heads = (decider.heads.weight.detach().numpy().T, decider.heads.bias.detach().numpy())
        self.per_model = decider.per_model.weight.detach().numpy()[0]  # [3]
        self.linear = (fusion.linear.weight.detach().numpy().T, fusion.linear.bias.detach().numpy())
        self.residual = _layers(fusion.residual)

    def decider_logits(self, obs: np.ndarray) -> np.ndarray:
        """:meth:`Decider.logits` of observations [B, S] -> [B, M]."""
        d = self.decider
        phi = obs[:, d.model_features].reshape(len(obs), 3, d.n_models)  # [B, 3, M]
        w, b = self.heads
        return np.tanh(_mlp(obs, self.trunk)) @ w + b + self.per_model @ phi

    def pools(self, obs: np.ndarray, shift: float | np.ndarray = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """The greedy pools (bool [B, M]: the models with a positive logit, or the single most likely one when none
        is) and their log-probabilities [B], as :meth:`Decider.sample` with ``greedy``; ``shift`` (a number, [M] or
        [B, M]) is added to the logits first (a budget: :func:`rlens.focal.budget.logit_shift`)."""
        logits = self.decider_logits(obs)
        if np.any(shift):
            logits = logits + np.asarray(shift, dtype=logits.dtype)
        pools = logits > 0
        top = logits.argmax(1)
        empty = ~pools.any(1)
        pools[empty, top[empty]] = True
        log_out = _log_sigmoid(-logits)  # each model's log-probability of staying out
        logp = np.where(pools, _log_sigmoid(logits), log_out).sum(1)
        single = pools.sum(1) == 1
        fallback = single & pools[np.arange(len(pools)), top]  # the pool an empty draw also becomes
        logp = np.where(fallback, np.logaddexp(logp, log_out.sum(1)), logp)
        return pools, logp

    def fusion_scores(self, features: np.ndarray, choice_mask: np.ndarray) -> np.ndarray:
        """:meth:`Fusion.scores`: features [B, C, F], choice_mask bool [B, C] -> [B, C]."""
        w, b = self.linear
        scores = (features @ w + b + _mlp(features, self.residual))[..., 0]
        return np.where(choice_mask, scores, -1e9)

    def fusion_log_probs(self, features: np.ndarray, choice_mask: np.ndarray) -> np.ndarray:
        """The Fusion's own log-distribution over the choices [B, C] (what an explored answer is sampled from)."""
        scores = self.fusion_scores(features, choice_mask)
        return scores - np.logaddexp.reduce(scores, axis=1, keepdims=True)

    def answers(
        self, features: np.ndarray, choice_mask: np.ndarray, votes: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(greedy answers [B], their log-probabilities [B], the distributions [B, C]), as :meth:`Fusion.act`; with
        ``votes`` [B, C] (each pool's calibrated vote, :mod:`rlens.focal.calibration`), of the Fusion's distribution
        times the vote, renormalised (:func:`voted_answers`)."""
        return voted_answers(self.fusion_log_probs(features, choice_mask), votes)


def voted_answers(log_probs: np.ndarray, votes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From the Fusion's log-distributions [B, C] and the pools' votes [B, C] (or None): the greedy answers [B], their
    log-probabilities [B] and the distributions [B, C] of the Fusion's times the vote, renormalised."""
    if votes is not None:
        scores = log_probs + votes
        log_probs = scores - np.logaddexp.reduce(scores, axis=1, keepdims=True)
    answers = log_probs.argmax(1)
    return answers, log_probs[np.arange(len(answers)), answers], np.exp(log_probs)
