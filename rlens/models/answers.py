"""Open-ended answers as distributions (pure): sample ``n`` answers per model, extract, count.

As RL-Focal does for GSM8K, a model's distribution over answers is the frequency of each extracted answer among
its samples. The pool's models are then aligned on the union of the answers any of them gave, which makes the
open-ended query a multiple-choice one with ``choices`` = that union, ready for the Fusion agent.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Literal

import numpy as np

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
Extractor = Literal["number", "line"]


def extract_answer(text: str, kind: Extractor = "line") -> str | None:
    """``number``: the first number in the text (``"-3"``, ``"2.5"``); ``line``: the first line, stripped.

    None when nothing can be extracted (no number; an empty first line).
    """
    if kind == "number":
        match = NUMBER.search(text.replace(",", ""))
        return match.group(0) if match else None
    if kind == "line":
        line = text.strip().split("\n", 1)[0].strip()
        return line or None
    raise ValueError(f"unknown answer extractor {kind!r}")


def answer_distribution(samples: list[str], kind: Extractor = "line") -> dict[str, float]:
    """Frequency of each extracted answer among ``samples``; samples with no answer count in the denominator."""
    if not samples:
        raise ValueError("answer_distribution needs at least one sample")
    counts = Counter(a for a in (extract_answer(s, kind) for s in samples) if a is not None)
    return {answer: count / len(samples) for answer, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))}


def align(distributions: list[dict[str, float] | None]) -> tuple[list[str], np.ndarray]:
    """The union of answers (ordered by total mass, then text) and each model's probabilities over it [M, C].

    A None entry (model not called or failed) is a zero row. Rows keep the mass of unextractable samples
    out, so they may sum to less than 1.
    """
    mass: Counter[str] = Counter()
    for dist in distributions:
        mass.update(dist or {})
    candidates = [a for a, _ in sorted(mass.items(), key=lambda kv: (-kv[1], kv[0]))]
    probs = np.zeros((len(distributions), len(candidates)))
    for m, dist in enumerate(distributions):
        for c, answer in enumerate(candidates):
            probs[m, c] = (dist or {}).get(answer, 0.0)
    return candidates, probs
