"""Token-level ensemble decoding across models with different tokenizers (the GaC step RLAE builds on).

At every step each model's next-token distribution is mapped into the union vocabulary (:class:`UnionVocab`),
the distributions are mixed with the current weights, and one union token is picked (greedy or sampled). Each
model then extends its own context with that text: by the one token of its vocabulary that stands for exactly
those bytes when it has one, else by the text re-tokenized. Every model keeps its KV cache, so a step costs one
incremental forward per model, never a re-encode of the whole context.

The weights may change every ``span`` tokens: ``weights(span_index, text_so_far)`` is called at each span start.
That is where the RLAE agent acts; a fixed array gives the uniform (GaC) or any static ensemble.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch.nn import functional as F

from rlens.backends.hf import TransformersBackend, cut_at_stop
from rlens.rlae.vocab import UnionVocab

Weights = np.ndarray | Callable[[int, str], np.ndarray]


@dataclass
class ModelContext:
    """One model's view of the generation: its tokens, KV cache and next-token log-probabilities."""

    tokens: list[int]
    cache: object
    next_logprobs: torch.Tensor  # [V_model]
    appended: list[int] = field(default_factory=list)  # tokens added after the prompt


@dataclass
class EnsembleOutput:
    text: str  # cut before the first stop string
    union_tokens: list[int]  # every chosen token (EOS excluded); each model's context has read all of them
    span_weights: list[np.ndarray]  # the weights of each span
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    contexts: list[ModelContext]


class TokenEnsemble:
    def __init__(self, backends: list[TransformersBackend], vocab: UnionVocab | None = None):
        self.backends = backends
        self.vocab = vocab or UnionVocab.build([b.tokenizer for b in backends])

    @torch.inference_mode()
    def _feed(self, backend: TransformersBackend, ids: list[int], context: ModelContext | None) -> ModelContext:
        """Run ``ids`` through the model after ``context`` (None: from scratch); the new context."""
        tokens = (context.tokens if context else []) + ids
        if len(tokens) > backend.max_length:
            raise ValueError(f"context of {len(tokens)} tokens exceeds the model window of {backend.max_length}")
        out = backend.model(torch.tensor([ids], device=backend.device), past_key_values=context.cache if context else None, use_cache=True)
        logprobs = F.log_softmax(out.logits[0, -1].float(), -1).cpu()
        return ModelContext(tokens, out.past_key_values, logprobs, (context.appended if context else []) + (ids if context else []))

    def start(self, prompt: str) -> list[ModelContext]:
        contexts = []
        for backend in self.backends:
            ids = backend.tokenizer.encode(prompt, add_special_tokens=False) or [backend.tokenizer.eos_token_id]
            contexts.append(self._feed(backend, ids, None))
        return contexts

    def mix(self, contexts: list[ModelContext], weights: np.ndarray) -> torch.Tensor:
        """The weighted mixture of the models' next-token distributions over the union [V_union]."""
        mixed = torch.zeros(len(self.vocab))
        for m, (context, w) in enumerate(zip(contexts, weights)):
            if w > 0:
                mixed += float(w) * self.vocab.to_union(m, context.next_logprobs.exp()[None])[0]
        return mixed / mixed.sum()

    def advance(self, contexts: list[ModelContext], union_token: int) -> list[ModelContext]:
        """Every model reads the chosen union token."""
        piece = self.vocab.pieces[union_token].decode()
        advanced = []
        for m, (backend, context) in enumerate(zip(self.backends, contexts)):
            own = self.vocab.single[m].get(union_token)
            ids = [own] if own is not None else backend.tokenizer.encode(piece, add_special_tokens=False)
            advanced.append(self._feed(backend, ids, context) if ids else context)
        return advanced

    def generate(self, prompt: str, weights: Weights, max_tokens: int = 32, span: int = 8, stop: list[str] | None = None,
                 greedy: bool = True, generator: torch.Generator | None = None) -> EnsembleOutput:
        """Decode up to ``max_tokens`` union tokens; weights are (re)set every ``span`` tokens."""
        contexts = self.start(prompt)
        chosen: list[int] = []
        span_weights: list[np.ndarray] = []
        text, reason = "", "length"
        for step in range(max_tokens):
            if step % span == 0:
                w = np.asarray(weights(step // span, text) if callable(weights) else weights, dtype=np.float64)
                if w.shape != (len(self.backends),) or (w < 0).any() or w.sum() <= 0:
                    raise ValueError(f"weights must be {len(self.backends)} non-negative numbers with a positive sum, got {w}")
                span_weights.append(w / w.sum())
            mixed = self.mix(contexts, span_weights[-1])
            token = int(mixed.argmax()) if greedy else int(torch.multinomial(mixed, 1, generator=generator))
            if token == 0:  # the union EOS
                reason = "stop"
                break
            chosen.append(token)
            contexts = self.advance(contexts, token)
            text += self.vocab.pieces[token].decode()
            cut, stopped = cut_at_stop(text, stop or [])
            if stopped:
                text, reason = cut, "stop"
                break
        return EnsembleOutput(text, chosen, span_weights, reason, contexts)
