"""The cost the user sets: a budget on the mean share of the whole pool's cost spent per query, met online.

:class:`BudgetController` shifts the greedy Decider's logits by one offset (a model joins the pool when its logit
plus the offset is positive): after each query the offset falls by ``rate`` times what the query spent above the
budget, and rises by as much below it (a dual variable on the budget constraint, as RouteLLM calibrates its
threshold to a share of strong-model calls). Pure and deterministic; the engine applies and feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BudgetController:
    budget: float  # target mean share of the whole pool's cost per query, in (0, 1]
    rate: float = 0.05  # offset change per unit of cost share above or below the budget
    limit: float = 10.0  # the offset stays within [-limit, limit]
    offset: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.budget <= 1:
            raise ValueError(f"a budget is a share of the pool's cost per query, in (0, 1]; got {self.budget}")

    def observe(self, cost_share: float) -> None:
        """One query's spending (the called models' share of the pool's cost)."""
        self.offset = min(self.limit, max(-self.limit, self.offset - self.rate * (cost_share - self.budget)))


def lowest_spending(cost_share: np.ndarray, probe_rate: float) -> float:
    """The least a budget can get: the cheapest model alone on every query but the probes, which call everyone."""
    return (1 - probe_rate) * float(np.min(cost_share)) + probe_rate
