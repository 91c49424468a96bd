"""Open-ended answers as distributions (pure): sample ``n`` answers per model, extract, count.

As RL-Focal does for GSM8K, a model's distribution over answers is the frequency of each extracted answer among
its samples. The pool's models are then aligned on the union of the answers any of them gave, which makes the
open-ended query a multiple-choice one with ``choices`` = that union, ready for the Fusion agent
(:func:`pool_choices`). A reference answer becomes a label on that union with :func:`label_of`: its position, or
the number of candidates when no model gave it (a label no answer can match: every model was wrong).
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


def pool_choices(
    samples: list[list[str] | None], kind: Extractor = "line", max_choices: int | None = None
) -> tuple[list[str], np.ndarray]:
    """Each model's samples (None: not called or failed) → the candidates and the models' distributions [M, C]
    (:func:`answer_distribution`, then :func:`align`); beyond ``max_choices`` candidates, the least likely are dropped."""
    candidates, probs = align([answer_distribution(s, kind) if s else None for s in samples])
    if max_choices is not None and len(candidates) > max_choices:
        candidates, probs = candidates[:max_choices], probs[:, :max_choices]
    return candidates, probs


def label_of(reference: str, candidates: list[str], kind: Extractor = "line") -> int:
    """The position of the reference's answer among ``candidates``; ``len(candidates)`` when it is none of them."""
    answer = extract_answer(reference, kind)
    return candidates.index(answer) if answer in candidates else len(candidates)
