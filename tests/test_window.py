"""Per-stream outcome windows: partial observation, smoothing, label prior, ring-buffer order."""

import numpy as np
import pytest

from rlens.focal.voting import plurality_vote
from rlens.focal.window import OutcomeWindow


def test_reliability_is_laplace_smoothed_over_observed_rows():
    window = OutcomeWindow(n_models=3, size=4)
    assert window.reliability().tolist() == [0.5, 0.5, 0.5]  # empty: (0 + 1) / (0 + 2)
    window.push(np.array([1, 0, -1]), label=1, reward=1.0)  # model 2 not called
    window.push(np.array([1, 1, 2]), label=2, reward=-1.0)
    # model 0: right once of 2 -> 2/4; model 1: 0 of 2 -> 1/4; model 2: 1 of 1 -> 2/3
    assert window.reliability() == pytest.approx([0.5, 0.25, 2 / 3])


def test_pool_rows_use_only_rows_where_every_member_was_observed():
    window = OutcomeWindow(n_models=3, size=8)
    window.push(np.array([0, 0, -1]), label=0, reward=1.0)
    window.push(np.array([0, 1, 1]), label=1, reward=1.0)
    correct, predictions, labels = window.pool_rows(np.array([True, False, True]))
    assert correct.tolist() == [[False, True]] and predictions.tolist() == [[0, 1]] and labels.tolist() == [1]
    metrics, vote_accuracy = window.pool_statistics(np.array([True, True, False]))
    assert vote_accuracy == 0.5  # row 0: votes 0,0 -> right; row 1: votes 0,1 tie -> 0 -> wrong


def test_pool_statistics_vote_is_the_plurality_vote_on_the_known_labels():
    """The vote accuracy comes from the kappa's per-row choice counts; it must equal plurality_vote's, ties to the
    lowest choice, with reward-only rows (label -1) left out, on random windows and pools."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        m, n_choices = int(rng.integers(1, 6)), int(rng.integers(2, 5))
        window = OutcomeWindow(m, int(rng.integers(1, 20)))
        for _ in range(int(rng.integers(1, 30))):
            window.push(rng.integers(-1, n_choices, m), label=int(rng.integers(-1, n_choices)), reward=1.0)
        pool = rng.random(m) < 0.6
        pool[rng.integers(m)] = True
        _, predictions, labels = window.pool_rows(pool)
        known = labels >= 0
        expected = (
            float((plurality_vote(predictions[known], n_choices) == labels[known]).mean()) if known.any() else 0.5
        )
        assert window.pool_statistics(pool)[1] == expected


def test_ring_buffer_keeps_the_last_rows_and_reward_only_feedback():
    window = OutcomeWindow(n_models=2, size=3)
    for label in range(5):
        window.push(np.array([label, 0]), label=label, reward=float(label))
    assert window.n_rows == 3 and window.fill == 1.0
    assert window.recent_reward(2) == pytest.approx(3.5)  # rewards 3 and 4
    assert window.label_prior(5).tolist() == pytest.approx([0, 0, 1 / 3, 1 / 3, 1 / 3])
    window.push(np.array([1, 1]), label=-1, reward=1.0)  # a bare reward: correctness unknown
    correct, _, _ = window.pool_rows(np.array([True, True]))
    assert len(correct) == 2


def test_window_size_must_be_positive():
    with pytest.raises(ValueError):
        OutcomeWindow(2, 0)


def test_keep_last_forgets_all_but_the_last_rows_in_order():
    window = OutcomeWindow(3, 4)
    for i in range(6):  # the ring holds rows 2..5
        window.push(np.array([i % 2, -1, 1]), label=1, reward=float(i))
    window.keep_last(2)
    assert window.n_rows == 2 and window.count == 2
    assert window.recent_reward(1) == 5.0 and window.recent_reward(2) == 4.5  # rows 4 and 5, newest last
    # model 0 right on row 5 only
    assert window.reliability().tolist() == pytest.approx([(1 + 1) / (2 + 2), 0.5, (2 + 1) / (2 + 2)])
    window.keep_last(0)
    assert window.n_rows == 0 and window.recent_reward(3) == 0.0


@pytest.mark.parametrize("n", [0, 3, 4, 11])
def test_extend_equals_pushing_row_by_row(n):
    rng = np.random.default_rng(n)
    predictions = rng.integers(-1, 4, size=(n, 3))
    labels, rewards = rng.integers(-1, 4, size=n), rng.normal(size=n).astype(np.float32)
    pushed, extended = OutcomeWindow(3, 4), OutcomeWindow(3, 4)
    pushed.push(np.array([1, 1, -1]), 1, 0.5)  # both start mid-ring
    extended.push(np.array([1, 1, -1]), 1, 0.5)
    for row in range(n):
        pushed.push(predictions[row], int(labels[row]), float(rewards[row]))
    extended.extend(predictions, labels, rewards)
    assert extended.count == pushed.count == n + 1
    for field in ("correct", "predictions", "labels", "rewards"):
        assert np.array_equal(getattr(extended, field), getattr(pushed, field)), field
    assert extended.reliability().tolist() == pushed.reliability().tolist()


def test_marginal_focal_diversity_by_hand():
    """Pool {0, 1}. Rows (right / wrong / not called): [R W R], [W R W], [W W R], [R R -].
    Members, on the 4 rows where both were seen: FD({0, 1}) = 1/3 (each fails once alone and once with the other)
    and FD of one model = 0, so each adds 1/3. Outsider 2, on the 3 rows where all were seen: FD({0, 1, 2}) = 5/9
    and FD({0, 1}) = 1/3 there, so it adds 2/9."""
    w = OutcomeWindow(3, 8)
    for predictions in ([0, 1, 0], [1, 0, 1], [1, 1, 0], [0, 0, -1]):
        w.push(np.array(predictions), 0, 0.0)
    np.testing.assert_allclose(
        w.marginal_focal_diversity(np.array([True, True, False])), [1 / 3, 1 / 3, 2 / 9], atol=1e-6
    )
    alone = OutcomeWindow(3, 8)
    alone.push(np.array([0, 1, 1]), 0, 0.0)  # one row: too few to say anything
    np.testing.assert_array_equal(alone.marginal_focal_diversity(np.array([True, False, False])), [0, 0, 0])
