"""The cost the user sets: a budget on the mean share of the whole pool's cost spent per query, met online.

:class:`BudgetController` keeps one offset, a dual variable on the budget constraint: model j's greedy Decider logit
gets ``offset`` times its price (its share of the pool's cost times the pool's size; 1 for every model when all cost
the same), and j joins the pool when the shifted logit is positive. After each query the offset falls by ``rate``
times what the query spent above the budget, and rises by as much below it, the way RouteLLM calibrates its threshold
to a share of strong-model calls. Pricing the shift makes an expensive model leave the pool first, where one equal
shift would leave the most likely model alone in the pool however expensive it is. The offset is the sum of the past
errors, so what a run of n queries spent above the budget in all is the offset's change over them divided by
``rate``: a larger rate holds every window closer to the budget, at the price of a pool that moves more from query to
query. As a *cap* (``cap``) the logits get only the offset's part under 0 (:attr:`BudgetController.shift`): what is
spent under the budget is left to the cost weight alone and saved, up to ``saving`` of what the budget allows over
1,000 queries (25 %: 125 queries of the whole pool under a cap of 0.5; 5 % cut a cold start's costly task blocks on
the bundled stream, BENCHMARKS.md), and spending is pushed down only once what was saved is used up: a token bucket,
like a rate limit's, that starts full, so a run of costly queries is not cut at once. A deployment sets one budget,
and may give some streams their own: each has its own controller. Pure and deterministic; the engine applies and
feeds it.

A query may also carry its own budget, a cap on what that query alone spends: :func:`fit_pool` cuts the greedy pool
to it (no exploration and no probe on such a query).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BudgetController:
    budget: float  # target mean share of the whole pool's cost per query, in (0, 1]
    rate: float = 0.5  # offset change per unit of cost share off the budget (chosen on bbh_dev's tuning half)
    limit: float = 10.0  # the offset stays within [-limit, limit] (a cap's: [-limit, rate * bucket])
    offset: float = 0.0
    cap: bool = False  # at most the budget on average (only the offset's part under 0 shifts); False: on average
    saving: float = 0.25  # as a cap, what it may save (and starts with): this share of the budget over 1,000 queries

    def __post_init__(self) -> None:
        if not 0 < self.budget <= 1:
            raise ValueError(f"a budget is a share of the pool's cost per query, in (0, 1]; got {self.budget}")
        if self.cap:
            self.offset = self.rate * self.bucket  # it starts full

    def observe(self, cost_share: float) -> None:
        """One query's spending (the called models' share of the pool's cost)."""
        ceiling = self.rate * self.bucket if self.cap else self.limit
        self.offset = min(ceiling, max(-self.limit, self.offset - self.rate * (cost_share - self.budget)))

    @property
    def bucket(self) -> float:
        """What a cap may save, in queries of the whole pool."""
        return self.saving * self.budget * 1000

    @property
    def shift(self) -> float:
        """What the greedy Decider's logits get per unit of a model's price: the offset, or as a cap its part under 0."""
        return min(self.offset, 0.0) if self.cap else self.offset


def logit_shift(offsets: float | np.ndarray, prices: np.ndarray) -> np.ndarray:
    """What the greedy Decider's logits get under ``offsets`` (a number, or one per query [B]) with each model's
    price [M] (its cost share times the pool's size): [M] or [B, M]."""
    return np.multiply.outer(offsets, prices).astype(np.float32)


def lowest_spending(cost_share: np.ndarray, probe_rate: float) -> float:
    """The least a budget can get: the cheapest model alone on every query but the probes, which call everyone."""
    return (1 - probe_rate) * float(np.min(cost_share)) + probe_rate


def fit_pool(pool: np.ndarray, logits: np.ndarray, cost_share: np.ndarray, cap: float) -> np.ndarray:
    """``pool`` cut to cost at most ``cap`` of the pool's cost: its models taken most likely first (by ``logits``,
    the cheaper first on a tie), each kept if it still fits. When none fits, the most likely model of the whole pool
    that fits alone, or the cheapest one when none does (a cap below every model's share)."""
    cap += 1e-9  # shares that add up to the cap exactly, in floating point
    if float(cost_share[pool].sum()) <= cap:
        return pool
    order = np.lexsort((cost_share, -logits))  # most likely first, then cheapest
    fitted = np.zeros_like(pool)
    spent = 0.0
    for j in order:
        if pool[j] and spent + cost_share[j] <= cap:
            fitted[j], spent = True, spent + float(cost_share[j])
    if not fitted.any():
        alone = [j for j in order if cost_share[j] <= cap]
        fitted[alone[0] if alone else int(np.argmin(cost_share))] = True
    return fitted
