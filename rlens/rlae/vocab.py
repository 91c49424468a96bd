"""The union vocabulary of several tokenizers (GaC-style), keyed by the bytes each token stands for.

Each token is read as its bytes:
- byte-level BPE (``Ġ`` marks a space, ``Ċ`` a newline): GPT-2's byte↔unicode table;
- SentencePiece: ``▁`` is a space, ``<0x0A>`` is byte 0x0A;
- any other (e.g. characters): the token string as UTF-8.

Tokens with the same bytes in several models share one union entry. Special tokens have no bytes and are left out,
except each model's EOS, which maps to the union's own :data:`EOS` entry. Tokens that are not valid UTF-8 on their
own (pieces of a multi-byte character) are left out too, so every union token is text that every model can read.
A model's map into the union is a sparse one-hot matrix [V_model, V_union], stored as its column index per row
(-1: no column), with its inverse (each entry's first token of that model) to read a distribution in union order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from rlens.zoo.tokenizers import byte_to_unicode

EOS = b"<|union-eos|>"
SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def tokenizer_kind(tokenizer) -> str:
    """``byte_level``, ``sentencepiece`` or ``plain``, from the fast tokenizer's decoder."""
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    if "ByteLevel" in kinds:
        return "byte_level"
    if (
        "ByteFallback" in kinds
        or "Metaspace" in kinds
        or any(d.get("pattern", {}).get("String") == "▁" for d in decoder.get("decoders", []))
    ):
        return "sentencepiece"
    return "plain"


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes every token id stands for; None for special tokens."""
    kind = tokenizer_kind(tokenizer)
    from_unicode = {ch: b for b, ch in byte_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    out: list[bytes | None] = []
    for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token_id in special or token is None:
            out.append(None)
        elif kind == "byte_level":
            out.append(
                bytes(from_unicode[ch] for ch in token) if all(ch in from_unicode for ch in token) else token.encode()
            )
        elif kind == "sentencepiece":
            match = SP_BYTE.match(token)
            out.append(bytes([int(match[1], 16)]) if match else token.replace("▁", " ").encode())
        else:
            out.append(token.encode())
    return out


def byte_fallback_ids(tokenizer) -> set[int]:
    """The ids of a SentencePiece tokenizer's byte-fallback tokens (``<0x20>``...), which repeat the bytes of
    regular tokens (``▁``) that the model reads in ordinary text."""
    if tokenizer_kind(tokenizer) != "sentencepiece":
        return set()
    return {
        i
        for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
        if token and SP_BYTE.match(token)
    }


def _readable(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return len(piece) > 0
    except UnicodeDecodeError:
        return False


@dataclass
class UnionVocab:
    pieces: list[bytes]  # union id -> bytes (EOS at index 0)
    index: list[torch.Tensor]  # per model: long [V_model], the union id of each token or -1
    # per model: union id -> that model's token id standing for exactly those bytes (its first regular one)
    single: list[dict[int, int]]
    # per model: long [V_union], the model's first token of each union entry, or V_model (none)
    inverse: list[torch.Tensor]
    # per model: (its other tokens of an entry, that entry's first token)
    duplicates: list[tuple[torch.Tensor, torch.Tensor]]
    unmapped: list[torch.Tensor]  # per model: its tokens with no union entry

    @classmethod
    def build(cls, tokenizers: list) -> "UnionVocab":
        pieces: list[bytes] = [EOS]
        ids: dict[bytes, int] = {EOS: 0}
        index, single = [], []
        for tokenizer in tokenizers:
            column = torch.full((len(tokenizer),), -1, dtype=torch.long)
            own: dict[int, int] = {}
            fallback = byte_fallback_ids(tokenizer)
            for token_id, piece in enumerate(token_bytes(tokenizer)):
                if token_id == tokenizer.eos_token_id:
                    column[token_id] = 0
                    own[0] = token_id
                    continue
                if piece is None or not _readable(piece):
                    continue
                if piece not in ids:
                    ids[piece] = len(pieces)
                    pieces.append(piece)
                union_id = column[token_id] = ids[piece]
                if union_id not in own or (own[union_id] in fallback and token_id not in fallback):
                    own[union_id] = (
                        token_id  # the model reads its regular token for these bytes, not a byte-fallback one
                    )
            index.append(column)
            single.append(own)
        inverse, duplicates, unmapped = [], [], []
        for column in index:
            tokens = torch.arange(len(column))
            mapped = column >= 0
            first = torch.full((len(pieces),), len(column), dtype=torch.long).scatter_reduce_(
                0, column[mapped], tokens[mapped], reduce="amin"
            )
            others = mapped & (first[column.clamp_min(0)] != tokens)
            inverse.append(first)
            duplicates.append((tokens[others], first[column[others]]))
            unmapped.append(tokens[~mapped])
        return cls(pieces, index, single, inverse, duplicates, unmapped)

    def __len__(self) -> int:
        return len(self.pieces)

    def merged(self, model: int, probs: torch.Tensor) -> torch.Tensor:
        """Model ``model``'s next-token probabilities [B, V_model] with each union entry's mass on the model's first
        token of it, [B, V_model + 1]: its other tokens of the entry and its tokens with no entry hold 0, and so does
        the last column, which stands for the entries the model has no token for."""
        out = torch.cat([probs, probs.new_zeros(len(probs), 1)], 1)
        others, firsts = self.duplicates[model]
        if len(others):
            out.index_add_(1, firsts, probs[:, others])
        return out.index_fill_(1, torch.cat([others, self.unmapped[model]]), 0.0)

    def to_union(self, model: int, probs: torch.Tensor) -> torch.Tensor:
        """Model ``model``'s next-token probabilities [B, V_model] as probabilities over the union [B, V_union]."""
        return self.merged(model, probs).index_select(1, self.inverse[model])
