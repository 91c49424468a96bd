"""The zoo: task families (answers checked independently), tokenizers (GPT-2 subset == full GPT-2 on the corpus,
round-trips), the builder (seeded, deterministic), and the bundled dataset."""

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tiktoken

from rlens.records.dataset import load_dataset
from rlens.settings import settings
from rlens.zoo.build import SPECIALISTS, bpe_corpus, load_zoo, train_specialist, train_specialists
from rlens.zoo.record import QUESTIONS_FILE, read_questions
from rlens.zoo.tasks import (
    ANTONYMS,
    FAMILIES,
    N_CHOICES,
    block_stream,
    exact_match,
    generation_split,
    generation_stream,
    make_question,
)
from rlens.zoo.tokenizers import GPT2_PATTERN, char_tokenizer, gpt2_subset_tokenizer, load_gpt2_ranks


def solve(prompt: str) -> str:
    """Each family's answer computed from the prompt text alone."""
    body = prompt.removeprefix("Q: ").removesuffix("\nA:")
    if m := re.fullmatch(r"add: (\d+)([+-])(\d+)=", body):
        a, op, b = int(m[1]), m[2], int(m[3])
        return str(a + b if op == "+" else a - b)
    if m := re.fullmatch(r"count (\w) in: (.*)", body):
        return str(m[2].split().count(m[1]))
    if m := re.fullmatch(r"sort: (.*)", body):
        return " ".join(sorted(m[1].split()))
    if m := re.fullmatch(r"next: (.*)", body):
        xs = [int(x) for x in m[1].split()]
        return str(xs[-1] + xs[1] - xs[0])
    if m := re.fullmatch(r"opposite of (\w+):", body):
        return {**dict(ANTONYMS), **{b: a for a, b in ANTONYMS}}[m[1]]
    raise AssertionError(f"unknown prompt {prompt!r}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_questions_have_one_correct_choice(family):
    rng = np.random.default_rng(7)
    for _ in range(300):
        q = make_question(family, rng)
        assert len(set(q.choices)) == N_CHOICES and all(c.startswith(" ") for c in q.choices)
        assert q.prompt.endswith("\nA:")
        if family != "antonyms":  # some words have two opposites; the generator excludes both from distractors
            assert q.choices[q.label] == " " + solve(q.prompt)
            assert sum(c == " " + solve(q.prompt) for c in q.choices) == 1


def test_antonym_distractors_are_never_an_opposite():
    rng = np.random.default_rng(3)
    for _ in range(500):
        q = make_question("antonyms", rng)
        word = q.prompt.split("opposite of ")[1].split(":")[0]
        opposites = {b for a, b in ANTONYMS if a == word} | {a for a, b in ANTONYMS if b == word}
        assert q.choices[q.label].strip() in opposites
        assert not any(c.strip() in opposites for i, c in enumerate(q.choices) if i != q.label)


def test_labels_are_uniform_and_streams_are_seeded():
    rng = np.random.default_rng(0)
    labels = [make_question("pattern", rng).label for _ in range(2000)]
    assert np.bincount(labels, minlength=4).min() > 400
    a, b = block_stream(list(FAMILIES), 7, 5, seed=3), block_stream(list(FAMILIES), 7, 5, seed=3)
    assert a == b and a != block_stream(list(FAMILIES), 7, 5, seed=4)
    families = [q.family for q in a][::5]
    assert len(families) == 7 and all(x != y for x, y in zip(families, families[1:]))  # a switch at every block
    assert [q.family for q in a] == [f for f in families for _ in range(5)]


def test_generation_tasks_have_exact_references_in_blocks_and_splits():
    stream = generation_stream(list(FAMILIES), 6, 4, seed=1)
    assert stream == generation_stream(list(FAMILIES), 6, 4, seed=1) != generation_stream(list(FAMILIES), 6, 4, seed=2)
    families = [t.family for t in stream][::4]
    assert all(x != y for x, y in zip(families, families[1:])) and [t.family for t in stream] == [
        f for f in families for _ in range(4)
    ]
    for task in generation_split(list(FAMILIES), 300, seed=0):
        body = task.prompt.removeprefix("Q: ").removesuffix("\nA:")
        if task.family == "arithmetic":  # "add: 12+7=" -> "19"
            a, op, b = re.match(r"add: (\d+)([+-])(\d+)=", body).groups()
            assert task.reference == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        elif task.family == "ordering":
            assert task.reference == " ".join(sorted(body.removeprefix("sort: ").split()))
        elif task.family == "pattern":
            seq = [int(x) for x in body.removeprefix("next: ").split()]
            assert task.reference == str(seq[-1] + seq[1] - seq[0])
    assert {t.family for t in generation_split(list(FAMILIES), 300, seed=0)} == set(FAMILIES)
    assert (
        exact_match(" 19", "19")
        and exact_match("a b c\n", "a b c")
        and not exact_match(" 19 20", "19")
        and not exact_match("", "19")
    )


def test_gpt2_subset_tokenizes_the_corpus_exactly_like_full_gpt2():
    ranks = load_gpt2_ranks()
    full = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    corpus = bpe_corpus(per_family=400)
    tokenizer = gpt2_subset_tokenizer(corpus, ranks)
    assert 256 < len(tokenizer) < 2000
    rng = np.random.default_rng(11)  # other questions than the corpus's, same families
    texts = [q.prompt + c for q in (make_question(f, rng) for f in FAMILIES for _ in range(100)) for c in q.choices]
    for text in texts:
        ours = tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))
        theirs = [full.decode_single_token_bytes(t) for t in full.encode_ordinary(text)]
        assert [bytearray(tokenizer.convert_tokens_to_string([t]), "utf-8") for t in ours] == theirs


@pytest.mark.parametrize("make", [char_tokenizer, lambda: gpt2_subset_tokenizer(bpe_corpus(per_family=50))])
def test_tokenizers_round_trip(make):
    tokenizer = make()
    for text in ["Q: add: 12+7=\nA: 19", "  two  spaces, Tabs\tand UPPER {x} ~!", "sort: a c b\nA: a b c"]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_training_is_seeded_and_deterministic(tmp_path):
    from safetensors.numpy import load_file

    spec = replace(SPECIALISTS[1], steps=8)
    train_specialist(spec, tmp_path / "a")
    train_specialist(spec, tmp_path / "b")
    train_specialist(replace(spec, seed=99), tmp_path / "c")
    a, b, c = (load_file(tmp_path / d / spec.name / "model.safetensors") for d in "abc")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], c[k]) for k in a)


def test_specialists_train_alike_whatever_this_machines_instruction_set(tmp_path, monkeypatch):
    """The specialists train in a process of their own with portable numerics: a parent set to torch's AVX2 kernels
    and one set to its scalar kernels train the same weights (trained with AVX2's rounding, it is another model)."""
    from safetensors.numpy import load_file

    spec = replace(SPECIALISTS[1], steps=8)
    steps = []
    for capability in ("avx2", "default"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        (model,) = train_specialists([spec], tmp_path / capability, steps.append)
        assert model.name == spec.name
    assert steps == [1] * 16
    avx2, default = (load_file(tmp_path / d / spec.name / "model.safetensors") for d in ("avx2", "default"))
    assert all(np.array_equal(avx2[k], default[k]) for k in avx2)


def test_quick_zoo_manifest(quick_zoo):
    models = load_zoo(quick_zoo)
    assert [m.name for m in models] == ["smollm2-135m", "gemma3-270m", *(s.name for s in SPECIALISTS)]
    assert {m.tokenizer for m in models} == {"smollm2", "gemma3", "char", "gpt2"}
    assert all(Path(m.path).is_dir() for m in models)
    assert (Path(models[1].path) / models[1].gguf_file).stat().st_size > 250e6  # the assembled GGUF file
    assert (Path(models[1].path) / "tokenizer.json").is_file()  # converted once at build time
    assert models[1].cost > models[0].cost > 100 * models[2].cost  # a model costs its parameter count


def test_load_zoo_names_the_build_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="rlens zoo build"):
        load_zoo(tmp_path)


def test_bundled_dataset_is_consistent():
    directory = settings().service.demo_data
    dataset = load_dataset(directory)
    questions = read_questions(directory / QUESTIONS_FILE)
    assert len(questions) == dataset.n_questions and dataset.n_models == 5
    for q, label, task in zip(questions, dataset.labels, dataset.task):
        assert dataset.task_names[int(task)] == q.family
        if q.family != "antonyms":
            assert q.choices[label] == " " + solve(q.prompt)
    accuracy = (dataset.probs.argmax(2) == dataset.labels[:, None]).mean(0)
    assert accuracy.max() < 0.9  # no model solves the stream alone
    manifest = {m["name"] for m in json.loads((directory / "models.json").read_text())}
    assert manifest == {"smollm2-135m", *(s.name for s in SPECIALISTS)}


def test_fewshot_tasks_are_seeded_solved_examples_then_the_question():
    from rlens.zoo.fewshot import FAMILIES, fewshot_split, fewshot_stream, make_task

    task = make_task("add", np.random.default_rng(0))
    lines = task.prompt.split("\n")
    assert len(lines) == 4 and all(" = " in line for line in lines[:3]) and lines[-1].endswith(" =")
    for line in lines[:3]:  # the solved examples are right
        left, answer = line.split(" = ")
        assert sum(int(x) for x in left.split(" + ")) == int(answer)
    a, b = (int(x) for x in lines[-1][:-2].split(" + "))
    assert task.reference == str(a + b)
    assert make_task("spell", np.random.default_rng(3)).reference.count("-") >= 4
    assert fewshot_split(list(FAMILIES), 30, seed=5) == fewshot_split(list(FAMILIES), 30, seed=5)
    families = [t.family for t in fewshot_stream(["add", "month", "weekday"], 4, seed=1)]
    # one block each
    assert sorted(set(families)) == ["add", "month", "weekday"] and all(
        families[i] == families[i - i % 4] for i in range(12)
    )
    with pytest.raises(ValueError, match="unknown few-shot family"):
        make_task("poetry", np.random.default_rng(0))


def test_zoo_record_cli_records_the_models_named(quick_zoo, tmp_path):
    from typer.testing import CliRunner

    from rlens.cli import app

    result = CliRunner().invoke(
        app,
        [
            "zoo",
            "record",
            "--zoo",
            str(quick_zoo),
            "--models",
            "arith-char,count-bpe",
            "--blocks",
            "2",
            "--block-size",
            "3",
            "--out",
            str(tmp_path / "d"),
        ],
    )
    assert result.exit_code == 0, result.output
    dataset = load_dataset(tmp_path / "d")
    assert dataset.model_names == ["arith-char", "count-bpe"] and dataset.n_questions == 6
    result = CliRunner().invoke(
        app, ["zoo", "record", "--zoo", str(quick_zoo), "--models", "arith-char,gpt-5", "--out", str(tmp_path / "e")]
    )
    assert result.exit_code == 2 and "unknown zoo model(s) gpt-5" in result.output
