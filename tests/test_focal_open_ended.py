"""RL-Focal on open-ended queries: recorded samples as a dataset (hand-computed), the replay backend serving them,
the pool call that turns samples into candidates, the worker answering with a candidate and the learner turning a
reference into its label (real redis-server), real zoo models sampling, and the replay harness on recorded samples."""

import asyncio
import base64
import json

import numpy as np
import pytest
from redis.asyncio import Redis

from rlens.backends import BackendError, ChoiceQuery, GenerationRequest
from rlens.backends.replay import ReplayBackend
from rlens.checkpoint import CheckpointStore
from rlens.evaluation.baselines import model_predictions
from rlens.records.dataset import load_dataset
from rlens.records.recorded import DatasetError
from rlens.records.open_ended import sampled_dataset, save_samples
from rlens.records.recorded import SampledTask
from rlens.evaluation.synthetic import synthetic_samples
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.focal.schedule import questions
from rlens.focal.voting import plurality_vote
from rlens.messages import Feedback, Query
from rlens.models.ensemble import PoolCaller
from rlens.service.learner.core import LearnerCore
from rlens.service.learner.online import FocalOnlineTrainer
from rlens.service.common.windows import RedisWindows
from rlens.service.worker.core import FocalWorker
from trust import SIGNER, TOKENS, VERIFIER, token

MODELS = ["a", "b", "c"]
TASKS = [
    SampledTask(
        prompt="1+1=", reference="2", family="add", samples={"a": [" 2", " 2", " 3", ""], "b": [" 3"], "c": []}
    ),
    # c gave none; nobody is right
    SampledTask(prompt="2+2=", reference="4", family="add", samples={"a": [" 5"], "b": [" 6", " 6"]}),
    SampledTask(prompt="say", reference="y", family="other", samples={"a": [""], "b": ["\n"]}),  # no answer at all
]
SAMPLING = GenerationRequest(id="-", prompt="", n=5, max_tokens=8, temperature=1.0, stop=["\n"])


def test_recorded_samples_become_a_dataset_over_the_union_of_answers():
    data = sampled_dataset("t", TASKS, MODELS, np.array([1.0, 2.0, 3.0]))
    # task 0: a = {2: 2/4, 3: 1/4} (the empty sample counts), b = {3: 1}; "3" has more mass (1.25) than "2" (0.5)
    np.testing.assert_allclose(data.probs[0], [[0.25, 0.5, 0], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_allclose(data.probs[1], [[1, 0, 0], [0, 1, 0], [0, 0, 0]])  # a tie in mass: "5" before "6"
    np.testing.assert_allclose(data.probs[2], np.zeros((3, 3)))
    assert data.choice_mask.tolist() == [[True, True, False], [True, True, False], [True, False, False]]
    assert data.labels.tolist() == [1, 2, 2]  # "2"; then "none of these" (the last column), twice
    assert data.task.tolist() == [0, 0, 1] and data.task_names == {0: "add", 1: "other"} and data.open_ended
    assert model_predictions(data).tolist() == [[1, 0, -1], [0, 1, -1], [-1, -1, -1]]  # -1: no answer
    q = questions(data)
    assert q[0].predictions.tolist() == [1, 0, -1] and q[0].label == 1 and q[0].decider_choices == 0
    assert q[2].probs.shape == (3, 1) and q[2].label == 1  # the one empty choice, and "none"
    assert data.subset(np.array([2, 0])).sampled == [TASKS[2], TASKS[0]]


def test_a_negative_prediction_is_no_vote():
    assert plurality_vote(np.array([[1, 1, -1], [2, -1, -1], [0, 2, 2]]), 3).tolist() == [1, 2, 2]


def test_a_samples_directory_round_trips_and_its_errors_name_the_line(tmp_path):
    save_samples(tmp_path / "ok", TASKS, MODELS, np.array([1.0, 2.0, 3.0]))
    data = load_dataset(tmp_path / "ok")
    assert data.model_names == MODELS and data.model_costs.tolist() == [1, 2, 3] and data.sampled == TASKS
    np.testing.assert_array_equal(data.probs, sampled_dataset("t", TASKS, MODELS, np.ones(3)).probs)
    bad = tmp_path / "bad"
    save_samples(bad, TASKS, MODELS, np.ones(3))
    lines = (bad / "samples.jsonl").read_text().splitlines()
    (bad / "samples.jsonl").write_text("\n".join([lines[0], lines[1].replace('"b"', '"zz"')]))
    with pytest.raises(DatasetError, match="line 2: samples of zz, which models.json does not list"):
        load_dataset(bad)
    (bad / "samples.jsonl").write_text('{"prompt": "p", "samples": {}}\n')
    with pytest.raises(DatasetError, match="line 1: reference: Field required"):
        load_dataset(bad)
    (bad / "samples.jsonl").write_text(lines[0])
    (bad / "open_ended.json").write_text('{"extractor": "regex"}')
    with pytest.raises(DatasetError, match="unknown extractor 'regex'"):
        load_dataset(bad)


def test_the_replay_backend_serves_recorded_samples(zoo):
    data = sampled_dataset("t", TASKS, MODELS, np.ones(3))
    assert ReplayBackend(data, "a").generate(SAMPLING.model_copy(update={"id": "0", "n": 2})).texts == [" 2", " 2"]
    assert ReplayBackend(data, "c").generate(SAMPLING.model_copy(update={"id": "1"})).texts == []
    with pytest.raises(BackendError, match="records choice probabilities, not samples"):
        ReplayBackend(zoo, 0).generate(SAMPLING.model_copy(update={"id": "0"}))


def test_the_pool_call_turns_samples_into_candidates_next_to_multiple_choice_queries():
    data = sampled_dataset("t", TASKS, MODELS, np.ones(3))
    caller = PoolCaller({m: ReplayBackend(data, m) for m in MODELS})
    everyone = np.ones(3, dtype=bool)
    open_ended, choice = caller.ask_batch(
        [SAMPLING.model_copy(update={"id": "0"}), ChoiceQuery(id="1", prompt="x", choices=["5", "6"])],
        [everyone, everyone],
    )
    assert open_ended.candidates == ["3", "2"] and open_ended.answered.tolist() == [True, True, False]
    np.testing.assert_allclose(open_ended.probs, [[0.25, 0.5], [1, 0], [0, 0]])
    assert [(f.model, f.reason) for f in open_ended.failures] == [
        ("c", "none of its 0 samples holds an answer (line extractor)")
    ]
    assert choice.candidates is None and choice.probs.shape == (3, 2) and choice.answered.all()
    assert caller.models[2].breaker.in_a_row == 0  # a model without an answer responded: its circuit stays closed


class Record:
    """A consumer record's coordinates (what the learner keeps of a message)."""

    def __init__(self, offset: int, value: bytes = b"{}"):
        self.topic, self.partition, self.offset, self.key, self.value, self.timestamp = (
            "rlens.feedback",
            0,
            offset,
            b"k",
            value,
            None,
        )


def windows_for(url: str, n_models: int = len(MODELS)) -> RedisWindows:
    return RedisWindows(Redis.from_url(url), n_models, 128)


def test_the_worker_answers_with_a_candidate_and_the_learner_labels_it_by_the_reference(tmp_path, redis_server):
    data = sampled_dataset("t", TASKS, MODELS, np.ones(3))

    async def scenario():
        await Redis.from_url(redis_server.url).flushdb()
        # the whole pool is called: candidates by hand
        every_model = FocalEngine(3, config=FocalConfig(use_decider=False), seed=0)
        worker = FocalWorker(
            every_model,
            MODELS,
            {m: ReplayBackend(data, m) for m in MODELS},
            windows_for(redis_server.url),
            VERIFIER,
            TOKENS,
            sampling=SAMPLING,
        )
        queries = [
            Query(query_id=f"q{i}", stream=t.family, prompt=t.prompt, reference_id=str(i)) for i, t in enumerate(TASKS)
        ]
        out = await worker.answer(queries)
        first, second, third = out.answers
        assert (
            first.candidates == ["3", "2"]
            and first.answer == first.candidates[first.answer_index]
            and len(first.distribution) == 2
        )
        assert (
            second.candidates == ["5", "6"]
            and third.answer == ""
            and third.answer_index == -1
            and third.candidates == []
        )
        experience = {e.query_id: e for e in out.experience}
        assert (
            set(experience) == {"q0", "q1"}
            and experience["q0"].candidates == ["3", "2"]
            and experience["q0"].n_choices == 2
        )
        assert experience["q0"].predictions == [1, 0, -1] and [f.model for f in first.failures] == ["c"]

        core = LearnerCore(
            FocalOnlineTrainer(FocalEngine(3, seed=0), MODELS),
            MODELS,
            windows_for(redis_server.url),
            CheckpointStore(tmp_path / "ckpt"),
            SIGNER,
            TOKENS,
        )
        assert core.trainer.check(experience["q0"]) is None
        for qid, reference in (("q0", "2"), ("q1", " 4\nsomething else")):
            await core.on_experience(experience[qid], Record(0))
            assert await core.on_feedback(
                Feedback(query_id=qid, token=token(qid, experience[qid].stream), reference=reference), Record(1)
            ) == (
                None,
                None,
            )
        await core.apply_windows()
        window = (await core.windows.load(["add"]))["add"]
        assert window.labels[:2].tolist() == [1, 2]  # "2" is candidate 1; "4" is none of the 2 candidates
        engine = core.trainer.engine
        assert [t.fusion_reward for t in engine.buffer] == [1.0 if first.answer == "2" else -1.0, -1.0]
        assert [t.label for t in engine.buffer] == [1, -1]  # no candidate to learn from when none is right
        await core.on_experience(experience["q0"].model_copy(update={"query_id": "q9"}), Record(0))
        _, dead = await core.on_feedback(
            Feedback(query_id="q9", token=token("q9", experience["q0"].stream), label=2), Record(3)
        )
        assert (
            "label 2 is not one of query q9's 2 candidates" in dead.reason and base64.b64decode(dead.value_b64) == b"{}"
        )
        wrong = experience["q0"].model_copy(update={"candidates": ["3"]})
        assert "candidates must be its 2 choices" in core.trainer.check(wrong)

    asyncio.run(scenario())


def test_real_zoo_models_sample_answers_for_the_worker(quick_zoo, redis_server):
    from rlens.zoo.build import load_backend, load_zoo
    from rlens.zoo.tasks import generation_stream

    names = ["arith-char", "count-bpe"]
    backends = {m.name: load_backend(m) for m in load_zoo(quick_zoo) if m.name in names}
    worker = FocalWorker(
        FocalEngine(2, seed=0),
        names,
        backends,
        windows_for(redis_server.url, 2),
        VERIFIER,
        TOKENS,
        sampling=SAMPLING.model_copy(update={"n": 4, "max_tokens": 4, "seed": 0}),
    )
    tasks = generation_stream(["arithmetic", "counting"], 2, 3, seed=0)
    out = asyncio.run(
        worker.answer([Query(query_id=f"z{i}", stream=t.family, prompt=t.prompt) for i, t in enumerate(tasks)])
    )
    assert len(out.answers) == len(tasks) and not out.failed
    for answer in out.answers:
        if answer.answered_models:  # a model's 4 samples of at most 4 tokens, read up to the first newline
            assert answer.answer in answer.candidates and all(
                0 < len(c) <= 40 and "\n" not in c for c in answer.candidates
            )
    assert all(e.n_choices == len(e.candidates) for e in out.experience) and out.experience


def test_the_replay_of_recorded_samples_beats_the_best_single_model():
    from rlens.evaluation.protocols import Protocol
    from rlens.evaluation.replay import replay

    data = synthetic_samples(400, 3, n_families=2, seed=0)
    run = replay(data, Protocol.stream, seed=0, variants=["rl_focal"], workers=1)
    methods = run.results.methods
    # specialists: each family has a model right on ~85 % of its samples, the others on 25 %; choosing well wins big
    assert methods["rl_focal"].accuracy > methods["best_single"].accuracy + 0.15, {
        k: v.accuracy for k, v in methods.items()
    }
    assert methods["rl_focal"].mean_models_called < 3
    assert json.loads(run.results.model_dump_json())["n_test"] == 400
