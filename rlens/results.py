"""The replay results file (``results.json``): a stable, versioned, documented shape (pydantic).

``schemas/replay_results.schema.json`` is generated from these models (``python -m rlens.results``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "replay_results.schema.json"


class MethodResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    accuracy: float = Field(ge=0, le=1, description="fraction of the test questions answered correctly")
    per_task: dict[str, float] = Field(description="accuracy per task, keyed by task name")
    mean_models_called: float = Field(ge=0, description="models called per test question, on average")
    description: str = ""


class ReplayResults(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    protocol: Literal["paper", "stream"]
    seed: int
    n_test: int = Field(description="number of test questions (the online stream)")
    dataset: str
    models: list[str]
    methods: dict[str, MethodResult] = Field(description="keyed by method: rl_focal, best_single, soft_vote, stacking, ...")
    config: dict = Field(description="the RL-Focal hyper-parameters used")
    elapsed_s: float


def write_schema(path: Path = SCHEMA_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ReplayResults.model_json_schema(), indent=2) + "\n")
    return path


if __name__ == "__main__":
    print(write_schema())
