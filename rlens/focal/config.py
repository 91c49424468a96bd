"""Every hyper-parameter of RL-Focal in one dataclass (CleanRL style)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from rlens.focal.metrics import METRIC_NAMES


@dataclass(frozen=True)
class FocalConfig:
    # sliding window and observations
    window: int = 128  # W: outcomes kept per stream key
    max_streams: int = 10_000  # per-stream state the engine keeps (previous pools), least recently used dropped first
    metrics: tuple[str, ...] = METRIC_NAMES  # diversity metrics in the Decider's observation
    recent_rewards: int = 16  # rewards averaged into the Decider's observation
    use_decider: bool = True  # False: every query goes to the whole pool (ablation "all models")
    decider_sees: Literal["full", "paper"] = (
        "full"  # "paper": the Decider observation keeps only the pool bits and diversity metrics (ablation)
    )
    marginal_diversity: bool = False  # the Decider also sees each model's marginal effect on its previous pool's focal diversity (issue 15, item 4)
    # each model's calibration per stream (rlens.focal.calibration) from its last calibration_rows labelled outcomes;
    # the greedy Fusion's distribution is multiplied by its pool's calibrated vote (0: none; 200 chosen on bbh_dev's
    # tuning half, BENCHMARKS.md)
    calibration_rows: int = 200
    calibration_refit: int = 16  # refit a model's calibration once this many new rows have come
    # a stream keeps its last joint_rows labelled queries whole, and a pool's joint fit over its members'
    # log-probabilities replaces the pool's vote where it predicts the stream's newest rows better, from an eighth of
    # them (rlens.focal.calibration.PoolCombiner; 0: the vote alone; 4000 chosen on the long validation streams and
    # bbh_dev, BENCHMARKS.md)
    joint_rows: int = 4000
    # reward
    alpha: float = 0.24  # cost weight: reward = +-1 - alpha * cost(pool) / cost(whole pool); chosen on bbh_dev's tuning half (BENCHMARKS.md)
    # MAPPO
    gamma: float = 0.0  # a pool can change at every query, so later rewards carry no credit for this one
    gae_lambda: float = 0.9
    clip: float = 0.2
    lr: float = 1e-3
    update_epochs: int = 4
    minibatch_size: int = 64
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    label_coef: float = (
        1.0  # weight of the Fusion's cross-entropy on labelled transitions (greedy ones too) in each update
    )
    max_grad_norm: float = 0.5
    hidden: int = 64
    # schedule
    update_period: int = 64  # T: online update once T explored queries have their feedback
    warm_batch: int = 256  # questions per warm-start update
    warm_rollouts: int = 4  # warm start: each recorded question is played this many times (parallel environments)
    decider_warm_passes: int = 1  # passes over the warm-start split (Algorithm 1, Decider phase)
    fusion_supervised_epochs: int = (
        4  # warm start: cross-entropy epochs of the Fusion on the labels before its MAPPO passes (0: none)
    )
    fusion_warm_passes: int = (
        1  # passes over the warm-start split (Algorithm 1, Fusion phase, after the supervised start)
    )
    joint_warm_passes: int = 2  # then passes updating both agents on the Fusion agent's reward
    # the cost the user sets: a share of the whole pool's cost per query (None: the cost weight alpha alone), met by
    # an offset on the greedy Decider's logits (rlens.focal.budget); by default a cap of half the pool's cost, chosen
    # on the validation sets (BENCHMARKS.md, "A budget as a cap")
    budget: float | None = 0.5
    stream_budgets: tuple[tuple[str, float], ...] = ()  # (stream, budget): streams met on their own; others: budget
    budget_cap: bool = True  # the budgets as caps: spending under them is left to alpha; False: met on average
    budget_rate: float = 0.5  # the offset's step per unit of cost share off the budget (rlens.focal.budget)
    explore_rate: float = 0.05  # online: share of queries on which both agents sample (and train); the rest are greedy
    probe_rate: float = 0.05  # online: fraction of queries that also call the rest of the pool to refresh windows
    # online: a stream's first first_probes queries call every model too (while its budget has not been overspent), so
    # that no model is judged on its first two or three rows (16 chosen on the task-switch validation sets,
    # BENCHMARKS.md; 0: none)
    first_probes: int = 16
    feedback_delay: int = 0  # replay: feedback of query t arrives before query t + 1 + delay

    def to_dict(self) -> dict:
        return asdict(self)
