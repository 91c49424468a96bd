"""Observation builders for the Decider, the Fusion agent and the centralized critic (pure numpy).

Decider observation (before any model is called), length 4M + K + 4:
  previous pool bits [M] | diversity metrics of that pool [K] | its plurality-vote window accuracy |
  per-model features [3M]: window reliability r_j, gap r_j - max r, rank (0 = most reliable, 1 = least) |
  window fill | mean recent reward | 1 / n_choices (0 for an open-ended query: its candidates are known only after the call);
  with ``marginal`` (the ``marginal_diversity`` setting), M more: each model's marginal effect on the previous pool's
  focal diversity (:meth:`OutcomeWindow.marginal_focal_diversity`).
Critic state (centralized critic), length (4M + K + 4) + 3M + 1: the Decider observation, then a summary of the
answers of the pool the Fusion agent fused — per pool model its top probability, normalised entropy and agreement
with the pool's plurality (0 for models outside the pool) — and the pool's share of the models. It is built the same
way in the warm start and online (from the pool's answers only). The critic's Decider head reads only the Decider
observation (the summary depends on the Decider's action, so it cannot be the Decider's baseline); its Fusion head
reads all of it (the pool's answers are the Fusion agent's state).

Fusion observation, one row per choice c (shared network across choices), 5M + 3 features:
  for each model i: s_i log p_i(c), s_i [c = argmax p_i], s_i r_i log p_i(c), s_i r_i [c = argmax p_i], s_i r_i
  with s_i = 1 if model i is in the pool (else 0) and r_i its window reliability;
  then the window's label frequency of c, its log (smoothed), and 1 / n_choices.
"""

from __future__ import annotations

import numpy as np

from rlens.focal.window import OutcomeWindow

LOG_FLOOR = 1e-6
FUSION_GLOBAL_FEATURES = 3
FUSION_FEATURES_PER_MODEL = 5


def decider_obs_dim(n_models: int, n_metrics: int, marginal: bool = False) -> int:
    return 4 * n_models + n_metrics + 4 + (n_models if marginal else 0)


def critic_state_dim(n_models: int, n_metrics: int, marginal: bool = False) -> int:
    return decider_obs_dim(n_models, n_metrics, marginal) + 3 * n_models + 1


def critic_state(decider_state: np.ndarray, probs: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """Decider observation + summary of the answers ``probs`` [M, C] of the models in ``pool`` (bool [M])."""
    return critic_states(decider_state[None], probs[None], pool[None])[0]


def critic_states(decider_states: np.ndarray, probs: np.ndarray, pools: np.ndarray) -> np.ndarray:
    """:func:`critic_state` of B queries with the same number of choices: [B, D], [B, M, C], bool [B, M]."""
    b, m, c = probs.shape
    d = decider_states.shape[1]
    out = np.empty((b, d + 3 * m + 1), dtype=np.float32)
    selected = pools.astype(np.float32)
    entropy = -(probs * np.log(np.maximum(probs, LOG_FLOOR))).sum(2) / np.log(max(c, 2))  # one choice (all agree): 0
    predictions = probs.argmax(2)
    cells = (np.arange(b)[:, None] * c + predictions).ravel()
    votes = np.bincount(cells, weights=pools.ravel(), minlength=b * c).reshape(b, c)  # the pool's votes per choice
    plurality = np.where(pools.any(1), votes.argmax(1), -1)
    out[:, :d], out[:, d : d + m], out[:, d + m : d + 2 * m] = (
        decider_states,
        probs.max(2) * selected,
        entropy * selected,
    )
    out[:, d + 2 * m : d + 3 * m] = (predictions == plurality[:, None]) * selected
    out[:, -1] = selected.sum(1) / m
    return out


def model_features_in_decider_obs(n_models: int, n_metrics: int) -> slice:
    """Where the per-model features (reliability [M], gap [M], rank [M]) sit in a Decider observation."""
    start = n_models + n_metrics + 1
    return slice(start, start + 3 * n_models)


def reliability_weighted_log_probs(n_models: int) -> slice:
    """Where the features s_i r_i log p_i(c) sit in a Fusion feature row."""
    return slice(2 * n_models, 3 * n_models)


def fusion_feature_dim(n_models: int) -> int:
    return FUSION_FEATURES_PER_MODEL * n_models + FUSION_GLOBAL_FEATURES


def decider_observation(
    window: OutcomeWindow,
    previous_pool: np.ndarray,
    n_choices: int,
    metric_names: tuple[str, ...],
    recent: int,
    sees: str = "full",
    marginal: bool = False,
) -> np.ndarray:
    """The Decider observation; ``sees="paper"`` zeroes everything after the pool bits and diversity metrics (the
    RL-Focal paper's observation, same length); ``marginal`` appends each model's marginal focal diversity."""
    metrics, vote_accuracy = window.pool_statistics(previous_pool, metric_names)
    m = len(previous_pool)
    if sees == "paper":
        return np.concatenate(
            [previous_pool.astype(np.float32), metrics, np.zeros(3 * m + 4 + (m if marginal else 0), dtype=np.float32)]
        )
    extra = [window.marginal_focal_diversity(previous_pool)] if marginal else []
    reliability = window.reliability()
    rank = np.argsort(np.argsort(-reliability, kind="stable"), kind="stable") / max(m - 1, 1)
    return np.concatenate(
        [
            previous_pool.astype(np.float32),
            metrics,
            np.array([vote_accuracy], dtype=np.float32),
            reliability,
            reliability - reliability.max(),
            rank.astype(np.float32),
            np.array(
                [window.fill, window.recent_reward(recent), 1.0 / n_choices if n_choices else 0.0], dtype=np.float32
            ),
            *extra,
        ]
    )


def stack_rows(arrays: list[np.ndarray]) -> np.ndarray:
    """``np.stack(arrays)``, without its few microseconds of overhead for a single array (the one-query path)."""
    return arrays[0][None] if len(arrays) == 1 else np.stack(arrays)


def padded_choices(features: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-query Fusion observations [C_i, F] of any choice counts stacked into [B, C_max, F] (zeros past each
    query's choices) with the validity mask bool [B, C_max]."""
    width = max(f.shape[0] for f in features)
    if all(f.shape[0] == width for f in features):  # nothing to pad
        return stack_rows(features).astype(np.float32, copy=False), np.ones((len(features), width), dtype=bool)
    padded = np.zeros((len(features), width, features[0].shape[1]), dtype=np.float32)
    mask = np.zeros((len(features), width), dtype=bool)
    for i, f in enumerate(features):
        padded[i, : len(f)], mask[i, : len(f)] = f, True
    return padded, mask


def fusion_observation(
    probs: np.ndarray, pool: np.ndarray, reliability: np.ndarray, label_prior: np.ndarray
) -> np.ndarray:
    """Per-choice features [C, 5M + 3] for the valid choices of one query (probs [M, C_valid])."""
    return fusion_observations(probs[None], pool[None], reliability[None], label_prior[None])[0]


def fusion_observations(
    probs: np.ndarray, pools: np.ndarray, reliability: np.ndarray, label_prior: np.ndarray
) -> np.ndarray:
    """:func:`fusion_observation` of B queries with the same number of choices: probs [B, M, C], pools bool [B, M],
    reliability [B, M], label_prior [B, >= C] -> [B, C, 5M + 3]."""
    b, m, c = probs.shape
    out = np.empty((b, c, FUSION_FEATURES_PER_MODEL * m + FUSION_GLOBAL_FEATURES), dtype=np.float32)
    selected = pools.astype(np.float32)[:, None, :]  # [B, 1, M]
    rel = reliability.astype(np.float32)[:, None, :]
    per_choice = probs.transpose(0, 2, 1)  # [B, C, M]
    log_p = np.log(np.maximum(per_choice, LOG_FLOOR)) * selected
    top = (np.arange(c)[None, :, None] == probs.argmax(2)[:, None, :]).astype(np.float32) * selected
    out[..., :m], out[..., m : 2 * m], out[..., 2 * m : 3 * m] = log_p, top, rel * log_p
    out[..., 3 * m : 4 * m], out[..., 4 * m : 5 * m] = rel * top, rel * selected
    prior = label_prior[:, :c]
    out[..., 5 * m], out[..., 5 * m + 1], out[..., 5 * m + 2] = prior, np.log(prior + 0.02), np.float32(1.0 / c)
    return out
