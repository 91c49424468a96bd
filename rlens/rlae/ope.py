"""Off-policy evaluation of RLAE span-weight policies: a kernel on the weights (issue 35, item 6).

An RLAE episode is one generation: the agent picks a weight vector at each span start and the reward (exact match)
comes after the last span. The logging policy samples each span's weights from its Dirichlet and logs the density
of what it drew (``Span.logp``). A candidate serves its greedy weights, one point of the simplex per span: the
probability that a continuous logging policy draws exactly that point is 0, so plain importance weights do not
exist. The kernel estimator (Kallus and Zhou, 2018) smooths the candidate into a density around its greedy weights
and weighs each logged episode by that density over the logging one, span by span:

    w_i = prod over the episode's spans of Dir(a_s; kappa * mu(x_s) + floor) / pi_logging(a_s | x_s)

with mu(x_s) the candidate's greedy weights in the logged state. kappa is the kernel's concentration: a larger one
is less biased (the smoothed candidate is closer to the greedy one) and has fewer effective samples. The estimate
is then :func:`rlens.evaluation.ope.ips` or :func:`rlens.evaluation.ope.snips` of the episodes' rewards with these
weights. This is ``ppo``'s case (a Dirichlet over the weights); ``mappo`` logs Gaussian logits, whose kernel would
be a Gaussian on the logits (not built). Pure torch/numpy, deterministic. Measured on the zoo (``bench.rlae.ope``, BENCHMARKS.md): it ranks
candidates near the logging policy fairly, but its intervals undercover and far candidates get a few effective
episodes, so RLAE's policies are not gated on it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.distributions import Dirichlet

KERNEL_FLOOR = 0.05  # added to every concentration: a candidate on a vertex still has a density


def kernel_log_density(greedy: np.ndarray, actions: np.ndarray, concentration: float) -> np.ndarray:
    """log Dir(a; concentration * mu + KERNEL_FLOOR) of each logged action ``actions`` [n, M] around a candidate's
    greedy weights ``greedy`` [n, M] (rows on the simplex) -> [n]."""
    alpha = torch.from_numpy(concentration * np.asarray(greedy, dtype=np.float64) + KERNEL_FLOOR)
    return Dirichlet(alpha, validate_args=False).log_prob(torch.from_numpy(np.asarray(actions, np.float64))).numpy()


def episode_weights(
    target_log_density: np.ndarray, logging_log_density: np.ndarray, episode: np.ndarray, n_episodes: int
) -> np.ndarray:
    """Each episode's importance weight, exp of the sum over its spans of (target - logging) log-densities; the
    span arrays are [S] over every logged span, ``episode`` [S] the index of each span's episode."""
    log_ratio = np.bincount(
        episode, weights=np.asarray(target_log_density) - np.asarray(logging_log_density), minlength=n_episodes
    )
    return np.exp(log_ratio)
