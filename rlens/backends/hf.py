"""The ``transformers`` backend: a local Hugging Face causal LM (CPU or CUDA) from a directory or a GGUF file.

Every text a model reads starts with its BOS token when its tokenizer puts one first by default (Gemma; see
:func:`bos_prefix`), as the model was trained. Multiple-choice scoring follows lm-evaluation-harness ``loglikelihood``:
- the context's trailing spaces move to the continuation;
- the continuation tokens are ``encode(context + continuation)[len(encode(context)):]``, with an empty context
  encoded as the BOS token, else the EOS token;
- a choice's score is the summed log-probability of its tokens, and ``is_greedy`` says whether greedy decoding
  yields exactly those tokens.

The context is run once and its KV cache is shared by every choice, whose remaining tokens go through in one
batch. A context too long for the model window is cut from the left, keeping the longest choice whole.

A GGUF file is converted once (its tensors dequantized, its vocabulary made a tokenizer: 40 s for SmolLM2 on one
core) and kept as a model directory under ``~/.cache/rlens/gguf`` (:func:`converted_gguf`); later loads read that
(seconds). Where the cache cannot be written (a read-only root) every load converts.

Generation samples ``n`` continuations (greedy at temperature 0), seeded when the request gives a seed.
:meth:`TransformersBackend.prompt_logprobs` gives every prompt token's log-probability and top tokens, which is
what ``rlens serve-model`` answers to OpenAI ``echo`` + ``logprobs`` requests.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from rlens.backends.base import (
    Backend,
    BackendError,
    ChoiceQuery,
    ChoiceScores,
    GenerationRequest,
    Generations,
    register_backend,
)
from rlens.backends.openai_protocol import Usage


def bos_prefix(tokenizer) -> list[int]:
    """``[BOS]`` when the tokenizer puts a BOS token before every text by default (Gemma, Llama), else ``[]``."""
    first = tokenizer("a").input_ids[:1]
    return first if tokenizer.bos_token_id is not None and first == [tokenizer.bos_token_id] else []


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) exactly as lm-evaluation-harness splits them."""
    prefix = bos_prefix(tokenizer)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    if not context:
        return prefix or [tokenizer.eos_token_id], tokenizer.encode(continuation, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_tokens = tokenizer.encode(context, add_special_tokens=False)
    return prefix + context_tokens, whole[len(context_tokens) :]


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to its first stop string, and whether one was found."""
    cuts = [i for i in (text.find(stop) for stop in stops if stop) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


@dataclass
class PromptLogprobs:
    """Per prompt token: text, start offset in the prompt, log-probability (None for the first), top tokens."""

    tokens: list[str]
    offsets: list[int]
    logprobs: list[float | None]
    top: list[dict[str, float] | None]
    next_token: str  # greedy next token after the prompt
    next_logprob: float
    next_top: dict[str, float]


@dataclass
class NextToken:
    """The greedy next token after a prompt, its log-probability, the top tokens, and the prompt's token count."""

    token: str
    logprob: float
    top: dict[str, float]
    prompt_tokens: int


def cache_keyword(model) -> str:
    """The name a model's forward takes and returns its key-value cache by: ``cache`` since transformers 5.24 (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


log = logging.getLogger("rlens.backends")
GGUF_CACHE = Path.home() / ".cache" / "rlens" / "gguf"


def converted_gguf(gguf: Path, dtype: torch.dtype) -> Path:
    """Where the model directory converted from ``gguf`` (this file, as it is now, with this transformers and dtype)
    is kept."""
    import transformers

    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{dtype}"
    return GGUF_CACHE / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _keep_converted(model, tokenizer, where: Path) -> bool:
    """Save a converted model for later loads (written beside, then renamed, so a reader never sees half of one);
    whether it is there now."""
    from safetensors.torch import save_model

    partial = where.with_name(f"{where.name}.partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # dequantized: transformers will not save a GGUF-loaded model itself
        (partial / "config.json").write_text(json.dumps(config, indent=1))
        save_model(model, str(partial / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(partial)
        partial.rename(where)
    except OSError as exc:  # read-only, full, or another process kept it first
        if not where.is_dir():
            log.info("the converted model is not kept (%s): the next load converts the GGUF file again", exc)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return where.is_dir()


@register_backend("transformers")
class TransformersBackend(Backend):
    def __init__(self, model, tokenizer, device: str = "cpu", max_length: int | None = None):
        """Wrap an already built causal LM and its tokenizer (see :meth:`load` for a directory or GGUF file)."""
        self.model = model.to(device).eval()
        self.cache_keyword = cache_keyword(self.model)
        self.tokenizer = tokenizer
        self.prefix = bos_prefix(tokenizer)  # read before every prompt
        self.device = device
        self.max_length = int(
            max_length
            or getattr(model.config, "max_position_embeddings", None)
            or getattr(model.config, "n_positions", None)
            or 2048
        )

    @classmethod
    def load(
        cls, path: str | Path, gguf_file: str | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> "TransformersBackend":
        """Load a local model directory (or a GGUF file inside it, converted once: :func:`converted_gguf`; a
        ``tokenizer.json`` beside it is read instead of converting the GGUF file's vocabulary); never touches the
        network."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise BackendError(f"transformers backend: {path} is not a model directory")
        converted = converted_gguf(path / gguf_file, dtype) if gguf_file and (path / gguf_file).is_file() else None
        if converted is not None and converted.is_dir():
            path, gguf_file = converted, None
        options = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(
            path, local_files_only=True, **({} if (path / "tokenizer.json").is_file() else options)
        )
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **options)
        if gguf_file and converted is not None and _keep_converted(model, tokenizer, converted):
            return cls.load(converted, None, device, dtype)  # as every later load reads it, to the last bit
        return cls(model, tokenizer, device)

    @torch.inference_mode()
    def score_choices(self, query: ChoiceQuery) -> ChoiceScores:
        pairs = [encode_pair(self.tokenizer, query.prompt, choice) for choice in query.choices]
        context = pairs[0][0]
        continuations = [c for _, c in pairs]
        if any(len(c) == 0 for c in continuations):
            raise BackendError(f"query {query.id}: a choice encodes to no tokens")
        longest = max(len(c) for c in continuations)
        room = self.max_length - (longest - 1)
        if room < 1:
            raise BackendError(
                f"query {query.id}: a choice of {longest} tokens does not fit the model window of {self.max_length}"
            )
        context = context[-room:]

        out = self.model(torch.tensor([context], device=self.device), use_cache=True, logits_to_keep=1)
        first = F.log_softmax(out.logits[0, -1].float(), -1)  # predicts every continuation's first token
        rest_logp = torch.empty(0)  # the log-probabilities of every continuation's later tokens, when there are some
        if longest > 1:
            n = len(continuations)
            pad = (
                self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            )
            rest = torch.full((n, longest - 1), pad, dtype=torch.long, device=self.device)
            for i, c in enumerate(continuations):
                rest[i, : len(c) - 1] = torch.tensor(c[:-1])
            cache = getattr(out, self.cache_keyword)
            cache.batch_repeat_interleave(n)
            positions = torch.arange(len(context), len(context) + longest - 1, device=self.device).expand(n, -1)
            mask = torch.ones(n, len(context) + longest - 1, dtype=torch.long, device=self.device)  # right padding only
            rest_logp = F.log_softmax(
                self.model(
                    rest, attention_mask=mask, position_ids=positions, **{self.cache_keyword: cache}
                ).logits.float(),
                -1,
            )

        loglikelihoods, greedy = [], []
        for i, c in enumerate(continuations):
            total, is_greedy = float(first[c[0]]), bool(first.argmax() == c[0])
            for k in range(1, len(c)):
                step = rest_logp[i, k - 1]
                total += float(step[c[k]])
                is_greedy = is_greedy and bool(step.argmax() == c[k])
            loglikelihoods.append(total)
            greedy.append(is_greedy)
        read = len(context) + sum(map(len, continuations))  # the context once (its cache is shared), every choice
        return ChoiceScores(
            loglikelihoods=loglikelihoods,
            is_greedy=greedy,
            usage=Usage(prompt_tokens=read, completion_tokens=0, total_tokens=read),
        )

    def _window_check(self, n_tokens: int, extra: int, what: str) -> None:
        if n_tokens + extra > self.max_length:
            raise BackendError(
                f"{what}: {n_tokens} prompt tokens + {extra} do not fit the model window of {self.max_length}"
            )

    @torch.inference_mode()
    def prompt_logprobs(self, texts: list[str], top: int = 1) -> list[PromptLogprobs]:
        """Log-probability of every token of each text given the tokens before it (one padded batch)."""
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        rows = encoded["input_ids"]
        if any(len(row) == 0 for row in rows):
            raise BackendError("prompt_logprobs: a prompt encodes to no tokens")
        skip = len(self.prefix)  # the BOS is read first but not reported: the first token then has a log-probability
        for row in rows:
            self._window_check(skip + len(row), 0, "prompt_logprobs")
        width = skip + max(map(len, rows))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : skip + len(row)], mask[i, : skip + len(row)] = torch.tensor(self.prefix + row), 1
        logp = F.log_softmax(self.model(ids, attention_mask=mask).logits.float(), -1).cpu()
        token_text = lambda t: self.tokenizer.decode([t])  # noqa: E731
        results = []
        for i, row in enumerate(rows):
            steps = logp[i, : skip + len(row)]  # steps[j] predicts the token after input position j
            best = steps.topk(top, -1)
            tops = [
                {token_text(int(t)): float(v) for t, v in zip(best.indices[j], best.values[j])}
                for j in range(skip + len(row))
            ]
            results.append(
                PromptLogprobs(
                    tokens=[token_text(t) for t in row],
                    offsets=[start for start, _ in encoded["offset_mapping"][i]],
                    logprobs=[float(steps[skip + j - 1, row[j]]) if skip + j > 0 else None for j in range(len(row))],
                    top=([] if skip else [None]) + tops[max(skip - 1, 0) : -1],
                    next_token=token_text(int(best.indices[-1, 0])),
                    next_logprob=float(best.values[-1, 0]),
                    next_top=tops[-1],
                )
            )
        return results

    @torch.inference_mode()
    def next_tokens(self, texts: list[str], top: int = 1) -> list[NextToken]:
        """The greedy next token after each text and its ``top`` most likely tokens: one left-padded batch and only
        the last position's logits (what a server answers to ``max_tokens`` 1 + ``logprobs`` k, at the cost of the
        prompt's forward and one row of the vocabulary head)."""
        rows = [self.prefix + self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        if any(len(row) == len(self.prefix) for row in rows):
            raise BackendError("next token: a prompt encodes to no tokens")
        for row in rows:
            self._window_check(len(row), 1, "next token")
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        logits = self.model(
            ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            logits_to_keep=1,
        ).logits[:, -1]
        best = F.log_softmax(logits.float(), -1).cpu().topk(top, -1)
        results = []
        for i, row in enumerate(rows):
            tops = {self.tokenizer.decode([int(t)]): float(v) for t, v in zip(best.indices[i], best.values[i])}
            results.append(
                NextToken(
                    self.tokenizer.decode([int(best.indices[i, 0])]),
                    float(best.values[i, 0]),
                    tops,
                    len(row) - len(self.prefix),
                )
            )
        return results

    def generate(self, request: GenerationRequest) -> Generations:
        samples, usage = self.sample(request)
        return Generations(texts=[text for text, _ in samples], usage=usage)

    @torch.inference_mode()
    def sample(self, request: GenerationRequest) -> tuple[list[tuple[str, str]], Usage]:
        """``request.n`` completions as (text, finish reason: "stop" or "length"), and the tokens read (the prompt)
        and written (each sequence up to its end of text)."""
        if request.temperature == 0 and request.n > 1:
            raise BackendError(f"query {request.id}: n > 1 needs temperature > 0 (greedy decoding gives one answer)")
        ids = self.prefix + self.tokenizer.encode(request.prompt, add_special_tokens=False) or [
            self.tokenizer.eos_token_id
        ]
        self._window_check(len(ids), request.max_tokens, f"query {request.id}")
        sampling = (
            {"do_sample": True, "temperature": request.temperature, "top_k": 0, "top_p": 1.0}
            if request.temperature > 0
            else {"do_sample": False}
        )
        with torch.random.fork_rng(devices=[] if self.device == "cpu" else None):
            if request.seed is not None:
                torch.manual_seed(request.seed)
            out = self.model.generate(
                torch.tensor([ids], device=self.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.device),
                max_new_tokens=request.max_tokens,
                num_return_sequences=request.n,
                pad_token_id=self.tokenizer.eos_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                **sampling,
            )
        results, written = [], 0
        for sequence in out[:, len(ids) :].tolist():
            ended = self.tokenizer.eos_token_id in sequence
            written += sequence.index(self.tokenizer.eos_token_id) + 1 if ended else len(sequence)
            text, stopped = cut_at_stop(self.tokenizer.decode(sequence, skip_special_tokens=True), request.stop)
            results.append((text, "stop" if stopped or ended else "length"))
        read = len(ids)
        return results, Usage(prompt_tokens=read, completion_tokens=written, total_tokens=read + written)
