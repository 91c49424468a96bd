"""Each model's per-stream calibration and the pool's calibrated vote (rlens.focal.calibration), and through the
service: the learner's rows and fits in Redis, the workers' votes."""

import asyncio
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from redis.asyncio import Redis
from typer.testing import CliRunner

from rlens.backends import create_backend
from rlens.cli import app
from rlens.checkpoint import CheckpointStore
from rlens.evaluation.logged import FocalPolicy, LoggedQuery
from rlens.records.recorded import RecordedDataset
from rlens.focal.agents import Decider, Fusion
from rlens.focal.calibration import StreamCalibration, fit_multinomial, fit_scaling, log_softmax
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.focal.features import (
    decider_obs_dim,
    fusion_feature_dim,
    model_features_in_decider_obs,
    reliability_weighted_log_probs,
)
from rlens.focal.greedy import GreedyActor
from rlens.local.load import queries_of
from rlens.messages import MAX_CHOICES, Behaviour, Experience, Feedback
from rlens.service.common.policy import encode_policy
from rlens.service.common.windows import RedisWindows
from rlens.service.learner.core import LearnerCore
from rlens.service.learner import window_writer
from rlens.service.learner.online import FocalOnlineTrainer
from rlens.service.worker.core import FocalWorker
from rlens.settings import settings
from test_service_core import Record
from trust import SIGNER, TOKENS, VERIFIER, token


def test_the_fit_is_the_penalised_likelihoods_minimum():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 4)), rng.integers(0, 3, 60)
    theta = fit_multinomial(x, y, 3, strength=2.0)
    features = np.hstack([x, np.ones((60, 1))])
    p = np.exp(log_softmax(features @ theta))
    gradient = theta + 2.0 * features.T @ (p - np.eye(3)[y])
    assert np.abs(gradient).max() < 1e-6


def test_a_fit_on_a_constant_input_learns_the_label_frequency():
    """Labels 3 : 1 whatever the model says: the calibrated posterior is the frequency, shrunk a little by the
    penalty (0.5 |theta|^2 against 400 rows' likelihood)."""
    x = np.tile(np.log([[0.9, 0.1]]), (400, 1))
    y = np.array([0, 0, 0, 1] * 100)
    theta = fit_multinomial(x, y, 2)
    q = np.exp(log_softmax(x[0] @ theta[:-1] + theta[-1]))
    assert q == pytest.approx([0.75, 0.25], abs=0.01)


def test_the_scaling_fit_is_its_penalised_likelihoods_minimum_and_reads_as_a_full_fit():
    """softmax(a x + b): the gradient of 0.5 (a^2 + |b|^2) + 2 * cross-entropy is zero in a and in b at the fit,
    and its theta (a times the identity, then b) gives the same posterior as a full fit's would."""
    rng = np.random.default_rng(0)
    x, y = np.log(rng.dirichlet(np.ones(4), size=80)), rng.integers(0, 4, 80)
    theta = fit_scaling(x, y, 4, strength=2.0)
    a, b = theta[0, 0], theta[-1]
    assert np.array_equal(theta[:-1], a * np.eye(4))
    p = np.exp(log_softmax(a * x + b))
    residual = p - np.eye(4)[y]
    assert abs(a + 2.0 * (residual * x).sum()) < 1e-6
    assert np.abs(b + 2.0 * residual.sum(0)).max() < 1e-6
    assert np.exp(log_softmax(x @ theta[:-1] + theta[-1])) == pytest.approx(p)


def test_the_scaling_fit_learns_a_models_overconfidence_and_the_label_frequency():
    """A model whose log-probabilities are twice what they should be (its probabilities squared, renormalised): the
    scale comes out near 1/2. A model that says nothing, labels 3 : 1: the biases give about (3/4, 1/4)."""
    rng = np.random.default_rng(4)
    truth = rng.dirichlet(np.ones(3), size=3000)
    y = np.array([rng.choice(3, p=row) for row in truth])
    assert fit_scaling(2 * np.log(truth), y, 3)[0, 0] == pytest.approx(0.5, abs=0.05)
    theta = fit_scaling(np.zeros((400, 2)), np.array([0, 0, 0, 1] * 100), 2)
    assert np.exp(log_softmax(theta[-1])) == pytest.approx([0.75, 0.25], abs=0.01)


def test_a_models_fit_is_the_scaling_form_until_it_has_ten_rows_a_choice():
    """3 choices: fitted on 16 and 24 rows, one scale and a bias per choice (no weight across choices); from 30
    rows on, the full form, which learns that the model names the choice after the right one."""
    rng = np.random.default_rng(5)
    calibration = StreamCalibration(n_models=1, rows=64, refit_every=8, min_rows=16)
    probs, labels = _permuted(40, 3, rng)
    forms = {}
    for i, (p, label) in enumerate(zip(probs, labels), start=1):
        calibration.push(p[None], np.array([True]), int(label))
        if i in (16, 24, 32):
            calibration.vote(p[None], np.array([True]))
            theta = calibration.fits[0, 3][1][:-1]
            forms[i] = np.array_equal(theta, theta[0, 0] * np.eye(3))
    assert forms == {16: True, 24: True, 32: False}
    vote = calibration.vote(probs[0][None], np.array([True]))
    assert vote is not None and vote.argmax() == labels[0] != probs[0].argmax()


def _permuted(n: int, n_choices: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n questions where the model is confident in the choice after the right one (mod C)."""
    labels = rng.integers(0, n_choices, n)
    probs = np.full((n, n_choices), 0.1 / (n_choices - 1))
    probs[np.arange(n), (labels + 1) % n_choices] = 0.9
    return probs, labels


def test_the_calibration_undoes_a_models_systematic_mistake():
    """A model that always names the choice after the right one is always wrong raw, and right once calibrated."""
    rng = np.random.default_rng(1)
    calibration = StreamCalibration(n_models=2, rows=64, refit_every=8, min_rows=16)
    probs, labels = _permuted(48, 3, rng)
    uniform = np.full(3, 1 / 3)
    for p, label in zip(probs, labels):
        calibration.push(np.stack([p, uniform]), np.array([True, False]), int(label))
    new_probs, new_labels = _permuted(20, 3, rng)
    for p, label in zip(new_probs, new_labels):
        vote = calibration.vote(np.stack([p, uniform]), np.array([True, False]))
        assert vote is not None and vote.argmax() == label and p.argmax() != label


def test_a_pools_vote_is_the_naive_bayes_combination_of_its_members():
    """Two models that say nothing (constant inputs), labels 3 : 1: each calibrated posterior is about (3/4, 1/4),
    the prior (add-one) too, so the vote q1 q2 / prior is about (3/4, 1/4) again (not (9/10, 1/10), the product)."""
    calibration = StreamCalibration(n_models=2, rows=400, refit_every=8, min_rows=16)
    flat = np.full((2, 2), 0.5)
    for label in [0, 0, 0, 1] * 100:
        calibration.push(flat, np.array([True, True]), label)
    both = np.exp(calibration.vote(flat, np.array([True, True])))
    one = np.exp(calibration.vote(flat, np.array([True, False])))
    assert both == pytest.approx([0.75, 0.25], abs=0.01)
    assert one == pytest.approx([0.75, 0.25], abs=0.01)


def test_no_vote_until_every_member_has_its_rows_and_refits_come_every_few_rows():
    calibration = StreamCalibration(n_models=2, rows=64, refit_every=8, min_rows=16)
    rng = np.random.default_rng(2)
    probs, labels = _permuted(40, 2, rng)
    pool = np.array([True, True])
    for i in range(15):
        calibration.push(np.stack([probs[i], probs[i]]), np.array([True, False]), int(labels[i]))
    assert calibration.vote(np.stack([probs[0], probs[0]]), np.array([True, False])) is None  # 15 rows < 16
    calibration.push(np.stack([probs[15], probs[15]]), np.array([True, False]), int(labels[15]))
    assert calibration.vote(np.stack([probs[0], probs[0]]), np.array([True, False])) is not None
    assert calibration.vote(np.stack([probs[0], probs[0]]), pool) is None  # model 1 was never called
    first = calibration.fits[0, 2][1].copy()
    for i in range(16, 23):  # 7 new rows: no refit yet
        calibration.push(np.stack([probs[i], probs[i]]), np.array([True, False]), int(labels[i]))
    calibration.vote(np.stack([probs[0], probs[0]]), np.array([True, False]))
    assert np.array_equal(calibration.fits[0, 2][1], first)
    calibration.push(np.stack([probs[23], probs[23]]), np.array([True, False]), int(labels[23]))
    calibration.vote(np.stack([probs[0], probs[0]]), np.array([True, False]))
    assert not np.array_equal(calibration.fits[0, 2][1], first)


def test_a_refit_starts_from_the_last_fit_and_reaches_the_same_minimum_in_fewer_steps(monkeypatch):
    """16 new rows after a fit: fitted again from the last fits (``fit_all``'s default, or the ``starts`` a learner
    kept), the calibrations are the cold fit's to 1e-6 and take fewer Newton steps (one linear solve each)."""
    rng = np.random.default_rng(3)
    calibration = StreamCalibration(n_models=2, rows=200, refit_every=16)
    probs, labels = _permuted(216, 3, rng)
    for i in range(216):
        if i == 200:
            calibration.fit_all()
            last = dict(calibration.fits)
        calibration.push(np.stack([probs[i], probs[i][::-1]]), np.array([True, True]), int(labels[i]))
    steps = []
    solve = np.linalg.solve

    def counted(a, b):
        steps[-1] += 1
        return solve(a, b)

    monkeypatch.setattr(np.linalg, "solve", counted)
    fitted = {}
    for name, starts in (("cold", {}), ("warm", None), ("kept", last)):
        calibration.fits = dict(last)  # the last fits, as after the fit at row 200
        steps.append(0)
        calibration.fit_all(starts)
        fitted[name] = {key: theta for key, (_, theta) in calibration.fits.items()}
    assert set(fitted["cold"]) == {(0, 3), (1, 3)}
    for name in ("warm", "kept"):
        for key, theta in fitted["cold"].items():
            assert fitted[name][key] == pytest.approx(theta, abs=1e-6)
    assert steps[1] == steps[2] < steps[0]


def test_the_greedy_answer_is_the_fusions_distribution_times_the_vote():
    torch.manual_seed(0)
    fusion = Fusion(fusion_feature_dim(3), 8, reliability_weighted_log_probs(3))
    actor = GreedyActor(Decider(decider_obs_dim(3, 1), 3, 8, model_features_in_decider_obs(3, 1)), fusion)
    features = np.random.default_rng(3).normal(size=(2, 4, fusion_feature_dim(3))).astype(np.float32)
    mask = np.array([[True] * 4, [True, True, True, False]])
    votes = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.7, 0.2, 0.1, 1.0]]))
    _, _, own = actor.answers(features, mask)
    answers, logps, blended = actor.answers(features, mask, votes)
    expected = own * np.exp(votes) * mask
    expected /= expected.sum(1, keepdims=True)
    assert blended == pytest.approx(expected, abs=1e-6)
    assert np.array_equal(answers, expected.argmax(1))
    assert logps == pytest.approx(np.log(expected.max(1)), abs=1e-5)


def test_the_engines_greedy_answer_follows_the_calibrated_vote():
    """Stream 'a': model 0 always names the choice after the right one. With calibrations the greedy answer of a
    pool of model 0 is the right choice once 32 outcomes are in (an untrained Fusion alone follows model 0); a
    stream without outcomes answers as without calibrations; explored answers are the Fusion's own."""
    rng = np.random.default_rng(4)
    probs, labels = _permuted(52, 3, rng)
    uniform = np.full(3, 1 / 3)
    engines = {
        rows: FocalEngine(2, config=FocalConfig(calibration_rows=rows, calibration_refit=8), seed=0) for rows in (0, 64)
    }
    for engine in engines.values():
        for p, label in zip(probs[:32], labels[:32]):
            engine.observe("a", np.array([p.argmax(), -1]), int(label), 0.0, np.stack([p, uniform]))
    for p, label in zip(probs[32:], labels[32:]):
        answers = {}
        for rows, engine in engines.items():
            (decision,) = engine.decide("a", 3, greedy=True)
            decision.pool = decision.called = np.array([True, False])
            answers[rows] = engine.fuse(decision, np.stack([p, uniform])).answer
            pool = [decision.pool]
            assert (
                engine.greedy_actions([decision], [np.stack([p, uniform])], pool, [None], pool)[0][0] == answers[rows]
            )
            (cold,) = engine.decide("b", 3, greedy=True)
            cold.pool = cold.called = np.array([True, False])
            answers[rows, "b"] = engine.fuse(cold, np.stack([p, uniform])).answer
        assert answers[0] == p.argmax() != label and answers[64] == label
        assert answers[0, "b"] == answers[64, "b"] == p.argmax()


def _copies(n: int, n_choices: int = 3, seed: int = 6, copies: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Models that are one model ``copies`` times: right with probability 0.6, confident (0.7) either way, and wrong
    together. Their naive-Bayes vote counts the same evidence again and again; a joint fit does not."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_choices, n)
    top = np.where(rng.random(n) < 0.6, labels, (labels + rng.integers(1, n_choices, n)) % n_choices)
    probs = np.full((n, n_choices), 0.3 / (n_choices - 1))
    probs[np.arange(n), top] = 0.7
    return np.stack([probs] * copies, 1), labels


def test_a_pools_joint_fit_replaces_the_vote_where_it_predicts_better():
    """Two copies of one model, the pool of both serving: from 100 rows (an eighth of the 800 kept) the pool's joint
    fit is the multinomial regression on the members' log-probabilities of every row (fit_multinomial on them: the
    same minimum), because it beat the vote on the newest fifth (the vote of StreamCalibration.votes_of); below 100
    rows there is none; the fits are made again once the rows grew by 16 (a tenth of 100 being less)."""
    probs, labels = _copies(130)
    calibration = StreamCalibration(2, rows=200, joint_rows=800)
    pool = np.array([True, True])
    for p, label in zip(probs[:99], labels[:99]):
        calibration.push(p, pool, int(label), pool)
    assert calibration.joint(probs[99], pool) is None
    calibration.push(probs[99], pool, int(labels[99]), pool)
    joint = calibration.joint(probs[100], pool)
    features = np.log(probs[:100]).reshape(100, -1)
    theta = fit_multinomial(features, labels[:100], 3)
    assert joint == pytest.approx(log_softmax(np.log(probs[100]).ravel() @ theta[:-1] + theta[-1]), abs=1e-6)
    vote = calibration.votes_of(np.log(probs[80:100]), pool)  # each copy calibrated on its 100 rows, counted twice
    held = np.arange(20), labels[80:100]
    older = fit_multinomial(features[:80], labels[:80], 3)
    assert log_softmax(features[80:] @ older[:-1] + older[-1])[held].mean() > vote[held].mean()
    for p, label in zip(probs[100:115], labels[100:115]):
        calibration.push(p, pool, int(label), pool)
    calibration.joint(probs[115], pool)
    assert calibration.combiner.fitted_at == 100  # 15 more rows: not refitted
    calibration.push(probs[115], pool, int(labels[115]), pool)
    calibration.joint(probs[116], pool)
    assert calibration.combiner.fitted_at == 116


def test_a_pool_keeps_its_vote_where_the_joint_fit_predicts_worse_or_is_rarely_served():
    """Independent models whose calibrated vote is the truth (each right with probability 0.7, wrong answers
    uniform): on 100 rows the joint fit, with four times the parameters, predicts the newest fifth worse and the vote
    stays. Only the most served pools get a joint fit, and only from rows where all their members were called."""
    rng = np.random.default_rng(7)
    n, n_choices = 100, 3
    labels = rng.integers(0, n_choices, n)
    probs = np.full((n, 2, n_choices), 0.15)
    for m in range(2):
        top = np.where(rng.random(n) < 0.7, labels, (labels + rng.integers(1, n_choices, n)) % n_choices)
        probs[np.arange(n), m, top] = 0.7
    both, first = np.array([True, True]), np.array([True, False])
    calibration = StreamCalibration(2, rows=200, joint_rows=800)
    for p, label in zip(probs, labels):
        calibration.push(p, both, int(label), both)
    assert calibration.joint(probs[0], both) is None and calibration.combiner.fitted_at == 100
    copies = _copies(150)
    served_alone = StreamCalibration(2, rows=200, joint_rows=800)
    for p, label in zip(*copies):
        served_alone.push(p, both, int(label), first)  # both called, the first alone served
    assert served_alone.joint(copies[0][0], both) is None
    assert served_alone.combiner.fitted_at == 150 and (both.tobytes(), 3) not in served_alone.combiner.fits
    one_called = StreamCalibration(2, rows=200, joint_rows=800)
    for p, label in zip(*copies):
        one_called.push(p, first, int(label), both)  # the pool of both served, yet one model's rows only
    assert one_called.joint(copies[0][0], both) is None and not one_called.combiner.fits


def _shifted(n: int = 96, n_choices: int = 3, seed: int = 5) -> RecordedDataset:
    """Model 0 names the choice after the right one (0.9), model 1 says nothing (uniform)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_choices, n)
    probs = np.full((n, 2, n_choices), 0.05, dtype=np.float32)
    probs[np.arange(n), 0, (labels + 1) % n_choices] = 0.9
    probs[:, 1, :] = 1 / n_choices
    return RecordedDataset(
        "shifted",
        probs,
        np.ones((n, n_choices), bool),
        labels,
        np.zeros(n, np.int64),
        ["m0", "m1"],
        np.ones(2),
        {0: "t"},
    )


async def _serve_and_label(worker: FocalWorker, learner: LearnerCore, pairs: list) -> None:
    """The worker answers the queries of ``pairs`` (query, label) 8 at a time; the learner joins each answer's
    experience with its labelled feedback and writes the windows after each batch."""
    for start in range(0, len(pairs), 8):
        batch = pairs[start : start + 8]
        out = await worker.handle([q for q, _ in batch])
        for i, (experience, (query, label)) in enumerate(zip(out.experience, batch)):
            await learner.on_experience(experience, Record(start + i))
            await learner.on_feedback(
                Feedback(query_id=query.query_id, token=token(query.query_id, query.stream), label=label),
                Record(start + i),
            )
        await learner.apply_windows()


def test_the_learners_calibration_rows_are_the_called_models_logged_log_probabilities():
    """Each called model's logged distribution over the query's choices becomes its row (natural logs, floored at
    1e-6, 6 significant digits); a model not called ([]) or with another number of choices has none; no row without
    a behaviour or with a label outside the choices."""
    trainer = FocalOnlineTrainer(FocalEngine(3, config=FocalConfig(calibration_rows=64), seed=0), ["a", "b", "c"])
    decision = trainer.engine.decide("s", 4, greedy=True)[0]
    fused = trainer.engine.fuse(decision, np.full((3, 4), 0.25))
    behaviour = Behaviour(
        explore_rate=0.05,
        probe=False,
        greedy_pool=[True, False, True],
        greedy_answer=1,
        propensity=0.5,
        model_probs=[[0.1, 0.6, 0.3, 0.0], [], [0.5, 0.5, 0.0]],
        reliability=[0.7] * 3,
        label_prior=[0.25] * 4,
    )
    experience = Experience(
        query_id="q",
        stream="s",
        policy_version=0,
        n_choices=4,
        decider_state=decision.state.tolist(),
        critic_state=fused.critic_state.tolist(),
        pool=[True, False, True],
        pool_logp=decision.pool_logp,
        predictions=[1, -1, 0],
        fusion_features=fused.features.tolist(),
        answer_index=1,
        answer_logp=fused.answer_logp,
        explored=False,
        behaviour=behaviour,
    )
    rows = trainer.calibration_rows(experience, 2)
    assert rows is not None and rows.label == 2 and rows.n_choices == 4 and rows.pool == (0, 2)
    # ln 0.1 = -2.302585093 and ln 0.6 = -0.5108256238, ln 0.3 = -1.203972804, ln 1e-6 = -13.81551056 (6 digits)
    assert rows.log_probs == {0: [-2.30259, -0.510826, -1.20397, -13.8155]}
    assert trainer.calibration_rows(experience, 4) is None  # no such choice
    assert trainer.calibration_rows(experience.model_copy(update={"behaviour": None}), 2) is None


def test_the_learner_publishes_calibrations_and_the_workers_answer_with_their_vote(tmp_path, redis_server):
    """Through a real redis-server: the learner keeps each called model's rows with the window's, fits the stream's
    calibrations once 16 new rows came and publishes them; a worker then answers from the Fusion times the vote (right
    where model 0 is always wrong), where a worker without calibrations follows model 0 (its untrained Fusion leans
    on the confident model, however unreliable). A candidate scored in shadow and off-policy evaluation from the
    logged behaviour give the same answers as served."""
    data = _shifted()
    plain_config = FocalConfig(use_decider=False, explore_rate=0.0, calibration_rows=0)  # every model fused, greedy
    config = replace(plain_config, calibration_rows=64)
    backends = {name: create_backend("replay", dataset=data, model=i) for i, name in enumerate(data.model_names)}
    pairs = queries_of(data, None, "cal")

    async def scenario():
        redis = Redis.from_url(redis_server.url)
        await redis.flushdb()
        windows = RedisWindows(redis, 2, 128, calibration_rows=64)
        worker = FocalWorker(
            FocalEngine(2, config=config, seed=0), data.model_names, backends, windows, VERIFIER, TOKENS
        )
        plain = FocalWorker(
            FocalEngine(2, config=plain_config, seed=0),
            data.model_names,
            backends,
            RedisWindows(redis, 2, 128),
            VERIFIER,
            TOKENS,
        )
        learner = LearnerCore(
            FocalOnlineTrainer(FocalEngine(2, config=config, seed=0), data.model_names),
            data.model_names,
            windows,
            CheckpointStore(tmp_path / "ckpt"),
            SIGNER,
            TOKENS,
        )
        await _serve_and_label(worker, learner, pairs[:48])  # 48 labelled outcomes: fitted at 16, 32 and 48 rows
        assert learner.stats.calibrations_published == 3
        assert await redis.llen(windows.calibration_key("t", 0)) == 48 and 0 < await redis.ttl(windows.fit_key("t"))
        rest = pairs[48:]
        same = FocalEngine(2, config=config, seed=0).policy_state()  # a candidate with the champion's weights
        assert (
            worker.receive_policy(encode_policy(same, 1, 1, data.model_names, "rl_focal", SIGNER, "candidate")) is None
        )
        served = await worker.handle([q for q, _ in rest])
        without = await plain.handle([q for q, _ in rest])
        # what the worker logs gives off-policy evaluation the same greedy answer, vote included
        champion = FocalPolicy("champion", FocalEngine(2, config=config, seed=0))
        for experience, (_, label) in zip(served.experience, rest):
            logged = LoggedQuery.from_experience(experience, label)
            assert logged.calibrated is not None and champion.act(logged)[1] == experience.answer_index
            assert experience.shadow is not None and experience.shadow.answer == experience.answer_index
        right = np.mean([a.answer_index == label for a, (_, label) in zip(served.answers, rest)])
        followed = np.mean([a.answer_index == label for a, (_, label) in zip(without.answers, rest)])
        assert right >= 0.9 and followed <= 0.1, (right, followed)
        await redis.aclose()

    asyncio.run(scenario())


def test_the_learner_publishes_joint_fits_and_the_workers_and_off_policy_evaluation_use_them(
    tmp_path, redis_server, monkeypatch
):
    """Through a real redis-server, with joint rows: the learner keeps each query whole beside the calibration rows,
    makes the served pool's joint fit once 100 queries called its models and publishes it with the calibrations.
    Three copies of one model (right 60 %) and a better one (right 80 %, independent): the vote counts the copies'
    evidence three times and follows them where the two disagree; the joint fit learns to follow the better one. A
    worker then answers with it (the better model's answer on the disagreements), logs the joint log-probabilities
    its answers used, and off-policy evaluation of the same policy gives the answers served. (The learner makes a
    stream's joint fits at most every 30 s: here at every 16 rows.)"""
    monkeypatch.setattr(window_writer, "JOINT_REFIT_S", 0.0)
    copies, labels = _copies(200, copies=3)
    rng = np.random.default_rng(8)
    better = np.where(rng.random(200) < 0.8, labels, (labels + rng.integers(1, 3, 200)) % 3)
    probs = np.concatenate([copies, np.full((200, 1, 3), 0.15)], 1)
    probs[np.arange(200), 3, better] = 0.7
    data = RecordedDataset(
        "copies",
        probs.astype(np.float32),
        np.ones((200, 3), bool),
        labels,
        np.zeros(200, np.int64),
        ["a", "b", "c", "d"],
        np.ones(4),
        {0: "t"},
    )
    config = FocalConfig(use_decider=False, explore_rate=0.0, calibration_rows=64, joint_rows=500)
    backends = {name: create_backend("replay", dataset=data, model=i) for i, name in enumerate(data.model_names)}
    pairs = queries_of(data, None, "joint")

    async def scenario():
        redis = Redis.from_url(redis_server.url)
        await redis.flushdb()
        windows = RedisWindows(redis, 4, 128, calibration_rows=64, joint_rows=500)
        worker = FocalWorker(
            FocalEngine(4, config=config, seed=0), data.model_names, backends, windows, VERIFIER, TOKENS
        )
        learner = LearnerCore(
            FocalOnlineTrainer(FocalEngine(4, config=config, seed=0), data.model_names),
            data.model_names,
            windows,
            CheckpointStore(tmp_path / "ckpt"),
            SIGNER,
            TOKENS,
        )
        await _serve_and_label(worker, learner, pairs[:160])
        assert await redis.llen(windows.joint_key("t")) == 160
        published = json.loads(await redis.get(windows.fit_key("t")))
        assert [members for members, _, _ in published["joint"]] == [[0, 1, 2, 3]]  # the pool served
        rest = pairs[160:]
        served = await worker.handle([q for q, _ in rest])
        disagree = [i for i in range(len(rest)) if copies[160 + i, 0].argmax() != better[160 + i]]
        followed = np.mean([served.answers[i].answer_index == better[160 + i] for i in disagree])
        assert len(disagree) >= 10 and followed >= 0.7, (len(disagree), followed)  # 18 and 0.83 when written
        champion = FocalPolicy("champion", FocalEngine(4, config=config, seed=0))
        for experience, (_, label) in zip(served.experience, rest):
            assert [j.pool for j in experience.behaviour.joint] == [[True] * 4]
            logged = LoggedQuery.from_experience(experience, label)
            assert champion.act(logged)[1] == experience.answer_index
        await redis.aclose()

    asyncio.run(scenario())


def test_bad_calibration_rows_and_fits_in_redis_are_skipped(redis_server):
    """Rows written by hand (another pool's, out of range, not numbers) never reach a fit, and a published fit of
    the wrong shape is not loaded: the stream has no vote rather than a wrong one."""

    async def scenario():
        redis = Redis.from_url(redis_server.url)
        await redis.flushdb()
        windows = RedisWindows(redis, 2, 128, calibration_rows=64)
        good = [3, 1, -2.3, -0.1, -3.0]
        for row in (
            good,
            [3, 3, -1, -1, -1],
            [3, 1, -1, -1],
            [3, 1, -1, 5, -1],
            ["x"],
            [MAX_CHOICES + 1, 1] + [-1] * (MAX_CHOICES + 1),
        ):
            await redis.rpush(windows.calibration_key("s", 0), json.dumps(row))
        calibration = await windows.load_calibration("s")
        assert [(c, label) for c, _, label in calibration.history[0]] == [(3, 1)] and windows.skipped_rows == 5
        await redis.set(windows.fit_key("s"), json.dumps({"fits": [[0, 3, [[0.0] * 2] * 4]], "prior": []}))
        await redis.set(windows.fit_key("t"), b"not json")
        fits = (await windows.load_with_pools(["s", "t"], fits=True)).fits
        assert fits == {} and windows.skipped_rows == 7
        fits = (await windows.load_with_pools(["s", "t"], fits=True)).fits  # read again, kept as restored
        assert fits == {} and windows.skipped_rows == 9
        # a good fit is restored once and kept while it stays the same; a new one published is read anew
        good_fit = {"fits": [[0, 3, [[0.0] * 3] * 4]], "prior": [[3, [2, 1, 1]]]}
        await redis.set(windows.fit_key("s"), json.dumps(good_fit))
        first = (await windows.load_with_pools(["s"], fits=True)).fits["s"]
        assert (await windows.load_with_pools(["s"], fits=True)).fits["s"] is first
        good_fit["prior"] = [[3, [1, 2, 1]]]
        await redis.set(windows.fit_key("s"), json.dumps(good_fit))
        renewed = (await windows.load_with_pools(["s"], fits=True)).fits["s"]
        assert renewed is not first and renewed.prior(3)[1] == 0.5
        await redis.aclose()

    asyncio.run(scenario())


def test_calibrations_without_the_logged_distributions_are_a_clear_error(tmp_path):
    pool = tmp_path / "pool.json"
    pool.write_text(
        json.dumps({"models": [{"name": "a", "backend": "replay", "path": str(settings().service.demo_data)}]})
    )
    env = {"RLENS_FOCAL_CALIBRATION_ROWS": "200", "RLENS_OPE_LOGGING": "false", "RLENS_POOL_FILE": str(pool)}
    for role in ("learner", "worker"):
        result = CliRunner().invoke(app, [role], env=env)
        assert result.exit_code != 0 and "RLENS_OPE_LOGGING must stay true" in result.output, result.output


def test_bad_calibration_rows_are_dropped_and_the_outcome_still_reaches_the_window(redis_server):
    from rlens.service.common.windows import CalibrationRows
    from rlens.service.learner.window_writer import WindowWriter

    async def scenario():
        redis = Redis.from_url(redis_server.url)
        await redis.flushdb()
        writer = WindowWriter(RedisWindows(redis, 2, 128, calibration_rows=64))
        writer.queue("s", "q1", ([0, 1], 1), 1.0, CalibrationRows(2, 1, {0: [-0.1, 0.5]}))  # a log-probability above 0
        writer.queue("s", "q2", ([0, 1], 0), 1.0, CalibrationRows(2, 0, {0: [-0.1, -2.3], 1: [-0.7, -0.7]}))
        done = await writer.apply()
        assert done.windows_applied == 2 and (await writer.windows.load(["s"]))["s"].n_rows == 2
        assert await redis.llen(writer.windows.calibration_key("s", 0)) == 1
        assert dict(writer.new_rows) == {("s", 0): 1, ("s", 1): 1}
        await redis.aclose()

    asyncio.run(scenario())


def test_a_busy_streams_calibrations_are_fitted_at_most_once_per_interval(redis_server):
    """16 new rows make a fit; 16 more within ``refit_interval_s`` wait (counted, not lost) and are fitted once the
    interval has passed; a stream fitted long ago is not held back by another's fit."""
    from rlens.service.common.windows import CalibrationRows
    from rlens.service.learner.window_writer import WindowWriter

    async def scenario():
        redis = Redis.from_url(redis_server.url)
        await redis.flushdb()
        writer = WindowWriter(RedisWindows(redis, 2, 128, calibration_rows=64), refit_interval_s=60.0)

        async def rows(stream: str, start: int, n: int) -> None:
            for i in range(start, start + n):
                rows = CalibrationRows(2, i % 2, {0: [-0.1, -2.3], 1: [-0.7, -0.7]})
                writer.queue(stream, f"{stream}{i}", ([0, 1], i % 2), 1.0, rows)
            await writer.apply()

        await rows("a", 0, 16)
        assert await writer.refit() == 1 and not writer.new_rows
        await rows("a", 16, 16)
        await rows("b", 0, 16)
        assert await writer.refit() == 1  # b only: a was fitted within the interval
        assert dict(writer.new_rows) == {("a", 0): 16, ("a", 1): 16}
        writer.fitted_at["a"] -= 60.0  # the interval has passed
        assert await writer.refit() == 1 and not writer.new_rows
        assert await redis.llen(writer.windows.calibration_key("a", 0)) == 32
        await redis.aclose()

    asyncio.run(scenario())
