"""The cost the user sets: the budget controller by hand, the offset on the greedy Decider's logits, an engine that
meets its budget online on the bundled stream, the propensity of a decision taken under an offset, and a query's
own budget (the pool cut to fit it, by hand and on the bundled stream)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from rlens.focal.budget import BudgetController, fit_pool, logit_shift
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.focal.schedule import run_online


def test_the_offset_moves_by_rate_times_the_spending_against_the_budget():
    controller = BudgetController(budget=0.5, rate=0.1)
    controller.observe(1.0)  # 0.5 above: -0.1 * 0.5
    assert controller.offset == pytest.approx(-0.05)
    controller.observe(0.2)  # 0.3 below: +0.1 * 0.3
    assert controller.offset == pytest.approx(-0.02)
    flooded = BudgetController(budget=0.5, rate=100.0)
    flooded.observe(1.0)
    assert flooded.offset == -10.0  # within [-limit, limit]
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        BudgetController(budget=1.5)


def test_a_cap_is_a_token_bucket_that_starts_full_and_shifts_only_once_empty():
    cap = BudgetController(budget=0.5, rate=0.1, cap=True, saving=0.004)  # 0.4 % of 500: 2 queries of the pool
    assert cap.bucket == pytest.approx(2.0) and cap.offset == pytest.approx(0.2) and cap.shift == 0.0  # full
    cap.observe(0.2)  # 0.3 below: it cannot save more than 2
    assert cap.offset == pytest.approx(0.2)
    for _ in range(5):  # 2.5 above: 0.5 more than was saved
        cap.observe(1.0)
    assert cap.offset == pytest.approx(-0.05) and cap.shift == pytest.approx(-0.05)
    cap.observe(0.3)  # 0.2 below: 0.02 back, still in debt
    assert cap.offset == pytest.approx(-0.03) and cap.shift == pytest.approx(-0.03)
    cap.observe(0.0)  # 0.5 below: the debt paid, 0.2 saved again
    assert cap.offset == pytest.approx(0.02) and cap.shift == 0.0
    mean = BudgetController(budget=0.5, rate=0.1)  # a mean budget starts at 0 and shifts both ways
    mean.observe(0.2)
    assert mean.shift == mean.offset == pytest.approx(0.03)


def test_the_offset_adds_to_every_logit_of_the_greedy_decider():
    engine = FocalEngine(5, seed=0)
    with torch.no_grad():  # distinct logits (an untrained Decider gives every model the same)
        engine.decider.heads.bias += torch.tensor([-3.0, -1.5, 0.0, 1.5, 3.0])
    state = engine._state("s", 4)[None]
    logits = engine.greedy.decider_logits(state)[0]
    assert len(set(np.round(logits, 3))) == 5
    assert (engine.greedy.pools(state, 0.0)[0][0] == (logits > 0)).all()
    assert engine.greedy.pools(state, 100.0)[0][0].all()  # everyone
    alone = engine.greedy.pools(state, -100.0)[0][0]
    assert alone.sum() == 1 and alone[logits.argmax()]  # the most likely model alone
    middle = float(np.sort(logits)[2])  # an offset that keeps exactly the two largest logits positive
    assert engine.greedy.pools(state, -middle - 1e-4)[0][0].sum() == 2


def test_the_shift_is_the_offset_times_each_models_price():
    prices = np.array([4.0, 0.5, 0.5])
    assert logit_shift(-0.5, prices) == pytest.approx([-2.0, -0.25, -0.25])
    assert np.allclose(logit_shift(np.array([1.0, -1.0]), prices), [[4.0, 0.5, 0.5], [-4.0, -0.5, -0.5]])
    engine = FocalEngine(3, np.array([8.0, 1.0, 1.0]), replace(FocalConfig(), budget=0.5, budget_cap=False), seed=0)
    assert engine.prices == pytest.approx([2.4, 0.3, 0.3])  # cost share times M
    assert FocalEngine(3, config=replace(FocalConfig(), budget=None), seed=0).shift(-1.0) == 0.0  # no budget: no shift
    with torch.no_grad():
        engine.decider.heads.bias += torch.tensor([3.0, 1.0, 1.0])  # the priciest model the most likely
    state = engine._state("s", 4)[None]
    logits = engine.greedy.decider_logits(state)[0]
    # an offset of -2 takes 4.8 from the priciest model's logit and 0.6 from the others': it leaves first
    pool = engine.greedy.pools(state, engine.shift(-2.0))[0][0]
    assert (pool == (logits + np.array([-4.8, -0.6, -0.6]) > 0)).all() and not pool[0] and pool[1:].all()


def test_an_engine_meets_its_budget_online(zoo):
    """The bundled stream (1,200 queries, costs from 0.1 to 135 per model: one model is 99.6 % of the pool's cost):
    each budget's mean cost share over the second half of the stream within 0.03 of it, and a smaller budget spends
    less. (With one equal shift of every logit, the priciest model stayed alone in the pool whenever it was the most
    likely, and 0.3 spent 0.38.)"""
    spent = {}
    for budget in (0.3, 0.6):
        engine = FocalEngine(
            zoo.n_models, zoo.model_costs, replace(FocalConfig(), budget=budget, budget_cap=False), seed=0
        )
        trace = run_online(engine, zoo)
        spent[budget] = float(trace.cost_share[len(trace.cost_share) // 2 :].mean())
        assert abs(spent[budget] - budget) < 0.03, (budget, spent[budget])
    assert spent[0.3] < spent[0.6]


def test_a_cap_never_pushes_spending_up_and_holds_it_under_the_cap(zoo):
    """The bundled stream, where the cost weight alone spends about a quarter of the pool's cost (some tasks call the
    costly model on nearly every query, others almost never): under a cap of 0.6, which a mean budget meets at 0.6,
    spending stays at most the cost weight's own; under a cap of 0.15 the second half spends at most 0.15 (+0.02)."""
    free = run_online(FocalEngine(zoo.n_models, zoo.model_costs, replace(FocalConfig(), budget=None), seed=0), zoo)
    spent = {}
    for cap in (0.6, 0.15):
        config = replace(FocalConfig(), budget=cap, budget_cap=True)
        spent[cap] = run_online(FocalEngine(zoo.n_models, zoo.model_costs, config, seed=0), zoo).cost_share
    assert 0.15 < free.cost_share.mean() < 0.4
    assert 0.15 < spent[0.6].mean() <= free.cost_share.mean() + 0.005, spent[0.6].mean()
    half = len(free.cost_share) // 2
    assert spent[0.15][half:].mean() <= 0.17 and spent[0.15][half:].mean() < free.cost_share[half:].mean() - 0.05


def test_streams_with_budgets_of_their_own_meet_each_online(zoo):
    """The bundled stream's tasks as streams: two with budgets of their own (0.3 and 0.8), the rest under the
    deployment's 0.5. Each named stream's cost share over its second half within 0.04 of its budget, the others'
    together within 0.04 of 0.5; a stream's queries move only its own controller."""
    names = sorted({int(t) for t in zoo.task})
    own = {str(names[0]): 0.3, str(names[1]): 0.8}
    config = replace(FocalConfig(), budget=0.5, budget_cap=False, stream_budgets=tuple(own.items()))
    engine = FocalEngine(zoo.n_models, zoo.model_costs, config, seed=0)
    assert engine.budget_of(names[0]) is engine.stream_budgets[str(names[0])]
    assert engine.budget_of(names[2]) is engine.budget
    trace = run_online(engine, zoo)
    for stream, budget in [*own.items(), (None, 0.5)]:
        rows = np.flatnonzero(
            np.isin(zoo.task.astype(str), list(own), invert=True) if stream is None else zoo.task.astype(str) == stream
        )
        spent = float(trace.cost_share[rows[len(rows) // 2 :]].mean())
        assert abs(spent - budget) < 0.04, (stream, budget, spent)
    before = {k: b.offset for k, b in engine.stream_budgets.items()}, engine.budget.offset
    engine.decide_batch([(names[0], 4, False, True)])
    assert engine.stream_budgets[str(names[1])].offset == before[0][str(names[1])]
    assert engine.budget.offset == before[1] and engine.stream_budgets[str(names[0])].offset != before[0][str(names[0])]
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        FocalEngine(5, config=replace(FocalConfig(), stream_budgets=(("s", 0.0),)))


def test_a_decision_keeps_its_offset_and_its_greedy_pool_uses_it():
    engine = FocalEngine(5, config=replace(FocalConfig(), budget=0.2, budget_cap=False, budget_rate=5.0), seed=0)
    first = engine.decide_batch([("s", 4, False, True)])[0]
    assert first.offset == 0.0 and engine.budget is not None and engine.budget.offset < 0  # it spent above 0.2
    before = engine.budget.offset
    explored = engine.decide_batch([("s", 4, False, False)])[0]
    assert explored.offset == before != engine.budget.offset  # taken under the offset of its batch; it moved after
    expected = engine.greedy.pools(explored.state[None], engine.shift(explored.offset))[0][0]
    assert (engine.greedy_pools([explored])[0] == expected).all()


def test_a_pool_is_cut_to_a_querys_budget_most_likely_model_first():
    cost = np.array([0.5, 0.3, 0.2])
    likely = np.array([2.0, 1.0, 0.0])  # model 0 the most likely, then 1, then 2
    everyone = np.ones(3, dtype=bool)
    assert fit_pool(everyone, likely, cost, 1.0) is everyone  # within the budget: unchanged
    assert fit_pool(everyone, likely, cost, 0.5).tolist() == [True, False, False]  # 0; 0 + 1 and 0 + 2 do not fit
    assert fit_pool(everyone, likely, cost, 0.75).tolist() == [True, False, True]  # 0; not 1 (0.8); 2 (0.7)
    assert fit_pool(everyone, likely, cost, 0.4).tolist() == [False, True, False]  # 0 does not fit; 1; not 2 (0.5)
    assert fit_pool(everyone, np.zeros(3), cost, 0.5).tolist() == [False, True, True]  # a tie: the cheaper first
    only_0 = np.array([True, False, False])
    assert fit_pool(only_0, likely, cost, 0.4).tolist() == [False, True, False]  # none of the pool fits: 1 alone
    assert fit_pool(only_0, likely, cost, 0.1).tolist() == [False, False, True]  # none fits alone: the cheapest
    tenths = np.array([0.1, 0.2, 0.7])
    assert fit_pool(everyone, np.zeros(3), tenths, 0.3).tolist() == [True, True, False]  # 0.1 + 0.2 fits 0.3


def test_a_query_with_its_own_budget_spends_at_most_it_greedily(zoo):
    """The bundled stream's Decider (warm-started on half of it, explore and probe rates up): every capped query's
    called models cost at most its budget, greedy and without a probe, its propensity 1 and its log-probability the
    cut pool's under the greedy Decider; uncapped queries in the same batch are untouched."""
    from rlens.evaluation.logged import FocalPolicy, LoggedQuery
    from rlens.focal.schedule import warm_start

    config = replace(FocalConfig(), explore_rate=0.5, probe_rate=0.5)
    engine = FocalEngine(zoo.n_models, zoo.model_costs, config, seed=0)
    warm_start(engine, zoo.subset(np.arange(0, zoo.n_questions, 2)))
    streams = sorted({int(t) for t in zoo.task})
    queries = [(stream, 4, True, False) for stream in streams]
    probs, rel, prior = np.full((zoo.n_models, 4), 0.25), np.full(zoo.n_models, 0.5), np.full(4, 0.25)
    for cap in (0.005, 0.05, 0.3):
        capped = engine.decide_batch(queries, [cap] * len(queries))
        free = engine.decide_batch(queries)
        for d in capped:
            floor = float(engine.cost_share.min())
            assert float(engine.cost_share[d.called].sum()) <= max(cap, floor) + 1e-9
            assert not d.explored and (d.called == d.pool).all() and d.cap == cap
            logits = engine.greedy.decider_logits(d.state[None])[0] + engine.shift(d.offset)
            logp = np.where(d.pool, -np.logaddexp(0, -logits), -np.logaddexp(0, logits)).sum()
            greedy = engine.greedy.pools(d.state[None], engine.shift(d.offset))
            if (greedy[0][0] == d.pool).all():
                logp = greedy[1][0]  # uncut: the greedy pool's own
            assert d.pool_logp == pytest.approx(logp, abs=1e-5)
            assert engine.propensity(d, engine.fuse_batch([d], [np.full((zoo.n_models, 4), 0.25)])[0]) == 1.0
            logged = LoggedQuery(d.state, probs, d.called, rel, prior, d.pool, 0, 1.0, 0, False, budget=cap)
            assert (FocalPolicy("it", engine).act(logged)[0] == d.pool).all()  # off-policy evaluation cuts it too
        assert all(d.explored and d.called.all() and d.cap is None for d in free)  # the batch's own flags
