"""What the serving policy's mixture logs for off-policy evaluation: the probability that it took the action it took.

A query is explored with probability ``explore_rate`` (both agents sample: the Decider its pool, the Fusion agent its
answer) and greedy otherwise (the Decider's most likely pool, the Fusion agent's most likely answer). So the
probability of serving pool ``p`` and answer ``a`` in a state is

    explore_rate · P_Decider(p) · P_Fusion(a | p) + (1 − explore_rate) · [p is the greedy pool] · [a is the greedy answer on p]

whichever branch served it: a greedy row could also have been drawn by the explored branch, and an explored row can
be the greedy action. Probes (the whole pool called to refresh the windows) change which models are called, not the
action, so they do not enter it.
"""

from __future__ import annotations

import math


def serving_propensity(
    explore_rate: float, pool_logp: float, answer_logp: float, pool_is_greedy: bool, answer_is_greedy: bool
) -> float:
    """The mixture's probability of the served (pool, answer); ``pool_logp`` and ``answer_logp`` are the agents'
    log-probabilities of that pool and that answer (the sampling distributions, whichever branch served)."""
    if not 0.0 <= explore_rate <= 1.0:
        raise ValueError(f"explore_rate must be in [0, 1], got {explore_rate}")
    sampled = math.exp(pool_logp + answer_logp)
    greedy = 1.0 if pool_is_greedy and answer_is_greedy else 0.0
    return explore_rate * sampled + (1.0 - explore_rate) * greedy
