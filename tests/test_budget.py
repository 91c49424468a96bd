"""The cost the user sets: the budget controller by hand, the offset on the greedy Decider's logits, an engine that
meets its budget online on the bundled stream, and the propensity of a decision taken under an offset."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from rlens.focal.budget import BudgetController
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
    controller = BudgetController(budget=0.5, prices=np.array([4.0, 0.5, 0.5]))
    assert controller.shift(-0.5) == pytest.approx([-2.0, -0.25, -0.25])
    assert np.allclose(controller.shift(np.array([1.0, -1.0])), [[4.0, 0.5, 0.5], [-4.0, -0.5, -0.5]])
    assert BudgetController(budget=0.5).shift(0.25) == pytest.approx([0.25])  # no prices: one shift for all
    engine = FocalEngine(3, np.array([8.0, 1.0, 1.0]), replace(FocalConfig(), budget=0.5), seed=0)
    assert engine.budget is not None and engine.budget.prices == pytest.approx([2.4, 0.3, 0.3])  # share times M
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
        engine = FocalEngine(zoo.n_models, zoo.model_costs, replace(FocalConfig(), budget=budget), seed=0)
        trace = run_online(engine, zoo)
        spent[budget] = float(trace.cost_share[len(trace.cost_share) // 2 :].mean())
        assert abs(spent[budget] - budget) < 0.03, (budget, spent[budget])
    assert spent[0.3] < spent[0.6]


def test_a_decision_keeps_its_offset_and_its_greedy_pool_uses_it():
    engine = FocalEngine(5, config=replace(FocalConfig(), budget=0.2, budget_rate=5.0), seed=0)
    first = engine.decide_batch([("s", 4, False, True)])[0]
    assert first.offset == 0.0 and engine.budget is not None and engine.budget.offset < 0  # it spent above 0.2
    before = engine.budget.offset
    explored = engine.decide_batch([("s", 4, False, False)])[0]
    assert explored.offset == before != engine.budget.offset  # taken under the offset of its batch; it moved after
    expected = engine.greedy.pools(explored.state[None], engine.shift(explored.offset))[0][0]
    assert (engine.greedy_pools([explored])[0] == expected).all()
