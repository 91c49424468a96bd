"""RLAE training on real models: the frozen MiniLM encoder equals sentence-transformers, rollouts keep one decision
per span with the exact-match reward on the last, an interrupted run resumes to the very same policy, the
evaluation helpers (simplex grid, answers as a multiple-choice dataset) on hand-computed cases, and the CLI."""

import gc
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rlens.backends.hf import TransformersBackend
from rlens.cli import app
from rlens.rlae.agent import RLAEConfig
from rlens.rlae.decode import TokenEnsemble
from rlens.evaluation.rlae import answer_dataset, rl_focal_correct, simplex_grid
from rlens.rlae.observe import EMBED_DIM, minilm_path, obs_dim
from rlens.rlae.tasks import TaskFileError, read_tasks
from rlens.rlae.train import RLAETrainer, load_agent, rollout
from rlens.zoo.tasks import GenerationTask, exact_match, generation_split

MODELS = ["arith-char", "count-bpe", "order-char"]
CFG = RLAEConfig(
    span=2, max_tokens=6, episodes=32, rollout_batch=8, episodes_per_update=16, minibatch_size=16, hidden=16
)


@pytest.fixture(scope="module")
def ensemble(quick_zoo):
    return TokenEnsemble([TransformersBackend.load(quick_zoo / name) for name in MODELS])


def test_encoder_is_minilm_as_sentence_transformers_computes_it(encoder):
    from sentence_transformers import SentenceTransformer

    texts = ["Q: add: 12+7=\nA:", "Q: sort: d b a\nA: a b", "opposite of hot: cold"]
    reference = SentenceTransformer(str(minilm_path()), device="cpu").encode(texts, normalize_embeddings=True)
    ours = encoder.encode(texts)
    assert ours.shape == (3, EMBED_DIM)
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_rollout_keeps_one_decision_per_span_and_the_reward_on_the_last(ensemble, encoder, tmp_path):
    trainer = RLAETrainer(ensemble, encoder, MODELS, CFG, tmp_path, seed=0)
    tasks = generation_split(["arithmetic", "ordering"], 8, seed=1)
    outputs, record, rewards = rollout(
        ensemble, trainer.agent, tasks, greedy=False, generator=torch.Generator().manual_seed(0)
    )
    for out, spans, reward, task in zip(outputs, record, rewards, tasks):
        assert len(spans) == len(out.span_weights) >= 1
        ended_by_eos = out.finish_reason == "stop" and not (
            out.union_tokens and b"\n" in ensemble.vocab.pieces[out.union_tokens[-1]]
        )
        steps = len(out.union_tokens) + ended_by_eos  # one token decided per step, the EOS included
        assert len(spans) == -(-steps // CFG.span)  # one decision at the start of every span the row reached
        assert [s.last for s in spans] == [False] * (len(spans) - 1) + [True]
        assert [s.reward for s in spans[:-1]] == [0.0] * (len(spans) - 1) and spans[-1].reward == reward == float(
            exact_match(out.text, task.reference)
        )
        assert all(s.obs.shape == (obs_dim(len(MODELS)),) for s in spans)
        np.testing.assert_allclose(
            out.span_weights[0], trainer.agent.policy.weights(torch.from_numpy(spans[0].action)).numpy(), atol=1e-6
        )


class CountingEncoder:
    """The real encoder, counting the texts it embeds."""

    def __init__(self, encoder):
        self.encoder, self.texts = encoder, []

    def encode(self, texts):
        self.texts.append(list(texts))
        return self.encoder.encode(texts)


@pytest.mark.parametrize("observe", ["prompt", "text"])
def test_the_agent_embeds_each_prompt_once_or_the_text_at_every_span(ensemble, encoder, tmp_path, observe):
    counting = CountingEncoder(encoder)
    trainer = RLAETrainer(ensemble, counting, MODELS, replace(CFG, observe=observe), tmp_path, seed=0)
    tasks = generation_split(["arithmetic", "ordering"], 4, seed=1)
    prompts = [t.prompt for t in tasks]
    outputs, record, _ = rollout(ensemble, trainer.agent, tasks, greedy=True)
    spans = max(len(r) for r in record)
    assert spans >= 2
    if observe == "prompt":
        assert counting.texts == [prompts]  # one MiniLM call for the batch, whatever the number of spans
        embedded = encoder.encode(prompts)
        for row, episode in enumerate(record):
            for span in episode:
                np.testing.assert_allclose(span.obs[:EMBED_DIM], embedded[row], atol=1e-6)
    else:
        assert len(counting.texts) == spans  # one call per span, on prompt + text so far
        assert counting.texts[0] == prompts and all(any(t.startswith(p) for p in prompts) for t in counting.texts[1])


def test_an_interrupted_run_resumes_to_the_same_policy(ensemble, encoder, tmp_path):
    tasks = generation_split(["arithmetic", "counting", "ordering"], 40, seed=2)
    straight = RLAETrainer(ensemble, encoder, MODELS, CFG, tmp_path / "straight", seed=3)
    straight.run(tasks)
    first = RLAETrainer(ensemble, encoder, MODELS, replace(CFG, episodes=16), tmp_path / "cut", seed=3)
    first.run(tasks)  # "crashes" after its first update and checkpoint
    first.store.close()  # ... and its process, which held the directory's lock, is gone
    resumed = RLAETrainer(ensemble, encoder, MODELS, CFG, tmp_path / "cut", seed=3)
    assert resumed.state.episodes == 16 and resumed.state.updates == 1
    resumed.run(tasks)
    assert resumed.state.curve == straight.state.curve and resumed.state.updates == 2
    for (name, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name
    agent, models, state = load_agent(tmp_path / "cut", encoder)
    assert models == MODELS and state["episodes"] == 32
    assert all(
        torch.equal(a, b) for a, b in zip(agent.policy.state_dict().values(), resumed.policy.state_dict().values())
    )
    resumed.store.close()
    with pytest.raises(ValueError, match="other models, settings or seed"):
        RLAETrainer(ensemble, encoder, MODELS, replace(CFG, span=3), tmp_path / "cut", seed=3)


def test_simplex_grid_and_answers_as_a_choice_dataset():
    np.testing.assert_allclose(
        simplex_grid(3, 0.5), [[0, 0, 1], [0, 0.5, 0.5], [0, 1, 0], [0.5, 0, 0.5], [0.5, 0.5, 0], [1, 0, 0]]
    )
    assert len(simplex_grid(4, 0.25)) == 35
    with pytest.raises(ValueError, match="divide 1"):
        simplex_grid(3, 0.3)
    tasks = [GenerationTask("arithmetic", "p1", "19"), GenerationTask("ordering", "p2", "a b")]
    outputs = [[" 19", " b a"], [" 18", " b a"], [" 19", ""]]  # 3 models x 2 tasks
    data = answer_dataset(outputs, tasks, ["m0", "m1", "m2"], ["arithmetic", "ordering"])
    # task 0: choices 19 (2 votes), 18; label 0. task 1: the one choice "b a" (m2 gave no answer: a zero row);
    # nobody right: the masked extra column
    assert data.probs.shape == (2, 3, 3)
    np.testing.assert_array_equal(data.probs[0], [[1, 0, 0], [0, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(data.probs[1], [[1, 0, 0], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(data.choice_mask, [[True, True, False], [True, False, False]])
    np.testing.assert_array_equal(data.labels, [0, 2])
    np.testing.assert_array_equal(data.task, [0, 1])


def test_rl_focal_learns_from_answers_even_where_no_model_was_right():
    """Tasks that no model answers right (their label is the never selectable extra choice) are always wrong and
    teach the Fusion nothing; they must not stop the warm start or the online updates."""
    rng = np.random.default_rng(0)
    tasks = [GenerationTask(f, f"p{i}", str(i)) for i, f in enumerate(rng.choice(["arithmetic", "ordering"], 120))]
    right = lambda m, t: t.reference if (t.family == "arithmetic") == (m == 0) else "x"  # noqa: E731
    # every 5th: nobody right
    outputs = [[right(m, t) if i % 5 else "y" for i, t in enumerate(tasks)] for m in range(2)]
    hits, called = rl_focal_correct(
        [o[:80] for o in outputs],
        tasks[:80],
        [o[80:] for o in outputs],
        tasks[80:],
        ["m0", "m1"],
        ["arithmetic", "ordering"],
        seed=0,
    )
    assert len(hits) == 40 and not hits[::5].any() and called.min() >= 1
    assert hits.mean() >= 0.5  # of the 32 answerable tasks, most are answered (a margin for a short online stream)


def test_task_files_are_validated(tmp_path):
    good = tmp_path / "tasks.jsonl"
    good.write_text(
        json.dumps({"prompt": "Q: add: 1+1=\nA:", "reference": " 2 "})
        + "\n\n"
        + json.dumps({"prompt": "x", "reference": "y", "family": "f"})
        + "\n"
    )
    assert read_tasks(good) == [GenerationTask("default", "Q: add: 1+1=\nA:", "2"), GenerationTask("f", "x", "y")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "x", "reference": "y"}) + "\n" + json.dumps({"prompt": "", "reference": "y"}) + "\n"
    )
    with pytest.raises(TaskFileError, match="bad.jsonl:2"):
        read_tasks(bad)
    bad.write_text("{not json\n")
    with pytest.raises(TaskFileError, match="bad.jsonl:1"):
        read_tasks(bad)
    with pytest.raises(TaskFileError, match="cannot read"):
        read_tasks(tmp_path / "missing.jsonl")


def test_cli_trains_resumes_and_generates(quick_zoo, tmp_path):
    """Train, then resume in the same process (the first command releases its run directory when it ends, not when
    its trainer happens to be collected: the garbage collector is off meanwhile), then generate."""
    gc.disable()
    try:
        _trains_resumes_and_generates(quick_zoo, tmp_path)
    finally:
        gc.enable()


def _trains_resumes_and_generates(quick_zoo, tmp_path):
    runner = CliRunner()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"prompt": t.prompt, "reference": t.reference, "family": t.family}) + "\n"
            for t in generation_split(["counting"], 20, seed=0)
        )
    )
    common = [
        "--zoo",
        str(quick_zoo),
        "--models",
        "count-bpe,pattern-bpe",
        "--tasks",
        str(tasks),
        "--span",
        "2",
        "--max-tokens",
        "4",
        "--out",
        str(tmp_path / "run"),
    ]
    result = runner.invoke(app, ["rlae", "train", *common, "--episodes", "128"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "training.png").stat().st_size > 1000 and "128 episodes, 1 updates" in result.output
    result = runner.invoke(app, ["rlae", "train", *common, "--episodes", "256"])
    assert result.exit_code == 0 and "resuming" in result.output and "256 episodes, 2 updates" in result.output, (
        result.output
    )
    result = runner.invoke(
        app,
        [
            "rlae",
            "generate",
            "--run",
            str(tmp_path / "run"),
            "--zoo",
            str(quick_zoo),
            "--max-tokens",
            "4",
            "Q: count a in: a b a\\nA:",
        ],
    )
    assert result.exit_code == 0 and "span 0: count-bpe" in result.output, result.output
    result = runner.invoke(
        app, ["rlae", "generate", "--weights", "uniform", "--zoo", str(quick_zoo), "--models", "count-bpe,nope", "x"]
    )
    assert result.exit_code == 2 and "unknown zoo model(s) nope" in result.output
    result = runner.invoke(app, ["rlae", "train", "--zoo", str(quick_zoo), "--tasks", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "cannot read" in result.output
    result = runner.invoke(app, ["rlae", "train", "--zoo", str(quick_zoo), "--observe", "everything"])
    assert result.exit_code == 2 and "--observe must be prompt or text" in result.output
