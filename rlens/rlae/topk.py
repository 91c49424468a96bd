"""The token ensemble over model servers (UniTE-style top-k union), for models that only expose top-k log-probs.

Models behind an OpenAI-compatible ``/v1/completions`` endpoint (vLLM, SGLang, llama.cpp, ``rlens serve-model``)
return the top k next tokens as text, not the full distribution. Each step asks every server for the top k next
tokens of prompt + text so far (one batched request per server, the servers in parallel). Each model's top k is
renormalised into a distribution; the token texts of all models form the token space (a text keeps one id for the
whole run) and any end-of-sequence text maps to the EOS column. The weights, spans and agent are the same as
in-process (:class:`~rlens.rlae.decode.SpanWeightedDecoder`).

What a server must provide: ``POST /v1/completions`` with a batch of text prompts, ``max_tokens`` 1,
``temperature`` 0 and ``logprobs`` k, returning ``logprobs.top_logprobs[0]`` as ``{token text: log-probability}``
(vLLM allows k up to ``--max-logprobs``, 20 by default; OpenAI itself 5). The server re-reads prompt + text at every
step, so prefix caching (vLLM ``--enable-prefix-caching``) keeps a step at about one token of compute.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from rlens.backends.openai import OpenAIBackend
from rlens.rlae.decode import SpanWeightedDecoder
from rlens.rlae.merge import DenseNext, NextTokens

EOS_TEXTS = frozenset({"", "<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>"})


@dataclass
class ServerRows:
    contexts: list[str]  # per row: prompt + text so far
    done: np.ndarray  # bool per row: finished (no more requests)


class TopKEnsemble(SpanWeightedDecoder[ServerRows]):
    def __init__(self, backends: list[OpenAIBackend], k: int = 5, eos_texts: frozenset[str] = EOS_TEXTS):
        if not 1 <= k <= 20:
            raise ValueError(f"k must be between 1 and 20 (the servers' usual limit), got {k}")
        self.backends, self.n_models, self.k, self.eos_texts = backends, len(backends), k, eos_texts
        self.pieces: list[str] = [""]  # token id -> text; 0 is the EOS
        self.ids: dict[str, int] = {}
        self.pool = ThreadPoolExecutor(len(backends))

    def _id(self, text: str) -> int:
        if text in self.eos_texts:
            return 0
        if text not in self.ids:
            self.ids[text] = len(self.pieces)
            self.pieces.append(text)
        return self.ids[text]

    def start(self, prompts: list[str]) -> ServerRows:
        return ServerRows(list(prompts), np.zeros(len(prompts), dtype=bool))

    def step(self, rows: ServerRows) -> tuple[NextTokens, np.ndarray]:
        live = np.flatnonzero(~rows.done)
        asked = [rows.contexts[i] for i in live]
        tops = list(self.pool.map(lambda backend: backend.next_token_tops(asked, self.k), self.backends))
        for text in {text for model in tops for top in model for text in top}:  # give every new text its id first
            self._id(text)
        probs = torch.zeros(self.n_models, len(rows.contexts), len(self.pieces))
        probs[:, rows.done, 0] = 1.0  # finished rows: a certain EOS (never read)
        for m, model in enumerate(tops):
            for row, top in zip(live, model):
                for text, logprob in top.items():
                    probs[m, row, self._id(text)] += float(np.exp(logprob))
        probs /= probs.sum(-1, keepdim=True)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).T.numpy()
        return DenseNext(probs), entropy

    def piece(self, token: int) -> str:
        return self.pieces[token]

    def advance(self, rows: ServerRows, tokens: list[int | None]) -> ServerRows:
        contexts = [c + self.pieces[t] if t is not None else c for c, t in zip(rows.contexts, tokens)]
        return ServerRows(contexts, rows.done | np.array([t is None for t in tokens]))
