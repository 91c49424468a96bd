"""RLAE foundations: the union vocabulary over the zoo's four tokenizer kinds (characters, a GPT-2 BPE subset,
SmolLM2's byte-level BPE, Gemma 3's SentencePiece with byte fallback: round trips, shared entries, mass-preserving
maps) and token-level ensemble decoding (one-hot weights reproduce each model's own greedy output token for token,
Gemma's BOS included; mixtures decode valid text)."""

import numpy as np
import pytest
import torch

from rlens.backends.hf import TransformersBackend
from rlens.rlae.decode import TokenEnsemble
from rlens.rlae.merge import DenseNext, UnionCandidates
from rlens.rlae.vocab import EOS, UnionVocab, byte_fallback_ids, token_bytes, tokenizer_kind
from rlens.zoo.build import bpe_corpus
from rlens.zoo.tokenizers import char_tokenizer, gpt2_subset_tokenizer

TEXTS = ["Q: add: 12+7=\nA: 19", "sort: d b a\nA: a b d", "  Hello, World! {x} ~ 3.5\t", "opposite of hot: cold"]


@pytest.fixture(scope="module")
def tokenizers(smollm2, gemma3):
    return [char_tokenizer(), gpt2_subset_tokenizer(bpe_corpus(per_family=50)), smollm2.tokenizer, gemma3.tokenizer]


def test_tokenizer_kinds(tokenizers):
    assert [tokenizer_kind(t) for t in tokenizers] == ["plain", "byte_level", "byte_level", "sentencepiece"]
    assert token_bytes(tokenizers[1])[tokenizers[1].convert_tokens_to_ids("Ġadd")] == b" add"
    assert token_bytes(tokenizers[3])[tokenizers[3].convert_tokens_to_ids("▁hello")] == b" hello"
    assert token_bytes(tokenizers[3])[tokenizers[3].convert_tokens_to_ids("<0x0A>")] == b"\n"


def test_prompts_start_with_the_bos_only_where_the_tokenizer_puts_one(smollm2, gemma3):
    assert gemma3.prefix == [gemma3.tokenizer.bos_token_id] and smollm2.prefix == []


def test_a_model_reads_its_regular_token_not_a_byte_fallback_one(tokenizers):
    gemma = tokenizers[3]
    vocab = UnionVocab.build(tokenizers)
    space, fallback = gemma.convert_tokens_to_ids("▁"), gemma.convert_tokens_to_ids("<0x20>")
    assert fallback in byte_fallback_ids(gemma) and space not in byte_fallback_ids(gemma)
    assert vocab.index[3][space] == vocab.index[3][fallback]  # the same bytes: one union entry, both map there
    assert vocab.single[3][int(vocab.index[3][space])] == space  # and Gemma reads "▁", as its tokenizer writes a space
    assert byte_fallback_ids(tokenizers[2]) == set()


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
    char, gpt2, smol, gemma = tokenizers
    assert (
        vocab.index[0][char.convert_tokens_to_ids("a")]
        == vocab.index[1][gpt2.convert_tokens_to_ids("a")]
        == vocab.index[2][smol.convert_tokens_to_ids("a")]
    )
    assert vocab.index[3][gemma.convert_tokens_to_ids("a")] == vocab.index[0][char.convert_tokens_to_ids("a")]
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


def scattered(vocab: UnionVocab, m: int, probs: torch.Tensor) -> torch.Tensor:
    """The union distribution by a dense scatter of the mapped tokens' mass, in token order."""
    mapped = vocab.index[m] >= 0
    return torch.zeros(len(probs), len(vocab)).index_add_(1, vocab.index[m][mapped], probs[:, mapped])


def test_picks_among_the_top_tokens_are_the_dense_picks(tokenizers):
    """SmolLM2 + Gemma 3 (byte-fallback entries that two Gemma tokens share) and a character model: peaked and flat
    rows, ties, random weights; the union distributions, the greedy picks and the agreements are the dense ones."""
    vocab = UnionVocab.build([tokenizers[0], tokenizers[2], tokenizers[3]])
    g = torch.Generator().manual_seed(0)
    space = int(vocab.index[2][tokenizers[3].convert_tokens_to_ids("▁")])
    for temperature in (0.5, 2.0, 30.0):  # peaked, softer, nearly flat (mostly decided densely)
        probs = [
            torch.softmax(torch.randn(8, len(vocab.index[m]), generator=g) * 12 / temperature, -1) for m in range(3)
        ]
        probs[2][0] = 0.0
        probs[2][0, tokenizers[3].convert_tokens_to_ids("▁")] = probs[2][
            0, tokenizers[3].convert_tokens_to_ids("<0x20>")
        ] = 0.5  # one entry, two tokens
        dense = DenseNext(torch.stack([scattered(vocab, m, p) for m, p in enumerate(probs)]))
        for m, p in enumerate(probs):
            assert torch.equal(vocab.to_union(m, p), dense.probs[m])
        candidates = UnionCandidates(vocab, probs, k=8)
        assert dense.probs[2][0, space] == 1.0 and candidates.pick(np.array([[0.1, 0.1, 0.8]] * 8))[0] == space
        for _ in range(4):
            weights = torch.rand(8, 3, generator=g).double().numpy()
            weights[0] = [0.0, 1.0, 0.0]
            assert candidates.pick(weights) == dense.pick(weights)
        np.testing.assert_array_equal(candidates.agreement(), dense.agreement())


def greedy_tokens(backend: TransformersBackend, prompt: str, n: int) -> list[int]:
    ids = backend.tokenizer(prompt).input_ids  # the tokenizer's own special tokens: Gemma's BOS, nothing for the others
    assert ids[-1] != backend.tokenizer.eos_token_id
    out = backend.model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=backend.tokenizer.eos_token_id,
        eos_token_id=backend.tokenizer.eos_token_id,
    )
    tokens = out[0, len(ids) :].tolist()
    return (
        tokens[: tokens.index(backend.tokenizer.eos_token_id)] if backend.tokenizer.eos_token_id in tokens else tokens
    )


def test_one_hot_weights_reproduce_each_models_greedy_output(quick_zoo, smollm2, gemma3):
    """In a batch (one prompt alone decodes what its batch row does: the next test)."""
    backends = [
        TransformersBackend.load(quick_zoo / "arith-char"),
        TransformersBackend.load(quick_zoo / "count-bpe"),
        smollm2,
        gemma3,
    ]
    ensemble = TokenEnsemble(backends)
    prompts = ["Q: add: 12+7=\nA:", "Question: What is the capital of France?\nAnswer:", "3 + 4 = 7\n12 + 5 ="]
    for m, backend in enumerate(backends):
        for batched, prompt in zip(
            ensemble.generate_batch(prompts, np.eye(len(backends))[m], max_tokens=12, span=4), prompts
        ):
            expected = greedy_tokens(backend, prompt, 12)
            assert [ensemble.vocab.single[m][u] for u in batched.union_tokens] == expected  # token for token
            assert batched.text == backend.tokenizer.decode(expected)
            # the last token of a cut-off output is not read
            assert batched.appended[m] == (expected if batched.finish_reason == "stop" else expected[:-1])


def read_text(ensemble: TokenEnsemble, out) -> str:
    """The text every model has read: all the chosen tokens, but the last one when the output was cut at max_tokens."""
    pieces = [ensemble.vocab.pieces[u] for u in out.union_tokens]
    return b"".join(pieces if out.finish_reason == "stop" else pieces[:-1]).decode()


def test_mixed_weights_decode_text_every_model_has_read(quick_zoo, smollm2):
    backends = [TransformersBackend.load(quick_zoo / "arith-char"), smollm2]
    ensemble = TokenEnsemble(backends)
    views = []
    out = ensemble.generate(
        "The capital of France is", lambda view: views.append(view) or np.array([0.3, 0.7]), max_tokens=10, span=4
    )
    pieces = [ensemble.vocab.pieces[u] for u in out.union_tokens]
    assert len(views) == len(out.span_weights) >= 2
    for k, view in enumerate(views):  # the weights of span k are chosen seeing the text of the first 4k tokens
        assert view.index == k and view.texts == [b"".join(pieces[: 4 * k]).decode()]
        assert view.entropy.shape == view.agreement.shape == (1, 2)
    assert out.text == b"".join(pieces).decode()
    for m, backend in enumerate(backends):  # every model's context holds the generated text, in its own tokens
        assert backend.tokenizer.decode(out.appended[m]) == read_text(ensemble, out)
    with pytest.raises(ValueError, match="non-negative"):
        ensemble.generate("x", np.array([-1.0, 2.0]), max_tokens=2)


def test_a_batch_decodes_what_each_prompt_decodes_alone(quick_zoo, smollm2):
    """Rows of different lengths, re-tokenized pieces and early finishers share one padded batch per model."""
    backends = [
        TransformersBackend.load(quick_zoo / "arith-char"),
        TransformersBackend.load(quick_zoo / "pattern-bpe"),
        smollm2,
    ]
    ensemble = TokenEnsemble(backends)
    prompts = [
        "Q: add: 3+4=\nA:",
        "The capital of France is",
        "Q: next: 2 4 6\nA:",
        "Once upon a time, in a land far away, there",
        "Hi",
    ]
    weights = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.6, 0.2], [0.3, 0.3, 0.4], [1.0, 0.0, 0.0]])
    batch = ensemble.generate_batch(prompts, weights, max_tokens=14, span=4, stop=["\n"])
    for i, prompt in enumerate(prompts):
        alone = ensemble.generate(prompt, weights[i], max_tokens=14, span=4, stop=["\n"])
        assert (batch[i].text, batch[i].union_tokens, batch[i].finish_reason) == (
            alone.text,
            alone.union_tokens,
            alone.finish_reason,
        )
        assert batch[i].appended == alone.appended


def test_a_models_context_is_read_before_every_prompt_by_that_model_only(quick_zoo, smollm2):
    """``contexts``: a general LLM reads solved examples first, the specialist reads the bare prompt."""
    arith = TransformersBackend.load(quick_zoo / "arith-char")
    shots = "3 + 4 = 7\n10 + 5 = 15\n"
    prompts = ["12 + 5 =", "2 + 2 ="]
    with_context = TokenEnsemble([arith, smollm2], contexts=["", shots])
    plain = TokenEnsemble([arith, smollm2])
    for m, context in enumerate(["", shots]):  # one-hot weights: each model's own greedy output on what it reads
        one_hot = np.eye(2)[m]
        got = with_context.generate_batch(prompts, one_hot, max_tokens=6, span=4)
        expected = plain.generate_batch([context + p for p in prompts], one_hot, max_tokens=6, span=4)
        assert [o.union_tokens for o in got] == [o.union_tokens for o in expected]
    assert [o.text for o in got] != [o.text for o in plain.generate_batch(prompts, np.eye(2)[1], max_tokens=6, span=4)]
    with pytest.raises(ValueError, match="one per model"):
        TokenEnsemble([arith, smollm2], contexts=[shots])


def test_span_statistics_are_each_models_entropy_and_agreement(quick_zoo):
    backend = TransformersBackend.load(quick_zoo / "order-char")
    ensemble = TokenEnsemble([backend, backend])
    views = []
    ensemble.generate(
        "Q: sort: c a b\nA:", lambda view: views.append(view) or np.array([0.5, 0.5]), max_tokens=4, span=4
    )
    ids = backend.tokenizer.encode("Q: sort: c a b\nA:", add_special_tokens=False)
    with torch.no_grad():
        logprobs = torch.log_softmax(backend.model(torch.tensor([ids])).logits[0, -1], -1)
    first = float(-(logprobs.exp() * logprobs).sum())
    # span 0: the prompt's next-token distribution
    np.testing.assert_allclose(views[0].entropy, [[first, first]], rtol=1e-4)
    np.testing.assert_array_equal(views[0].agreement, [[1.0, 1.0]])  # two copies of one model always agree
