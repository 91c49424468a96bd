"""The zoo's two tokenizer kinds, both as Hugging Face fast tokenizers (so every zoo model loads the same way).

- ``char``: one token per printable ASCII character, newline and tab; round-trips any such text.
- ``gpt2``: GPT-2's byte-level BPE built from the real tiktoken ranks (``gpt2.tiktoken``, shipped in the
  ``openai-whisper`` sdist), restricted to the 256 byte tokens plus the merge closure of a corpus. On the corpus it
  tokenizes exactly as full GPT-2 does; other text falls back to shorter pieces, down to single bytes, so it still
  round-trips. Token strings are GPT-2's (``Ġ`` marks a space), so the vocabulary union of RLAE sees real BPE markers.
"""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path
from typing import Iterable

CHAR_ALPHABET = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
GPT2_EOS = "<|endoftext|>"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def char_tokenizer():
    """One token per character; id 0 is ``<eos>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<eos>", *CHAR_ALPHABET])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


def gpt2_ranks_path() -> Path:
    """``gpt2.tiktoken`` from the installed ``openai-whisper`` package (installed without its dependencies)."""
    spec = importlib.util.find_spec("whisper")
    path = Path(spec.origin).parent / "assets" / "gpt2.tiktoken" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError("GPT-2 BPE ranks not found: install them with `pip install --no-deps openai-whisper`")
    return path


def load_gpt2_ranks(path: Path | None = None) -> dict[bytes, int]:
    ranks = {}
    for line in (path or gpt2_ranks_path()).read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _split(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts whose merge makes ``token``: BPE on its bytes with the merges ranked below it."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        candidates = [(ranks.get(parts[i] + parts[i + 1], 1 << 62), i) for i in range(len(parts) - 1)]
        rank, i = min(candidates)
        if rank >= ranks[token]:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"GPT-2 ranks: {token!r} is not the merge of two ranked tokens")
    return parts[0], parts[1]


def gpt2_subset_tokenizer(corpus: Iterable[str], ranks: dict[bytes, int] | None = None):
    """GPT-2 BPE over the byte tokens plus every token (and merge ancestor) that GPT-2 uses on ``corpus``."""
    import tiktoken
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ranks = ranks or load_gpt2_ranks()
    full = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    by_rank = {rank: token for token, rank in ranks.items()}
    needed = {bytes([b]) for b in range(256)}
    merges: dict[bytes, tuple[bytes, bytes]] = {}
    stack = [by_rank[t] for text in corpus for t in full.encode_ordinary(text)]
    while stack:
        token = stack.pop()
        if token in needed:
            continue
        needed.add(token)
        merges[token] = _split(token, ranks)
        stack.extend(merges[token])

    to_unicode = byte_to_unicode()
    text = lambda token: "".join(to_unicode[b] for b in token)  # noqa: E731
    ordered = sorted(needed, key=ranks.__getitem__)
    vocab = {text(token): i for i, token in enumerate(ordered)}
    vocab[GPT2_EOS] = len(vocab)
    merge_list = [(text(a), text(b)) for a, b in (merges[t] for t in ordered if t in merges)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merge_list))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=GPT2_EOS, pad_token=GPT2_EOS)
