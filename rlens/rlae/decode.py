"""Token-level ensemble decoding across models with different tokenizers (the GaC step RLAE builds on), batched.

At every step each model's next-token distribution is read over the union vocabulary (:class:`UnionVocab`), the
distributions are mixed with the current weights, and one union token is picked per request (greedy or sampled;
:mod:`rlens.rlae.merge` finds the greedy pick among the models' top tokens, without a dense [M, B, V_union] tensor).
Each model then extends its own context with that text: by the one token of its vocabulary that stands
for exactly those bytes when it has one, else by the text re-tokenized. Every model keeps one KV cache for the whole
batch, so a step costs one incremental forward per model, never a re-encode of the context.

Requests in a batch may read different numbers of tokens at a step (re-tokenization, finished requests). The
shorter rows are left-padded inside the step; the attention mask hides the padding and explicit position ids count
only real tokens, so every row computes what it would compute alone.

The weights may change every ``span`` tokens: at each span start ``weights(view)`` gets a :class:`SpanView` (the
texts so far and cheap statistics of the last span) and returns [B, M] weights. That is where the RLAE agent acts;
a fixed array gives the uniform (GaC) or any static ensemble.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

import numpy as np
import torch
from torch.nn import functional as F

from rlens.backends.hf import TransformersBackend, cut_at_stop
from rlens.rlae.merge import NextTokens, UnionCandidates
from rlens.rlae.vocab import UnionVocab


@dataclass
class ModelState:
    """One model's view of a batch of generations."""

    cache: object
    mask: torch.Tensor  # long [B, T]: 1 where the cache holds a real token, 0 where it holds padding
    next_logprobs: torch.Tensor  # float [B, V_model], on the CPU
    lengths: list[int]  # real tokens per row
    appended: list[list[int]]  # per row: the tokens read after the prompt


@dataclass
class SpanView:
    """What the weights callback sees at the start of span ``index``."""

    index: int
    texts: list[str]  # per request: the text generated so far
    active: np.ndarray  # bool [B]: still generating (the weights of finished rows are ignored)
    entropy: np.ndarray  # [B, M]: mean entropy (nats) of each model's next-token distributions over the last span
    agreement: np.ndarray  # [B, M]: share of those steps where the model's top token was the pool's consensus top token


Weights = np.ndarray | Callable[[SpanView], np.ndarray]


@dataclass
class EnsembleOutput:
    text: str  # cut before the first stop string
    union_tokens: list[int]  # every chosen token (EOS excluded)
    span_weights: list[np.ndarray]  # the weights of each span
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    appended: list[list[int]]  # per model: the tokens it read after the prompt (the generated text, in its tokens)


State = TypeVar("State")  # a decoder's view of a batch of generations


class SpanWeightedDecoder(ABC, Generic[State]):
    """The decoding loop shared by the in-process ensemble and the server (top-k) one.

    Subclasses say how to start a batch, what every model's next-token distribution over a common token space is
    (:meth:`step`: the EOS at token 0, and each model's entropy), what text a token stands for, and how every model
    reads the chosen tokens.
    """

    n_models: int

    @abstractmethod
    def start(self, prompts: list[str]) -> State: ...

    @abstractmethod
    def step(self, states: State) -> tuple[NextTokens, np.ndarray]:
        """(every model's next-token distribution, their entropies [B, M])."""

    @abstractmethod
    def piece(self, token: int) -> str: ...

    @abstractmethod
    def advance(self, states: State, tokens: list[int | None]) -> State:
        """Every model reads each row's chosen token (None: the row reads nothing)."""

    def appended(self, states: State, row: int) -> list[list[int]]:
        """Per model, the tokens row ``row`` read after its prompt (empty where a model's tokens are not known here)."""
        return [[] for _ in range(self.n_models)]

    @staticmethod
    def _check_weights(w: np.ndarray, batch: int, n_models: int) -> np.ndarray:
        w = (
            np.broadcast_to(np.asarray(w, dtype=np.float64), (batch, n_models))
            if np.ndim(w) == 1
            else np.asarray(w, dtype=np.float64)
        )
        if w.shape != (batch, n_models) or (w < 0).any() or (w.sum(1) <= 0).any():
            raise ValueError(
                f"weights must be [{batch}, {n_models}] (or [{n_models}]) non-negative numbers with a positive sum per row, got shape {w.shape}"
            )
        return w / w.sum(1, keepdims=True)

    def generate_batch(
        self,
        prompts: list[str],
        weights: Weights,
        max_tokens: int = 32,
        span: int = 8,
        stop: list[str] | None = None,
        greedy: bool = True,
        generator: torch.Generator | None = None,
    ) -> list[EnsembleOutput]:
        """Decode up to ``max_tokens`` tokens per prompt; the weights are (re)set every ``span`` tokens."""
        if span < 1:
            raise ValueError(f"span must be at least 1 token, got {span}")
        batch, n_models = len(prompts), self.n_models
        states = self.start(prompts)
        chosen: list[list[int]] = [[] for _ in prompts]
        span_weights: list[list[np.ndarray]] = [[] for _ in prompts]
        texts, reasons = [""] * batch, ["length"] * batch
        active = np.ones(batch, dtype=bool)
        entropy_sum, agree_sum, steps_in_span = np.zeros((batch, n_models)), np.zeros((batch, n_models)), 0
        w = np.full((batch, n_models), 1.0 / n_models)  # set at step 0, the first span's start
        for step in range(max_tokens):
            next_tokens, entropy = self.step(states)
            entropy_sum += entropy
            agree_sum += next_tokens.agreement()
            steps_in_span += 1
            if step % span == 0:
                view = SpanView(
                    step // span, list(texts), active.copy(), entropy_sum / steps_in_span, agree_sum / steps_in_span
                )
                w = self._check_weights(weights(view) if callable(weights) else weights, batch, n_models)
                for i in np.flatnonzero(active):
                    span_weights[i].append(w[i])
                entropy_sum[:], agree_sum[:], steps_in_span = 0.0, 0.0, 0
            tokens = next_tokens.pick(w, greedy, generator)
            feed: list[int | None] = [None] * batch
            for i in np.flatnonzero(active):
                if tokens[i] == 0:  # the EOS
                    reasons[i], active[i] = "stop", False
                    continue
                chosen[i].append(tokens[i])
                texts[i] += self.piece(tokens[i])
                cut, stopped = cut_at_stop(texts[i], stop or [])
                if stopped:
                    texts[i], reasons[i], active[i] = cut, "stop", False
                feed[i] = tokens[i]
            if not active.any() or step == max_tokens - 1:
                break
            states = self.advance(states, [u if active[i] else None for i, u in enumerate(feed)])
        return [
            EnsembleOutput(texts[i], chosen[i], span_weights[i], reasons[i], self.appended(states, i))
            for i in range(batch)
        ]

    def generate(self, prompt: str, weights: Weights, **options) -> EnsembleOutput:
        """One prompt (see :meth:`generate_batch`)."""
        return self.generate_batch([prompt], weights, **options)[0]


class TokenEnsemble(SpanWeightedDecoder[list[ModelState]]):
    """In-process models: full next-token distributions over the union vocabulary, one KV cache per model."""

    def __init__(
        self, backends: list[TransformersBackend], vocab: UnionVocab | None = None, contexts: list[str] | None = None
    ):
        """``contexts[m]``: text model ``m`` reads before every prompt (e.g. solved examples for a general LLM
        among specialists of the prompt's format); none by default."""
        if contexts is not None and len(contexts) != len(backends):
            raise ValueError(f"{len(contexts)} contexts for {len(backends)} models: give one per model ('' for none)")
        self.backends, self.n_models = backends, len(backends)
        self.contexts = contexts or [""] * len(backends)
        self.vocab = vocab or UnionVocab.build([b.tokenizer for b in backends])
        self.pad_ids = [
            b.tokenizer.pad_token_id if b.tokenizer.pad_token_id is not None else b.tokenizer.eos_token_id
            for b in backends
        ]
        self._retokenized: list[dict[int, list[int]]] = [{} for _ in backends]
        self.model_seconds = [0.0] * len(backends)  # time spent in each model's forward passes (for cost figures)

    @torch.inference_mode()
    def _feed(self, m: int, rows: list[list[int]], state: ModelState | None) -> ModelState:
        """Model ``m`` reads ``rows[i]`` after row i of ``state`` (None: from scratch); the new state."""
        backend, width = self.backends[m], max(map(len, rows))
        if state is not None and width == 0:
            return state
        lengths = [(state.lengths[i] if state else 0) + len(row) for i, row in enumerate(rows)]
        if max(lengths) > backend.max_length:
            raise ValueError(
                f"context of {max(lengths)} tokens exceeds the window of {backend.max_length} tokens of model {m}"
            )
        ids = torch.full((len(rows), width), self.pad_ids[m], dtype=torch.long)
        new_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            if row:
                ids[i, width - len(row) :], new_mask[i, width - len(row) :] = torch.tensor(row), 1
        mask = new_mask if state is None else torch.cat([state.mask, new_mask], 1)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -width:]
        started = time.perf_counter()
        out = backend.model(
            input_ids=ids.to(backend.device),
            attention_mask=mask.to(backend.device),
            position_ids=positions.to(backend.device),
            **{backend.cache_keyword: state.cache if state else None},
            use_cache=True,
            logits_to_keep=1,  # only the next token's logits
        )
        logprobs = F.log_softmax(out.logits[:, -1].float(), -1).cpu()
        self.model_seconds[m] += time.perf_counter() - started
        if state is None:
            return ModelState(getattr(out, backend.cache_keyword), mask, logprobs, lengths, [[] for _ in rows])
        fed = torch.tensor([len(row) > 0 for row in rows])
        return ModelState(
            getattr(out, backend.cache_keyword),
            mask,
            logprobs if fed.all() else torch.where(fed[:, None], logprobs, state.next_logprobs),
            lengths,
            [before + row for before, row in zip(state.appended, rows)],
        )

    def start(self, prompts: list[str]) -> list[ModelState]:
        states = []
        for m, backend in enumerate(self.backends):
            rows = [
                backend.prefix + backend.tokenizer.encode(self.contexts[m] + p, add_special_tokens=False)
                or [backend.tokenizer.eos_token_id]
                for p in prompts
            ]
            states.append(self._feed(m, rows, None))
        return states

    def _own_tokens(self, m: int, union_token: int) -> list[int]:
        """Model ``m``'s tokens for one union token: its own token of the same bytes, else the text re-tokenized."""
        own = self.vocab.single[m].get(union_token)
        if own is not None:
            return [own]
        cached = self._retokenized[m].get(union_token)
        if cached is None:
            cached = self._retokenized[m][union_token] = self.backends[m].tokenizer.encode(
                self.vocab.pieces[union_token].decode(), add_special_tokens=False
            )
        return cached

    def advance(self, states: list[ModelState], union_tokens: list[int | None]) -> list[ModelState]:
        return [
            self._feed(m, [self._own_tokens(m, u) if u is not None else [] for u in union_tokens], state)
            for m, state in enumerate(states)
        ]

    def own_probs(self, states: list[ModelState]) -> list[torch.Tensor]:
        """Every model's next-token probabilities over its own vocabulary [B, V_m]."""
        return [state.next_logprobs.exp() for state in states]

    def step(self, states: list[ModelState]) -> tuple[NextTokens, np.ndarray]:
        probs = self.own_probs(states)
        entropy = torch.stack([-(p * s.next_logprobs.nan_to_num(neginf=0.0)).sum(-1) for p, s in zip(probs, states)], 1)
        return UnionCandidates(self.vocab, probs), entropy.numpy()

    def piece(self, token: int) -> str:
        return self.vocab.pieces[token].decode()

    def appended(self, states: list[ModelState], row: int) -> list[list[int]]:
        return [s.appended[row] for s in states]
