"""Synthetic task families of the model zoo: seeded generators of questions (pure, no I/O).

Each family makes multiple-choice questions (:class:`Question`) and open-ended generation tasks
(:class:`GenerationTask`: the same prompt, the answer is the generated text, scored by :func:`exact_match`).
Every question is a prompt ending in ``"\\nA:"`` and choices that each start with a space, so the context /
continuation split is the same for every tokenizer. Each family has exactly one correct choice and three
distractors near it (off-by-one numbers, other orders), so that guessing from the surface form does not work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

N_CHOICES = 4
# the zoo's generation stream: one specialist each
GENERATION_FAMILIES = [
    "arithmetic",
    "counting",
    "ordering",
    "pattern",
]
LETTERS = "abcdefgh"
ANTONYMS = [
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("fast", "slow"),
    ("old", "new"),
    ("good", "bad"),
    ("happy", "sad"),
    ("light", "dark"),
    ("high", "low"),
    ("open", "closed"),
    ("full", "empty"),
    ("hard", "soft"),
    ("rich", "poor"),
    ("early", "late"),
    ("wet", "dry"),
    ("long", "short"),
    ("strong", "weak"),
    ("loud", "quiet"),
    ("thick", "thin"),
    ("near", "far"),
    ("true", "false"),
    ("win", "lose"),
    ("buy", "sell"),
    ("day", "night"),
    ("left", "right"),
    ("in", "out"),
    ("yes", "no"),
    ("first", "last"),
    ("heavy", "light"),
    ("clean", "dirty"),
    ("young", "old"),
    ("love", "hate"),
    ("start", "end"),
    ("push", "pull"),
    ("inside", "outside"),
    ("above", "below"),
    ("before", "after"),
    ("cheap", "expensive"),
    ("sweet", "sour"),
    ("war", "peace"),
]


@dataclass(frozen=True)
class Question:
    family: str
    prompt: str
    choices: list[str]
    label: int


@dataclass(frozen=True)
class GenerationTask:
    family: str
    prompt: str
    reference: str  # the correct answer, without the leading space the models generate


def _numeric_distractors(answer: int, rng: np.random.Generator, low: int = 0) -> list[int]:
    candidates = [answer + d for d in (-10, -2, -1, 1, 2, 10) if answer + d >= low]
    return [int(x) for x in rng.choice(candidates, size=N_CHOICES - 1, replace=False)]


def arithmetic(rng: np.random.Generator) -> tuple[str, str, list[str]]:
    a, b = (int(x) for x in rng.integers(0, 50, size=2))
    op = "+" if rng.random() < 0.5 or a < b else "-"
    answer = a + b if op == "+" else a - b
    return f"add: {a}{op}{b}=", str(answer), [str(x) for x in _numeric_distractors(answer, rng)]


def counting(rng: np.random.Generator) -> tuple[str, str, list[str]]:
    symbols = rng.choice(list(LETTERS), size=2, replace=False)
    items = rng.choice(symbols, size=int(rng.integers(4, 10)))
    answer = int((items == symbols[0]).sum())
    return f"count {symbols[0]} in: {' '.join(items)}", str(answer), [str(x) for x in _numeric_distractors(answer, rng)]


def ordering(rng: np.random.Generator) -> tuple[str, str, list[str]]:
    items = [str(x) for x in rng.choice(list(LETTERS), size=int(rng.integers(4, 7)), replace=False)]
    ordered = sorted(items)
    swaps = rng.choice(len(items) - 1, size=N_CHOICES - 1, replace=False)  # nearly sorted: one adjacent swap each
    wrong = [ordered[:i] + [ordered[i + 1], ordered[i]] + ordered[i + 2 :] for i in swaps]
    return f"sort: {' '.join(items)}", " ".join(ordered), [" ".join(w) for w in wrong]


def pattern(rng: np.random.Generator) -> tuple[str, str, list[str]]:
    start, step, length = int(rng.integers(0, 20)), int(rng.integers(1, 6)), int(rng.integers(3, 6))
    sequence = [start + step * i for i in range(length)]
    answer = start + step * length
    return f"next: {' '.join(map(str, sequence))}", str(answer), [str(x) for x in _numeric_distractors(answer, rng)]


def antonyms(rng: np.random.Generator) -> tuple[str, str, list[str]]:
    word, answer = ANTONYMS[int(rng.integers(len(ANTONYMS)))][:: 1 if rng.random() < 0.5 else -1]
    opposites = {b for a, b in ANTONYMS if a == word} | {a for a, b in ANTONYMS if b == word}
    others = sorted({w for pair in ANTONYMS for w in pair} - opposites - {word})
    return f"opposite of {word}:", answer, [str(w) for w in rng.choice(others, size=N_CHOICES - 1, replace=False)]


FAMILIES: dict[str, Callable[[np.random.Generator], tuple[str, str, list[str]]]] = {
    "arithmetic": arithmetic,
    "counting": counting,
    "ordering": ordering,
    "pattern": pattern,
    "antonyms": antonyms,
}


def make_question(family: str, rng: np.random.Generator) -> Question:
    """One multiple-choice question of ``family``; the correct choice's position is uniform."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; known: {', '.join(FAMILIES)}")
    body, answer, distractors = FAMILIES[family](rng)
    choices = [answer, *distractors]
    order = rng.permutation(N_CHOICES)
    return Question(family, f"Q: {body}\nA:", [f" {choices[i]}" for i in order], int(np.flatnonzero(order == 0)[0]))


def training_example(family: str, rng: np.random.Generator) -> tuple[str, str]:
    """(prompt, correct continuation) for language-model training."""
    question = make_question(family, rng)
    return question.prompt, question.choices[question.label]


def make_generation(family: str, rng: np.random.Generator) -> GenerationTask:
    """One open-ended task of ``family``: the prompt of its multiple-choice question, and the correct answer."""
    question = make_question(family, rng)
    return GenerationTask(family, question.prompt, question.choices[question.label].strip())


def exact_match(text: str, reference: str) -> bool:
    """The generated text, stripped of surrounding whitespace, is exactly the reference."""
    return text.strip() == reference


def _block_order(families: list[str], blocks: int, rng: np.random.Generator) -> list[str]:
    """Families cycling in a seeded order, reshuffled after each full cycle, never repeating across a cycle's edge."""
    order: list[str] = []
    while len(order) < blocks:
        cycle = [families[i] for i in rng.permutation(len(families))]
        if order and len(cycle) > 1 and cycle[0] == order[-1]:
            cycle = cycle[1:] + cycle[:1]
        order.extend(cycle)
    return order[:blocks]


def block_stream(families: list[str], blocks: int, block_size: int, seed: int) -> list[Question]:
    """``blocks`` blocks of ``block_size`` questions, the family changing at every block (task switches)."""
    rng = np.random.default_rng(seed)
    return [make_question(family, rng) for family in _block_order(families, blocks, rng) for _ in range(block_size)]


def generation_stream(families: list[str], blocks: int, block_size: int, seed: int) -> list[GenerationTask]:
    """Open-ended tasks in blocks of one family each, like :func:`block_stream` (task switches)."""
    rng = np.random.default_rng(seed)
    return [make_generation(family, rng) for family in _block_order(families, blocks, rng) for _ in range(block_size)]


def generation_split(families: list[str], n: int, seed: int) -> list[GenerationTask]:
    """``n`` open-ended tasks of uniformly drawn families (a training split: no blocks)."""
    rng = np.random.default_rng(seed)
    return [make_generation(str(family), rng) for family in rng.choice(families, size=n)]
