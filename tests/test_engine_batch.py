"""The worker's batched engine calls equal the one-query-at-a-time calls of the replay harness."""

import numpy as np
import pytest

from rlens.focal.engine import FocalEngine
from rlens.focal.features import padded_choices


def warmed_engine(seed: int = 3) -> FocalEngine:
    engine = FocalEngine(4, seed=seed)
    rng = np.random.default_rng(0)
    for key in ("a", "b"):
        for _ in range(60):
            engine.observe(key, rng.integers(-1, 4, size=4), int(rng.integers(0, 4)), float(rng.normal()))
    return engine


def queries(n: int = 48):
    rng = np.random.default_rng(1)
    return [(["a", "b", "c"][i % 3], int(rng.integers(2, 6)), bool(rng.random() < 0.2)) for i in range(n)]


@pytest.mark.parametrize("greedy", [True, False])
def test_decide_batch_equals_decide_one_by_one(greedy):
    one, batch = warmed_engine(), warmed_engine()
    expected = [one.decide(key, c, greedy=greedy, probe=probe)[0] for key, c, probe in queries()]
    got = batch.decide_batch([(key, c, probe, greedy) for key, c, probe in queries()])
    for e, g in zip(expected, got):
        assert (
            np.array_equal(e.pool, g.pool)
            and np.array_equal(e.called, g.called)
            and e.explored == g.explored == (not greedy)
        )
        np.testing.assert_allclose(e.state, g.state)
        assert e.pool_logp == pytest.approx(g.pool_logp, abs=1e-6)
    assert {k: v.tolist() for k, v in one.previous_pool.items()} == {
        k: v.tolist() for k, v in batch.previous_pool.items()
    }


def test_fuse_batch_equals_fuse_one_by_one():
    one, batch = warmed_engine(), warmed_engine()
    decisions = one.decide_batch([(key, c, probe, True) for key, c, probe in queries()])
    rng = np.random.default_rng(2)
    probs = [rng.dirichlet(np.ones(c), size=4) for _, c, _ in queries()]
    expected = [one.fuse(d, p) for d, p in zip(decisions, probs)]
    got = batch.fuse_batch(decisions, probs)
    for e, g in zip(expected, got):
        assert e.answer == g.answer and e.answer_logp == pytest.approx(g.answer_logp, abs=1e-5)
        np.testing.assert_allclose(e.distribution, g.distribution, atol=1e-6)
        assert np.array_equal(e.features, g.features) and np.array_equal(e.critic_state, g.critic_state)  # bit for bit


def test_the_marginal_diversity_observation_reaches_the_decider_and_the_learner():
    """With ``marginal_diversity`` the Decider observation ends with each model's marginal focal diversity, and the
    agents, the critic and the learner's shape check all take the longer vector."""
    from rlens.focal.config import FocalConfig
    from rlens.focal.features import decider_obs_dim
    from rlens.service.learner.online import FocalOnlineTrainer

    engine = FocalEngine(3, config=FocalConfig(marginal_diversity=True), seed=0)
    for predictions in ([0, 1, 0], [1, 0, 1], [1, 1, 0]):
        engine.observe("s", np.array(predictions), 0, 0.0)
    decision = engine.decide("s", 2, greedy=True)[0]
    k = len(engine.cfg.metrics)
    assert decision.state.shape == (decider_obs_dim(3, k, marginal=True),) == (decider_obs_dim(3, k) + 3,)
    previous = decision.state[:3].astype(bool)
    np.testing.assert_allclose(decision.state[-3:], engine.window("s").marginal_focal_diversity(previous))
    answer = engine.fuse(decision, np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]]))
    trainer = FocalOnlineTrainer(engine, ["a", "b", "c"])
    assert trainer.dims["decider_state"] == len(decision.state) and trainer.dims["critic_state"] == len(
        answer.critic_state
    )


def test_padded_choices_pads_only_where_widths_differ():
    rng = np.random.default_rng(0)
    a, b, c = (rng.random((w, 4)).astype(np.float32) for w in (3, 3, 2))
    padded, mask = padded_choices([a, b])  # nothing to pad: stacked as they are
    assert np.array_equal(padded, np.stack([a, b])) and mask.all() and mask.shape == (2, 3)
    padded, mask = padded_choices([a, c])
    assert np.array_equal(padded[1, :2], c) and not padded[1, 2].any()
    assert mask.tolist() == [[True, True, True], [True, True, False]]
    (one,), (one_mask,) = padded_choices([c])
    assert np.array_equal(one, c) and one_mask.all()


def test_coins_are_drawn_the_probes_first_then_the_explorations_and_a_capped_query_gets_neither():
    """One place draws the exploration coins, for the worker's batches and the replay's queries alike (one query at
    a time: its probe coin, then its exploration coin)."""
    from dataclasses import replace

    from rlens.focal.config import FocalConfig

    engine = FocalEngine(3, config=replace(FocalConfig(), probe_rate=0.5, explore_rate=0.85), seed=7)
    draws = np.random.default_rng(7).random(8)  # the engine's generator, seeded alike: 4 probe coins, 4 explorations
    probes, explored = engine.coins([None, None, 0.5, None])
    assert probes == [draws[0] < 0.5, draws[1] < 0.5, False, draws[3] < 0.5] == [False, False, False, True]
    assert explored == [draws[4] < 0.85, draws[5] < 0.85, False, draws[7] < 0.85] == [True, False, False, True]
    assert draws[6] < 0.85  # the capped query's exploration coin said yes
    assert engine.rng.random() == np.random.default_rng(7).random(9)[8]  # and were drawn all the same
    assert FocalEngine(3, config=replace(FocalConfig(), probe_rate=0.0, explore_rate=0.0)).coins([None]) == (
        [False],
        [False],
    )


def test_a_streams_first_queries_call_every_model_while_its_budget_is_not_overspent():
    """A stream's first ``first_probes`` queries call the whole pool (a query with a budget of its own is counted
    but not probed); they are not logged as probes (not a random sample); an overspent budget, or counts unknown
    (Redis unreachable), stops them."""
    from dataclasses import replace

    from rlens.focal.config import FocalConfig
    from rlens.focal.serving import decide_batch

    config = replace(FocalConfig(), first_probes=2, probe_rate=0.0, explore_rate=0.0, budget=0.5)
    engine = FocalEngine(4, config=config)
    assert engine.first_queries(["a", "a", "b", "a", "b"], [None, None, 0.5, None, None]) == [
        True,
        True,
        False,
        False,
        True,
    ]
    assert engine.asked == {"a": 2, "b": 2}
    assert engine.first_queries(["a", "b", "c"], [None, None, None]) == [False, False, True]
    engine.load_state({}, {}, {}, {"c": 1})
    decided = decide_batch(engine, [("c", 3, None), ("c", 3, None)])
    first, second = decided.decisions
    assert first.called is engine.everyone and second.called is second.pool and decided.probes == [False, False]
    engine.budget.offset = -0.01  # the cap's savings used up
    assert engine.first_queries(["d"], [None]) == [False] and engine.asked["d"] == 1
    engine.budget.offset = 0.0
    assert engine.first_queries(["d"], [None]) == [True]
    engine.reset_windows(known=False)
    assert engine.first_queries(["e"], [None]) == [False] and engine.asked is None
    engine.reset_windows()
    assert engine.first_queries(["e"], [None]) == [True]
    for _ in range(2):  # a window with as many rows (a warm start's) counts as asked
        engine.observe("w", np.zeros(4, dtype=np.int64), 0, 1.0)
    assert engine.first_queries(["w"], [None]) == [False] and "w" not in engine.asked
    assert FocalEngine(4, config=replace(config, first_probes=0)).first_queries(["a"], [None]) == [False]
