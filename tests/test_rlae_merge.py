"""The ensemble's next-token pick (rlens.rlae.merge), hand-computed on two character tokenizers: the certified pick
among the models' top tokens is the dense argmax without a dense tensor, and rows it cannot certify (the best token
outside every model's top k, ties) are computed densely."""

import numpy as np
import pytest
import torch

from rlens.rlae.merge import DenseNext, UnionCandidates
from rlens.rlae.vocab import UnionVocab
from rlens.zoo.tokenizers import char_tokenizer


@pytest.fixture(scope="module")
def chars():
    tokenizer = char_tokenizer()
    vocab = UnionVocab.build([tokenizer, tokenizer])
    return vocab, {c: tokenizer.convert_tokens_to_ids(c) for c in "abc"}


def probs(ids: dict[str, int], **mass: float) -> torch.Tensor:
    p = torch.zeros(1, 98)
    for c, v in mass.items():
        p[0, ids[c]] = v
    return p


def union(vocab: UnionVocab, ids: dict[str, int], c: str) -> int:
    return int(vocab.index[0][ids[c]])


def no_dense(self, rows=None):
    raise AssertionError("computed densely")


def test_a_certified_pick_needs_no_dense_tensor(chars, monkeypatch):
    vocab, ids = chars
    # mixture under (0.5, 0.5): a .3, b .3, c .4; top 2 of each model: {a .5, b .3} and {c .6, b .3}, so any other
    # token scores at most .5 * .3 + .5 * .3 = .3 < .4
    nxt = UnionCandidates(vocab, [probs(ids, a=0.5, b=0.3, c=0.2), probs(ids, a=0.1, b=0.3, c=0.6)], k=2)
    monkeypatch.setattr(UnionCandidates, "dense", no_dense)
    assert nxt.pick(np.array([[0.5, 0.5]])) == [union(vocab, ids, "c")]
    assert nxt.pick(np.array([[0.9, 0.1]])) == [union(vocab, ids, "a")]  # a .46, b .3, c .24; bound .3
    # the consensus (sum) is c (.8 against .6 and .6): model 0's top token is a, model 1's is c
    assert nxt.agreement().tolist() == [[False, True]]


def test_a_pick_it_cannot_certify_is_computed_densely(chars):
    vocab, ids = chars
    # under (0.5, 0.5): a .325, b .35, c .325; with k = 1 the candidates are a and c, and b is the answer
    models = [probs(ids, a=0.4, b=0.35, c=0.25), probs(ids, a=0.25, b=0.35, c=0.4)]
    assert UnionCandidates(vocab, models, k=1).pick(np.array([[0.5, 0.5]])) == [union(vocab, ids, "b")]
    tied = [probs(ids, a=0.5, b=0.5), probs(ids, a=0.5, b=0.5)]  # a tie: the lowest union id, as argmax gives
    expected = min(union(vocab, ids, "a"), union(vocab, ids, "b"))
    assert UnionCandidates(vocab, tied, k=1).pick(np.array([[0.5, 0.5]])) == [expected]
    assert UnionCandidates(vocab, tied, k=1).agreement().tolist() == [[True, True]]


def test_the_dense_view_sums_in_model_order():
    p = torch.tensor([[[0.2, 0.8]], [[0.6, 0.4]], [[0.5, 0.5]]])  # 3 models, 1 row, 2 tokens
    nxt = DenseNext(p)
    assert nxt.pick(np.array([[0.25, 0.5, 0.25]])) == [1]  # .05 + .3 + .125 = .475 against .2 + .2 + .125 = .525
    assert nxt.pick(np.array([[0.0, 1.0, 0.0]])) == [0]
    # sum: 1.3 against 1.7, token 1; the tie of model 2 goes to 0
    assert nxt.agreement().tolist() == [[True, False, False]]
    drawn = nxt.pick(np.array([[1.0, 0.0, 0.0]]), greedy=False, generator=torch.Generator().manual_seed(0))
    assert drawn in ([0], [1])
