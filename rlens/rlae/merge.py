"""The ensemble's next token from every model's next-token distribution (pure torch): the mixture's pick and each
model's agreement with the pool, from a dense union tensor or from each model's top tokens, with the same result.

- :class:`DenseNext`: the distributions over the union's token space [M, B, U] (the server path's small token space).
- :class:`UnionCandidates`: each model's distribution in its own vocabulary (the in-process path, where U is the
  union vocabulary: 264,706 entries for SmolLM2 + Gemma 3). The greedy pick is searched among the union of every
  model's top ``k`` tokens and certified: a token outside them has at most model m's k-th largest probability t_m
  under every model, so it scores at most Σ_m w_m t_m, and the best candidate is the dense argmax when it scores
  strictly more. Rows that are not certified (flat distributions), and sampled picks, are computed densely. Float
  rounding is monotone and both views run the same operations, so the certified pick is the dense one bit for bit.

Ties go to the lowest union id, as ``argmax`` does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from rlens.rlae.vocab import UnionVocab


def mixture(probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_m w_m p_m of [M, B, ...] distributions under [B, M] weights, unnormalised, summed in model order (the one
    float recipe of every pick)."""
    shape = (-1,) + (1,) * (probs.dim() - 2)
    mixed = probs[0] * weights[:, 0].reshape(shape)
    for m in range(1, len(probs)):
        mixed = mixed + probs[m] * weights[:, m].reshape(shape)
    return mixed


class NextTokens(ABC):
    """Every model's next-token distribution for a batch of rows."""

    @abstractmethod
    def agreement(self) -> np.ndarray:
        """bool [B, M]: model m's most likely token is the pool's consensus (the argmax of the summed distributions)."""

    @abstractmethod
    def pick(self, weights: np.ndarray, greedy: bool = True, generator: torch.Generator | None = None) -> list[int]:
        """Each row's token under [B, M] weights: the mixture's argmax, or a sample from it."""


class DenseNext(NextTokens):
    def __init__(self, probs: torch.Tensor):
        self.probs = probs  # [M, B, U]

    def agreement(self) -> np.ndarray:
        ones = torch.ones(self.probs.shape[1], len(self.probs), dtype=self.probs.dtype)
        return (self.probs.argmax(-1) == mixture(self.probs, ones).argmax(-1)).T.numpy()

    def pick(self, weights: np.ndarray, greedy: bool = True, generator: torch.Generator | None = None) -> list[int]:
        mixed = mixture(self.probs, torch.as_tensor(weights, dtype=self.probs.dtype))
        return (mixed.argmax(1) if greedy else torch.multinomial(mixed, 1, generator=generator)[:, 0]).tolist()


class UnionCandidates(NextTokens):
    def __init__(self, vocab: UnionVocab, probs: list[torch.Tensor], k: int = 16):
        """``probs``: each model's next-token probabilities over its own vocabulary [B, V_m]."""
        self.vocab, self.batch = vocab, len(probs[0])
        self.merged = [vocab.merged(m, p) for m, p in enumerate(probs)]
        tops = [x[:, :-1].topk(min(k, x.shape[1] - 1), dim=1) for x in self.merged]
        self.top_values = [t.values for t in tops]  # [B, k] each: the model's k largest union-entry probabilities
        # their union ids (a zero-mass slot: any id)
        self.top_union = [vocab.index[m][t.indices].clamp_min(0) for m, t in enumerate(tops)]
        self.candidates = torch.cat(self.top_union, 1)  # [B, M k]
        # [M, B, M k]
        self.scores = torch.stack([x.gather(1, vocab.inverse[m][self.candidates]) for m, x in enumerate(self.merged)])
        self.cutoff = torch.stack([v[:, -1:] for v in self.top_values])  # [M, B, 1]: what any other token has at most

    def dense(self, rows: torch.Tensor | slice = slice(None)) -> DenseNext:
        """The distributions of ``rows`` over the whole union [M, b, U]."""
        return DenseNext(
            torch.stack([x[rows].index_select(1, self.vocab.inverse[m]) for m, x in enumerate(self.merged)])
        )

    def _best(self, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the lowest union id of each row's best candidate under ``weights``, whether nothing else can score as much)."""
        scores, bound = mixture(self.scores, weights), mixture(self.cutoff, weights)[:, 0]
        best = scores.max(1, keepdim=True).values
        token = torch.where(scores == best, self.candidates, len(self.vocab)).min(1).values
        return token, best[:, 0] > bound

    def agreement(self) -> np.ndarray:
        ones = torch.ones(self.batch, len(self.merged), dtype=self.scores.dtype)
        consensus, sure = self._best(ones)
        tops = []
        for values, union in zip(self.top_values, self.top_union):
            tops.append(torch.where(values == values[:, :1], union, len(self.vocab)).min(1).values)
            sure &= values[:, -1] < values[:, 0]  # every token tied for the top is among the k
        agree = torch.stack(tops, 1) == consensus[:, None]
        unsure = torch.nonzero(~sure)[:, 0]
        if len(unsure):
            agree[unsure] = torch.from_numpy(self.dense(unsure).agreement())
        return agree.numpy()

    def pick(self, weights: np.ndarray, greedy: bool = True, generator: torch.Generator | None = None) -> list[int]:
        w = torch.as_tensor(weights, dtype=self.scores.dtype)
        if not greedy:
            return self.dense().pick(weights, greedy, generator)
        token, sure = self._best(w)
        unsure = torch.nonzero(~sure)[:, 0]
        if len(unsure):
            token[unsure] = torch.tensor(self.dense(unsure).pick(w[unsure].numpy()))
        return token.tolist()
