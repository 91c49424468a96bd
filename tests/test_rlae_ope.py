"""RLAE's off-policy evaluation: the kernel on the span weights and the episodes' importance weights by hand, and a
Monte Carlo check that the kernel estimate finds a smoothed candidate's value from a uniform logging policy."""

import math

import numpy as np
import pytest

from rlens.evaluation.ope import ips, snips
from rlens.rlae.ope import KERNEL_FLOOR, episode_weights, kernel_log_density


def test_the_kernel_is_a_dirichlet_around_the_greedy_weights():
    # concentration 1.9 around (0.5, 0.5): Dir(1, 1), the uniform density 1 on the segment
    flat = kernel_log_density(np.array([[0.5, 0.5]]), np.array([[0.3, 0.7]]), 1.9)
    assert flat == pytest.approx([0.0], abs=1e-9)
    # around (1.95, 0.95) / 2.9 with concentration 2.9: Dir(2, 1), density 2 a_0 = 0.5 at a = (0.25, 0.75)
    greedy = np.array([[1.95, 0.95]]) / 2.9
    assert kernel_log_density(greedy, np.array([[0.25, 0.75]]), 2.9) == pytest.approx([math.log(0.5)], abs=1e-9)
    # a candidate on a vertex still has a density: the floor
    vertex = kernel_log_density(np.array([[1.0, 0.0, 0.0]]), np.array([[0.9, 0.05, 0.05]]), 10.0)
    assert np.isfinite(vertex).all() and KERNEL_FLOOR > 0


def test_an_episode_weighs_the_product_of_its_spans_ratios():
    target = np.log([2.0, 3.0, 1.0])
    logging = np.log([1.0, 1.5, 4.0])
    weights = episode_weights(target, logging, np.array([0, 0, 1]), 3)
    assert weights == pytest.approx([4.0, 0.25, 1.0])  # 2 * 3 / 1.5; 1 / 4; no span: 1


def test_the_kernel_estimate_finds_a_smoothed_candidates_value():
    """One span, three models, the logging policy uniform on the simplex (Dir(1, 1, 1), density 2), the reward the
    first weight: the estimate is the smoothed candidate's mean first weight, (0.6 kappa + floor) / (kappa + 3 floor)."""
    rng = np.random.default_rng(0)
    n, kappa = 200_000, 20.0
    actions = rng.dirichlet(np.ones(3), n)
    greedy = np.tile([0.6, 0.2, 0.2], (n, 1))
    w = episode_weights(kernel_log_density(greedy, actions, kappa), np.full(n, math.log(2.0)), np.arange(n), n)
    truth = (0.6 * kappa + KERNEL_FLOOR) / (kappa + 3 * KERNEL_FLOOR)
    for estimate in (ips(actions[:, 0], w, np.ones(n)), snips(actions[:, 0], w, np.ones(n))):
        assert estimate.low < truth < estimate.high and abs(estimate.value - truth) < 0.01
