"""RLAE foundations: the union vocabulary over the zoo's three tokenizer kinds (round trips, shared entries,
mass-preserving maps) and token-level ensemble decoding (one-hot weights reproduce each model's own greedy
output token for token; mixtures decode valid text)."""

import numpy as np
import pytest
import torch

from rlens.backends.hf import TransformersBackend
from rlens.rlae.decode import TokenEnsemble
from rlens.rlae.vocab import EOS, UnionVocab, token_bytes, tokenizer_kind
from rlens.zoo.build import SMOLLM2_GGUF, bpe_corpus, smollm2_dir
from rlens.zoo.tokenizers import char_tokenizer, gpt2_subset_tokenizer

TEXTS = ["Q: add: 12+7=\nA: 19", "sort: d b a\nA: a b d", "  Hello, World! {x} ~ 3.5\t", "opposite of hot: cold"]


@pytest.fixture(scope="module")
def smollm2():
    return TransformersBackend.load(smollm2_dir(), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def tokenizers(smollm2):
    return [char_tokenizer(), gpt2_subset_tokenizer(bpe_corpus(per_family=50)), smollm2.tokenizer]


def test_tokenizer_kinds(tokenizers):
    assert [tokenizer_kind(t) for t in tokenizers] == ["plain", "byte_level", "byte_level"]
    assert token_bytes(tokenizers[1])[tokenizers[1].convert_tokens_to_ids("Ġadd")] == b" add"


def test_union_round_trips_text_for_every_zoo_tokenizer(tokenizers):
    vocab = UnionVocab.build(tokenizers)
    for m, tokenizer in enumerate(tokenizers):
        for text in TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            union = vocab.index[m][ids]
            assert (union > 0).all(), (m, text)
            assert b"".join(vocab.pieces[u] for u in union.tolist()) == text.encode()


def test_same_bytes_share_one_union_entry_and_eos_is_shared(tokenizers):
    vocab = UnionVocab.build(tokenizers)
    char, gpt2, smol = tokenizers
    assert vocab.index[0][char.convert_tokens_to_ids("a")] == vocab.index[1][gpt2.convert_tokens_to_ids("a")] == vocab.index[2][smol.convert_tokens_to_ids("a")]
    assert vocab.pieces[int(vocab.index[2][smol.convert_tokens_to_ids("Ġhello")])] == b" hello"
    assert all(int(vocab.index[m][t.eos_token_id]) == 0 for m, t in enumerate(tokenizers)) and vocab.pieces[0] == EOS
    assert len(vocab) < sum(len(t) for t in tokenizers)  # shared entries


def test_to_union_keeps_the_mass_of_mapped_tokens(tokenizers):
    vocab = UnionVocab.build(tokenizers)
    probs = torch.softmax(torch.randn(3, len(tokenizers[1]), generator=torch.Generator().manual_seed(0)), -1)
    union = vocab.to_union(1, probs)
    mapped = vocab.index[1] >= 0
    assert union.shape == (3, len(vocab))
    torch.testing.assert_close(union.sum(1), probs[:, mapped].sum(1))


def greedy_tokens(backend: TransformersBackend, prompt: str, n: int) -> list[int]:
    ids = backend.tokenizer.encode(prompt, add_special_tokens=False)
    out = backend.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n, do_sample=False,
                                 pad_token_id=backend.tokenizer.eos_token_id, eos_token_id=backend.tokenizer.eos_token_id)
    tokens = out[0, len(ids):].tolist()
    return tokens[: tokens.index(backend.tokenizer.eos_token_id)] if backend.tokenizer.eos_token_id in tokens else tokens


def test_one_hot_weights_reproduce_each_models_greedy_output(quick_zoo, smollm2):
    backends = [TransformersBackend.load(quick_zoo / "arith-char"), TransformersBackend.load(quick_zoo / "count-bpe"), smollm2]
    ensemble = TokenEnsemble(backends)
    for prompt in ["Q: add: 12+7=\nA:", "Question: What is the capital of France?\nAnswer:"]:
        for m, backend in enumerate(backends):
            out = ensemble.generate(prompt, np.eye(len(backends))[m], max_tokens=12, span=4)
            expected = greedy_tokens(backend, prompt, 12)
            assert [ensemble.vocab.single[m][u] for u in out.union_tokens] == expected  # token for token, same length
            assert out.contexts[m].appended == expected
            assert out.text == backend.tokenizer.decode(expected)


def test_mixed_weights_decode_text_every_model_has_read(quick_zoo, smollm2):
    backends = [TransformersBackend.load(quick_zoo / "arith-char"), smollm2]
    ensemble = TokenEnsemble(backends)
    calls = []
    out = ensemble.generate("The capital of France is", lambda span, text: calls.append((span, text)) or np.array([0.3, 0.7]), max_tokens=10, span=4)
    pieces = [ensemble.vocab.pieces[u] for u in out.union_tokens]
    generated = b"".join(pieces).decode()
    assert len(calls) == len(out.span_weights) >= 2
    for k, (span, text) in enumerate(calls):  # the weights of span k are chosen seeing the text of the first 4k tokens
        assert span == k and text == b"".join(pieces[: 4 * k]).decode()
    assert out.text == generated
    for m, backend in enumerate(backends):  # every model's context holds exactly the generated text, in its own tokens
        assert backend.tokenizer.decode(out.contexts[m].appended) == generated
    with pytest.raises(ValueError, match="non-negative"):
        ensemble.generate("x", np.array([-1.0, 2.0]), max_tokens=2)
