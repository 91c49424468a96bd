"""The replay results file (``results.json``): a stable, versioned, documented shape (pydantic).

``schemas/replay_results.schema.json`` is generated from these models (``python -m rlens.evaluation.results``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "replay_results.schema.json"


class MethodResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    accuracy: float = Field(ge=0, le=1, description="fraction of the test questions answered correctly")
    per_task: dict[str, float] = Field(description="accuracy per task, keyed by task name")
    mean_models_called: float = Field(ge=0, description="models called per test question, on average")
    cost_share: float | None = Field(
        None, ge=0, description="the share of the whole pool's cost spent per test question, on average"
    )
    description: str = ""
    explored: float | None = Field(
        None, ge=0, le=1, description="RL-Focal: share of the test questions on which both agents sampled (and learned)"
    )
    greedy_accuracy: float | None = Field(
        None,
        ge=0,
        le=1,
        description="RL-Focal: accuracy had every test question been answered greedily "
        "from the same states (exploration cost = greedy_accuracy - accuracy)",
    )


class DriftResult(BaseModel):
    """RL-Focal's drift detections on the test stream (the learner's detector on its outcomes) and how the
    answers recovered after each task switch."""

    model_config = ConfigDict(extra="forbid")

    one_stream: bool = Field(
        description="every question on one window key (task switches are drift inside it); false: a key per task"
    )
    detector: str
    reaction: Literal["none", "trim", "reset"] = Field(description="what a detection did to the stream's window")
    detections: list[int] = Field(description="test questions whose outcome completed a detection")
    signals: list[list[str]] = Field(description="per detection, the signals that drifted (outcome, model:<index>)")
    delays: list[int] = Field(description="per detected switch: questions from the switch to its first detection")
    missed_switches: int = Field(description="switches with no detection in the first half of their block")
    switches: int
    false_alarms_per_1000: float = Field(
        description="detections in a block's second half (or the first block) per 1,000 questions"
    )
    recovery: list[int] = Field(
        description="per switch: questions until the rolling accuracy (last 20) is within 2 points of the block's second half"
    )


class CostPoint(BaseModel):
    """RL-Focal on the test stream under one budget: what it spent and how it did."""

    model_config = ConfigDict(extra="forbid")

    budget: float | None = Field(
        description="the mean share of the whole pool's cost per query it was held to; null: the cost weight alone"
    )
    cap: bool = Field(False, description="the budget was a cap: spending under it was left to the cost weight")
    cost_share: float = Field(ge=0, description="the share of the whole pool's cost it spent per test question (mean)")
    accuracy: float = Field(ge=0, le=1)
    mean_models_called: float = Field(ge=0)


class ReplayResults(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    protocol: Literal["paper", "stream"]
    seed: int
    n_test: int = Field(description="number of test questions (the online stream)")
    dataset: str
    models: list[str]
    methods: dict[str, MethodResult] = Field(
        description="keyed by method: rl_focal, best_single, soft_vote, stacking, ..."
    )
    config: dict = Field(description="the RL-Focal hyper-parameters used")
    elapsed_s: float
    numerics: Literal["portable", "native"] = Field(
        "native",
        description="portable: the same figures on any x86-64 CPU; native: this CPU's fastest kernels (rlens.evaluation.replay)",
    )
    drift: DriftResult | None = Field(None, description="RL-Focal's drift detections and recovery after task switches")
    cost_curve: list[CostPoint] | None = Field(
        None,
        description="with --budgets: RL-Focal as run, then under each budget (same seed and protocol), lowest first",
    )


def write_schema(path: Path = SCHEMA_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ReplayResults.model_json_schema(), indent=2) + "\n")
    return path


if __name__ == "__main__":
    print(write_schema())
