"""Open-ended answers: extraction, frequency distributions and pool alignment (hand-computed), and sampling n
answers from a real zoo model."""

import numpy as np
import pytest

from rlens.records.answers import align, answer_distribution, extract_answer
from rlens.backends import GenerationRequest


def test_extract_answer():
    assert extract_answer(" 19\nQ: next", "number") == "19"
    assert extract_answer("it is -3.5 or so", "number") == "-3.5"
    assert extract_answer("1,234 apples", "number") == "1234"
    assert extract_answer("no digits", "number") is None
    assert extract_answer("  a b c \nmore", "line") == "a b c"
    assert extract_answer("\n\n", "line") is None
    with pytest.raises(ValueError, match="unknown answer extractor"):
        extract_answer("x", "regex")


def test_answer_distribution_counts_unextractable_samples_in_the_denominator():
    dist = answer_distribution([" 19", "19!", " 18", "none", " 19 or 20"], "number")
    assert dist == {"19": 0.6, "18": 0.2}
    assert list(dist) == ["19", "18"]
    with pytest.raises(ValueError):
        answer_distribution([])


def test_align_orders_by_mass_and_zeroes_missing_models():
    candidates, probs = align([{"19": 0.6, "18": 0.2}, None, {"18": 1.0}])
    assert candidates == ["18", "19"]  # total mass 1.2 before 0.6
    np.testing.assert_allclose(probs, [[0.2, 0.6], [0.0, 0.0], [1.0, 0.0]])


def test_sampled_answers_of_a_zoo_model_form_a_distribution(quick_zoo):
    from rlens.zoo.build import load_backend, load_zoo

    model = next(m for m in load_zoo(quick_zoo) if m.name == "count-bpe")
    backend = load_backend(model)
    request = GenerationRequest(
        id="c", prompt="Q: count a in: a b a b\nA:", n=8, max_tokens=4, temperature=1.0, stop=["\n"], seed=0
    )
    texts = backend.generate(request).texts
    assert len(texts) == 8 and backend.generate(request).texts == texts
    dist = answer_distribution(texts, "line")
    assert 0 < sum(dist.values()) <= 1
    with pytest.raises(Exception, match="n > 1 needs temperature > 0"):
        backend.generate(request.model_copy(update={"temperature": 0.0}))
