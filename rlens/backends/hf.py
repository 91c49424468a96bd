"""The ``transformers`` backend: a local Hugging Face causal LM (CPU or CUDA) from a directory or a GGUF file.

Multiple-choice scoring follows lm-evaluation-harness ``loglikelihood``:
- the context's trailing spaces move to the continuation;
- the continuation tokens are ``encode(context + continuation)[len(encode(context)):]``, with an empty context
  encoded as the EOS token;
- a choice's score is the summed log-probability of its tokens, and ``is_greedy`` says whether greedy decoding
  yields exactly those tokens.

The context is run once and its KV cache is shared by every choice, whose remaining tokens go through in one
batch. A context too long for the model window is cut from the left, keeping the longest choice whole.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F

from rlens.backends.base import Backend, BackendError, ChoiceQuery, ChoiceScores, register_backend


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) exactly as lm-evaluation-harness splits them."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    if not context:
        return [tokenizer.eos_token_id], tokenizer.encode(continuation, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_tokens = tokenizer.encode(context, add_special_tokens=False)
    return context_tokens, whole[len(context_tokens) :]


@register_backend("transformers")
class TransformersBackend(Backend):
    def __init__(self, model, tokenizer, device: str = "cpu", max_length: int | None = None):
        """Wrap an already built causal LM and its tokenizer (see :meth:`load` for a directory or GGUF file)."""
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 2048)

    @classmethod
    def load(cls, path: str | Path, gguf_file: str | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "TransformersBackend":
        """Load a local model directory (or a GGUF file inside it); never touches the network."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise BackendError(f"transformers backend: {path} is not a model directory")
        options = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **options)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **options)
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
            raise BackendError(f"query {query.id}: a choice of {longest} tokens does not fit the model window of {self.max_length}")
        context = context[-room:]

        out = self.model(torch.tensor([context], device=self.device), use_cache=True)
        first = F.log_softmax(out.logits[0, -1].float(), -1)  # predicts every continuation's first token
        rest_logp = None
        if longest > 1:
            n = len(continuations)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            rest = torch.full((n, longest - 1), pad, dtype=torch.long, device=self.device)
            for i, c in enumerate(continuations):
                rest[i, : len(c) - 1] = torch.tensor(c[:-1])
            cache = out.past_key_values
            cache.batch_repeat_interleave(n)
            positions = torch.arange(len(context), len(context) + longest - 1, device=self.device).expand(n, -1)
            mask = torch.ones(n, len(context) + longest - 1, dtype=torch.long, device=self.device)  # right padding only
            rest_logp = F.log_softmax(self.model(rest, past_key_values=cache, attention_mask=mask, position_ids=positions).logits.float(), -1)

        loglikelihoods, greedy = [], []
        for i, c in enumerate(continuations):
            total, is_greedy = float(first[c[0]]), bool(first.argmax() == c[0])
            for k in range(1, len(c)):
                step = rest_logp[i, k - 1]
                total += float(step[c[k]])
                is_greedy = is_greedy and bool(step.argmax() == c[k])
            loglikelihoods.append(total)
            greedy.append(is_greedy)
        return ChoiceScores(loglikelihoods=loglikelihoods, is_greedy=greedy)
