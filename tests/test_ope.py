"""Off-policy evaluation: the estimators against hand-computed cases and a simulated bandit whose truth is known,
and candidate policies acting on what a real worker logged."""

import asyncio
import json
import math
from dataclasses import replace

import numpy as np
import pytest
from redis.asyncio import Redis

from rlens.backends import create_backend
from rlens.evaluation.logged import (
    Action,
    FixedPool,
    FocalPolicy,
    LoggedQuery,
    action_probability,
    evaluate,
    explore_share,
    fit_ridge,
    loo_residuals,
    mixed_value,
    read_log,
    true_value,
)
from rlens.evaluation.ope import Z95, corrected_replay, direct, doubly_robust, effective_sample_size, ips, snips
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.messages import Experience
from rlens.local.load import queries_of
from rlens.service.common.windows import RedisWindows
from rlens.service.worker.core import FocalWorker
from trust import TOKENS, VERIFIER

REWARDS = np.array([1.0, 0.0, 1.0, 0.0])
TARGET = np.array([1.0, 0.0, 1.0, 1.0])
LOGGING = np.array([0.5, 0.5, 0.25, 1.0])  # weights 2, 0, 4, 1


def test_estimators_by_hand():
    assert effective_sample_size(np.ones(4)) == 4.0 and effective_sample_size(np.array([2.0, 0, 0, 0])) == 1.0
    e = ips(REWARDS, TARGET, LOGGING)  # w r = 2, 0, 4, 0
    assert e.value == pytest.approx(1.5) and e.ess == pytest.approx(49 / 21)
    assert e.high - e.value == pytest.approx(Z95 * math.sqrt(11 / 3) / 2)
    s = snips(REWARDS, TARGET, LOGGING)  # 6 / 7
    assert s.value == pytest.approx(6 / 7)
    variance = (4 * (1 / 7) ** 2 + 16 * (1 / 7) ** 2 + (6 / 7) ** 2) / 49
    assert s.high - s.value == pytest.approx(Z95 * math.sqrt(variance))
    d = doubly_robust(REWARDS, TARGET, LOGGING, np.full(4, 0.5), np.full(4, 0.5))  # 1.5, 0.5, 2.5, 0.0
    assert d.value == pytest.approx(1.125)
    assert direct(np.array([1.0, -1.0, 1.0, 1.0])).value == 0.5
    assert direct(np.array([])).n == 0
    with pytest.raises(ValueError, match="propensity 0"):
        ips(REWARDS, TARGET, np.array([0.5, 0.0, 1.0, 1.0]))


def test_the_estimators_cover_a_simulated_bandits_truth():
    """Contexts with 3 actions, a stochastic logging policy with known propensities, a deterministic target whose
    true value is known: over 300 logs of 1,000 rounds, each estimator is unbiased and its 95 % interval covers the
    truth about 95 % of the time (a reward model that is wrong on purpose: DR stays unbiased)."""
    rng = np.random.default_rng(0)
    means = np.array([[0.2, 0.5, 0.8], [0.7, 0.4, 0.1]])  # reward probability per context kind and action
    target = np.array([2, 0])  # the target's action per context kind
    truth = float(np.mean([means[0, 2], means[1, 0]]))
    found: dict[str, list] = {"ips": [], "snips": [], "dr": []}
    for _ in range(300):
        kind = rng.integers(0, 2, 1000)
        logging_probs = np.where(kind[:, None] == 0, [0.5, 0.3, 0.2], [0.2, 0.3, 0.5])
        action = np.array([rng.choice(3, p=p) for p in logging_probs])
        reward = (rng.random(1000) < means[kind, action]).astype(float)
        taken = logging_probs[np.arange(1000), action]
        matched = (action == target[kind]).astype(float)
        found["ips"].append(ips(reward, matched, taken))
        found["snips"].append(snips(reward, matched, taken))
        wrong_model = np.full(1000, 0.5)
        found["dr"].append(doubly_robust(reward, matched, taken, wrong_model, wrong_model))
    for name, estimates in found.items():
        values = np.array([e.value for e in estimates])
        coverage = np.mean([e.covers(truth) for e in estimates])
        assert abs(values.mean() - truth) < 0.01, name
        assert 0.9 <= coverage <= 0.99, (name, coverage)


def served_experience(
    zoo, n: int = 600, budget: float | None = None
) -> tuple[list[tuple[Experience, int]], FocalEngine]:
    """What a real worker logs for ``n`` queries of the bundled stream (explore 0.3, probe 0.3, ``budget`` met on
    average, or none), with the labels."""

    async def scenario():
        backends = {name: create_backend("replay", dataset=zoo, model=i) for i, name in enumerate(zoo.model_names)}
        dead = RedisWindows(Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2), 5, 128)
        config = FocalConfig(explore_rate=0.3, probe_rate=0.3, budget=budget, budget_cap=False)
        engine = FocalEngine(5, config=config, seed=1)
        worker = FocalWorker(engine, zoo.model_names, backends, dead, VERIFIER, TOKENS)
        traffic = queries_of(zoo, None, "t")[:n]
        out = []
        for start in range(0, n, 100):
            batch = traffic[start : start + 100]
            experience = (await worker.handle([q for q, _ in batch])).experience
            out += [(e, label) for e, (_, label) in zip(experience, batch)]
        return out, engine

    return asyncio.run(scenario())


def logged_queries(zoo, n: int = 600, budget: float | None = None) -> tuple[list[LoggedQuery], FocalEngine]:
    served, engine = served_experience(zoo, n, budget)
    return [LoggedQuery.from_experience(e, label) for e, label in served], engine


@pytest.mark.parametrize("budget", [None, 0.3])
def test_candidates_act_on_what_a_worker_logged(zoo, budget):
    """The logging policy's greedy actions, replayed on its log, are what it served (under a budget: with the
    offset each query was served under, which the log keeps)."""
    queries, engine = logged_queries(zoo, budget=budget)
    policy = FocalPolicy("logging greedy", engine)
    greedy_logged = [q for q in queries if q.propensity > 0.5]  # the greedy action (0.7 of the mixture at least)
    assert greedy_logged
    shifted = [q for q in greedy_logged if q.offset != 0]
    assert (len(shifted) > len(greedy_logged) // 2) if budget else not shifted
    for q in greedy_logged:
        pool, answer, explored = policy.act(q)
        assert (pool == q.pool).all() and answer == q.answer
        assert explored is not None and explored.sum() == pytest.approx(
            1, abs=1e-5
        )  # the log reproduces the Fusion's own decision
    probes = [q for q in queries if q.probe]
    assert 0.2 < len(probes) / len(queries) < 0.4 and all(q.known.all() for q in probes)
    single = FixedPool("model 0", np.eye(5, dtype=bool)[0])
    assert single.act(probes[0])[1] == int(probes[0].probs[0].argmax())
    unknown = next(q for q in queries if not q.known[0])
    assert single.act(unknown)[1] is None
    costs = np.full(5, 0.2)
    estimates = evaluate(queries, policy, costs, 0.24)
    assert set(estimates) == {"reward", "accuracy"}
    for name, e in estimates["accuracy"].items():
        assert 0 <= e.value <= 1.05 and e.low <= e.value <= e.high, name
    # the logging policy's own greedy part is matched on most queries: its estimates agree
    assert abs(estimates["accuracy"]["ips"].value - estimates["accuracy"]["exact"].value) < 0.15


def two_model_query(**changes) -> LoggedQuery:
    """A logged query of 2 models and 3 choices, every answer known: model 0 served, the answer 1, the label 1."""
    query = LoggedQuery(
        state=np.zeros(3, dtype=np.float32),
        probs=np.full((2, 3), 1 / 3),
        known=np.ones(2, dtype=bool),
        reliability=np.ones(2, dtype=np.float32),
        label_prior=np.full(3, 1 / 3, dtype=np.float32),
        pool=np.array([True, False]),
        answer=1,
        propensity=1.0,
        label=1,
        probe=False,
    )
    return replace(query, **changes)


def test_a_candidate_is_judged_as_it_would_serve_by_hand():
    """One query, label 1, 20 % explored; the candidate's greedy answer 0 is wrong and its Fusion gives the label
    0.5. Accuracy 0.8 * 0 + 0.2 * 0.5 = 0.1; reward (cost share 0.5, alpha 0.2: right 0.9, wrong -1.1)
    0.8 * -1.1 + 0.2 * (0.5 * 0.9 + 0.5 * -1.1) = -0.9. It takes the logged answer 1 only by exploring: 0.2 * 0.5."""
    q = two_model_query(propensity=0.1, probe=True, explore_rate=0.2)
    action = Action(np.array([True, False]), 0, np.array([0.3, 0.5, 0.2]))
    rate = explore_share(q, action)
    assert rate == 0.2
    assert mixed_value(lambda p, a, y: float(a == y), q, action, rate) == pytest.approx(0.1)
    cost_share = np.array([0.5, 0.5])
    assert mixed_value(lambda p, a, y: 1.0 - 0.2 * 0.5 if a == y else -1.1, q, action, rate) == pytest.approx(-0.9)
    assert action_probability(q, action, rate) == pytest.approx(0.1)
    assert action_probability(q, action._replace(pool=np.array([True, True])), rate) == 0.0  # another pool
    # greedy actions alone, a query with its own budget, a policy that never explores: no explored share
    assert explore_share(q, action, serving=False) == 0.0
    assert explore_share(replace(q, budget=0.5), action) == 0.0
    assert explore_share(q, Action(action.pool, 0)) == 0.0
    # the same through evaluate and true_value: one probe row, every estimator exact
    policy = FixedPoolWithFusion(action)
    assert true_value([q], policy, cost_share, 0.2) == pytest.approx({"reward": -0.9, "accuracy": 0.1})
    assert true_value([q], policy, cost_share, 0.2, serving=False) == pytest.approx({"reward": -1.1, "accuracy": 0.0})
    found = evaluate([q], policy, cost_share, 0.2)
    assert found["accuracy"]["exact"].value == pytest.approx(0.1)
    assert found["accuracy"]["replay"].value == pytest.approx(0.1)
    assert found["accuracy"]["snips"].value == pytest.approx(1.0)  # the logged answer was right, weight 0.1 / 0.1


def test_a_log_with_few_probes_is_said_to_rank_close_candidates_unreliably(tmp_path):
    from rlens.evaluation.ope_report import FEW_PROBES, few_probes, write_report

    q = two_model_query()
    log = [replace(q, probe=i < 1) for i in range(20)]  # 5 % probes
    assert FEW_PROBES == 0.1 and "only 5 % of the logged queries are probes" in (few_probes(log) or "")
    assert few_probes([replace(q, probe=i < 2) for i in range(20)]) is None  # 10 %
    write_report({}, log, tmp_path)
    assert "**Note**: only 5 %" in (tmp_path / "ope.md").read_text()


class FixedPoolWithFusion:
    name = "fixed action"

    def __init__(self, action: Action):
        self.action = action

    def act(self, query: LoggedQuery) -> Action:
        return self.action


def test_corrected_replay_by_hand():
    values = np.array([1.0, 0.0, 0.5, 0.5])  # the last two from the model
    modelled = np.array([False, False, True, True])
    residuals = np.array([0.2, -0.1, 0.5])  # the model is 0.2 low on average where it stands in
    e = corrected_replay(values, modelled, residuals)
    assert e.value == pytest.approx(0.5 + 0.5 * 0.2)
    variance = values.var(ddof=1) / 4 + 0.25 * residuals.var(ddof=1) / 3
    assert e.high - e.value == pytest.approx(Z95 * math.sqrt(variance))
    exact = corrected_replay(values, np.zeros(4, dtype=bool), np.array([]))  # nothing modelled: a plain mean
    assert exact.value == pytest.approx(0.5) and exact.high - exact.value == pytest.approx(Z95 * values.std(ddof=1) / 2)


def test_leave_one_out_residuals_by_hand_and_by_refitting():
    # an intercept alone (unpenalised) is the mean of the other rows: y_i - mean(y without i)
    ones = np.ones((3, 1))
    assert loo_residuals(ones, np.array([1.0, 2.0, 6.0])) == pytest.approx([1 - 4, 2 - 3.5, 6 - 1.5])
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(10), rng.normal(size=(10, 3))])
    y = rng.normal(size=10)
    refitted = [y[i] - x[i] @ fit_ridge(np.delete(x, i, 0), np.delete(y, i)) for i in range(10)]
    assert loo_residuals(x, y) == pytest.approx(refitted)
    assert np.abs(loo_residuals(x, y)).mean() > np.abs(y - x @ fit_ridge(x, y)).mean()  # larger than in-sample


def test_the_learners_log_round_trips_rotates_and_feeds_rlens_ope(zoo, tmp_path):
    from typer.testing import CliRunner

    from rlens.checkpoint import CheckpointStore
    from rlens.cli import app
    from rlens.local.stack import write_replay_pool
    from rlens.focal.checkpoint import save_engine
    from rlens.service.learner.ope_log import OpeLog
    from rlens.settings import settings

    served, engine = served_experience(zoo, 300)
    path = tmp_path / "ope-log.jsonl"
    log = OpeLog(path, max_bytes=60_000)
    for i, (e, label) in enumerate(served):
        log.append(e, label)
        if i % 3 == 2:
            log.flush()  # the learner's checkpoint, here one per three joins
    log.append(served[0][0], served[0][1])  # a join after a crash, before its checkpoint: logged twice
    log.flush()
    rotated = path.with_name(path.name + ".1")
    assert rotated.is_file() and path.is_file() and path.stat().st_size < 60_000 + 4_000
    queries = read_log([rotated, path])
    ids = [e.query_id for e, _ in served]
    assert 60 < len(queries) < 300  # bounded: the newest file and the one before it
    assert [q.query_id for q in queries] == ids[-(len(queries) - 1) :] + [
        ids[0]
    ]  # the newest, each once (its last line)
    first = next(q for q in queries if q.answer == served[-1][0].answer_index)
    assert first.probs.shape[0] == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_log([bad])
    writing = tmp_path / "writing.jsonl"
    writing.write_text(path.read_text() + path.read_text().splitlines()[0][:40])  # the learner is writing a line
    assert len(read_log([writing])) == len(read_log([path]))

    save_engine(CheckpointStore(tmp_path / "candidate"), engine, 1, {})
    pool = write_replay_pool(settings().service.demo_data, tmp_path / "pool.json")
    result = CliRunner().invoke(
        app,
        [
            "ope",
            "--candidate",
            str(tmp_path / "candidate"),
            "--log",
            str(rotated),
            "--log",
            str(path),
            "--pool",
            str(pool),
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "replay" in result.output and (tmp_path / "out" / "ope.png").stat().st_size > 1000
    report = (tmp_path / "out" / "ope.md").read_text()
    assert "| served | on-policy |" in report and str(tmp_path / "candidate") in report
    assert "judged as they would serve" in report
    greedy = CliRunner().invoke(
        app,
        ["ope", "--candidate", str(tmp_path / "candidate"), "--log", str(path), "--pool", str(pool), "--greedy"]
        + ["--out", str(tmp_path / "greedy")],
    )
    assert greedy.exit_code == 0, greedy.output
    assert "greedy actions alone" in (tmp_path / "greedy" / "ope.md").read_text()
    assert json.loads((tmp_path / "greedy" / "ope.json").read_text())["serving"] is False
    missing = CliRunner().invoke(
        app, ["ope", "--candidate", str(tmp_path / "nothing"), "--log", str(path), "--pool", str(pool)]
    )
    assert missing.exit_code == 2 and "no checkpoint" in missing.output
    # beside a running stack: its learner holds the checkpoint directory's lock, and its log is being written
    from rlens.local.stack import write_client_env

    learner = CheckpointStore(tmp_path / "candidate")  # the learner's, locked while it runs
    (tmp_path / "candidate" / "ope-log.jsonl").write_text(writing.read_text())
    stack = tmp_path / "up"
    stack.mkdir()
    write_client_env(settings().updated({"checkpoint_dir": tmp_path / "candidate", "pool_file": pool}), stack)
    assert (stack / "client.env").stat().st_mode & 0o077 == 0
    beside = CliRunner().invoke(app, ["ope", "--stack", str(stack), "--out", str(tmp_path / "beside")])
    assert beside.exit_code == 0, beside.output
    assert str(tmp_path / "candidate") in (tmp_path / "beside" / "ope.md").read_text()
    learner.close()
    nowhere = CliRunner().invoke(app, ["ope", "--stack", str(tmp_path / "nowhere")])
    assert nowhere.exit_code == 2 and f"no stack in {tmp_path / 'nowhere'}: no client.env there" in nowhere.output
