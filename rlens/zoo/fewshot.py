"""Few-shot task families for the zoo's real LLMs (SmolLM2-135M-Instruct, Gemma 3 270M): seeded, pure, no I/O.

Each task is three solved examples and a question, one per line, in the form ``"{question} {answer}\\n"``; the
model continues the last line and the reference is its answer (exact match, stop at the newline). The families
were chosen (probed on 24 tasks each) so that both models answer a fair share and neither wins everywhere:
SmolLM2 is better at two-digit addition and continents, Gemma 3 at multiplication, successors, weekdays, number
words, first letters and capital letters; ``count_up`` and ``spell`` have longer answers (up to 20 tokens).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlens.zoo.tasks import GenerationTask

SHOTS = 3
WORDS = [
    "apple",
    "house",
    "river",
    "green",
    "table",
    "window",
    "music",
    "garden",
    "winter",
    "yellow",
    "pencil",
    "orange",
    "summer",
    "butter",
    "candle",
]
NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
CONTINENTS = [
    ("France", "Europe"),
    ("Japan", "Asia"),
    ("Kenya", "Africa"),
    ("Brazil", "South America"),
    ("Canada", "North America"),
    ("Egypt", "Africa"),
    ("India", "Asia"),
    ("Peru", "South America"),
    ("Mexico", "North America"),
    ("Italy", "Europe"),
    ("Nigeria", "Africa"),
    ("China", "Asia"),
    ("Chile", "South America"),
    ("Spain", "Europe"),
    ("Norway", "Europe"),
    ("Vietnam", "Asia"),
]
PAST_TENSE = [
    ("go", "went"),
    ("eat", "ate"),
    ("see", "saw"),
    ("run", "ran"),
    ("walk", "walked"),
    ("play", "played"),
    ("write", "wrote"),
    ("take", "took"),
    ("give", "gave"),
    ("buy", "bought"),
    ("think", "thought"),
    ("jump", "jumped"),
    ("sing", "sang"),
    ("drink", "drank"),
    ("come", "came"),
    ("make", "made"),
]


def _pick(rng: np.random.Generator, items: list):
    return items[int(rng.integers(len(items)))]


def add(rng):
    a, b = (int(x) for x in rng.integers(0, 10, 2))
    return f"{a} + {b} =", str(a + b)


def add_two_digit(rng):
    a, b = (int(x) for x in rng.integers(10, 50, 2))
    return f"{a} + {b} =", str(a + b)


def multiply(rng):
    a, b = (int(x) for x in rng.integers(2, 10, 2))
    return f"{a} * {b} =", str(a * b)


def successor(rng):
    n = int(rng.integers(10, 99))
    return f"The number after {n} is", str(n + 1)


def larger(rng):
    a, b = (int(x) for x in rng.choice(100, 2, replace=False))
    return f"The larger of {a} and {b} is", str(max(a, b))


def number_word(rng):
    n = int(rng.integers(0, 21))
    return f"{n} in words is", NUMBER_WORDS[n]


def month(rng):
    i = int(rng.integers(0, 11))
    return f"The month after {MONTHS[i]} is", MONTHS[i + 1]


def weekday(rng):
    i = int(rng.integers(0, 6))
    return f"The day after {WEEKDAYS[i]} is", WEEKDAYS[i + 1]


def continent(rng):
    country, name = _pick(rng, CONTINENTS)
    return f"{country} is in", name


def past_tense(rng):
    verb, past = _pick(rng, PAST_TENSE)
    return f"The past tense of {verb} is", past


def first_letter(rng):
    word = _pick(rng, WORDS)
    return f"The first letter of {word} is", word[0]


def uppercase(rng):
    word = _pick(rng, WORDS)
    return f"{word} in capital letters is", word.upper()


def count_up(rng):
    n = int(rng.integers(1, 60))
    return f"Counting on from {n}:", " ".join(str(n + i) for i in range(1, 7))


def spell(rng):
    word = _pick(rng, WORDS)
    return f"{word} spelled out is", "-".join(word)


FAMILIES: dict[str, Callable[[np.random.Generator], tuple[str, str]]] = {
    f.__name__: f
    for f in (
        add,
        add_two_digit,
        multiply,
        successor,
        larger,
        number_word,
        month,
        weekday,
        continent,
        past_tense,
        first_letter,
        uppercase,
        count_up,
        spell,
    )
}


def make_task(family: str, rng: np.random.Generator, shots: int = SHOTS) -> GenerationTask:
    """One few-shot task of ``family``: ``shots`` solved examples of the family, then the question."""
    if family not in FAMILIES:
        raise ValueError(f"unknown few-shot family {family!r}; known: {', '.join(FAMILIES)}")
    examples = [FAMILIES[family](rng) for _ in range(shots)]
    question, answer = FAMILIES[family](rng)
    return GenerationTask(family, "".join(f"{q} {a}\n" for q, a in examples) + question, answer)


def fewshot_split(families: list[str], n: int, seed: int) -> list[GenerationTask]:
    """``n`` tasks of uniformly drawn families (a training or validation split)."""
    rng = np.random.default_rng(seed)
    return [make_task(str(family), rng) for family in rng.choice(families, size=n)]


def fewshot_stream(families: list[str], block_size: int, seed: int) -> list[GenerationTask]:
    """One block of ``block_size`` tasks per family, in a seeded order (a test stream with task switches)."""
    rng = np.random.default_rng(seed)
    return [make_task(families[i], rng) for i in rng.permutation(len(families)) for _ in range(block_size)]
