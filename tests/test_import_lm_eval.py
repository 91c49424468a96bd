"""`rlens import lm-eval` on per-sample files written in lm-evaluation-harness --log_samples format."""

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from rlens.cli import app
from rlens.records.dataset import load_dataset
from rlens.records.recorded import DatasetError
from rlens.evaluation.importers.lm_eval import import_lm_eval, task_name

runner = CliRunner()
CHOICES = {"bool": ["False", "True"], "abc": ["(A)", "(B)", "(C)"]}


def sample_v04(doc_id: int, task: str, lls: list[float], target) -> dict:
    """lm-eval >= 0.4 record: string log-likelihoods, dict arguments, unfiltered resps nested one level deeper."""
    args = {f"gen_args_{i}": {"arg_0": f"Q{doc_id}: ...", "arg_1": f" {c}"} for i, c in enumerate(CHOICES[task])}
    return {
        "doc_id": doc_id,
        "doc": {"input": f"question {doc_id}"},
        "target": target,
        "arguments": args,
        "resps": [[[str(ll), "False"]] for ll in lls],
        "filtered_resps": [[str(ll), "False"] for ll in lls],
        "acc_norm": 0.0,
    }


def sample_old(doc_id: int, task: str, lls: list[float], target) -> dict:
    """Older record: list arguments, numeric log-likelihoods, resps only."""
    return {
        "doc_id": doc_id,
        "target": target,
        "arguments": [[f"Q{doc_id}", f" {c}"] for c in CHOICES[task]],
        "resps": [[ll, False] for ll in lls],
    }


def write(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture()
def two_models(tmp_path: Path) -> dict[str, Path]:
    a, b = tmp_path / "model_a", tmp_path / "model_b"
    # model a: lm-eval 0.4 format, targets as choice text; doc 2 of "bool" is missing for model b
    write(
        a / "samples_bool_2024-06-26T17-14-54.123456.jsonl",
        [
            sample_v04(0, "bool", [-0.1, -2.0], "False"),
            sample_v04(1, "bool", [-3.0, -0.2], "True"),
            sample_v04(2, "bool", [-1.0, -1.0], "True"),
        ],
    )
    write(
        a / "samples_abc_2024-06-26T17-14-54.123456.jsonl",
        [sample_v04(0, "abc", [-1.0, -0.5, -4.0], "(B)"), sample_v04(1, "abc", [-2.0, -2.0, -0.1], "(C)")],
    )
    # model b: older format, targets as indices, docs in another order
    write(
        b / "samples_abc_2024-07-01T09-00-00.000001.jsonl",
        [sample_old(1, "abc", [-0.3, -2.0, -2.0], 2), sample_old(0, "abc", [-0.7, -0.7, -0.7], 1)],
    )
    write(
        b / "samples_bool_2024-07-01T09-00-00.000001.jsonl",
        [sample_old(1, "bool", [-0.5, -0.5], 1), sample_old(0, "bool", [-5.0, -0.01], 0)],
    )
    return {"a": a, "b": b}


def test_task_names_from_file_names():
    assert (
        task_name(Path("samples_leaderboard_bbh_hyperbaton_2024-06-26T17-14-54.123456.jsonl"))
        == "leaderboard_bbh_hyperbaton"
    )
    assert task_name(Path("samples_arc.jsonl")) == "arc"


def test_join_softmax_and_labels(two_models, tmp_path):
    summary = import_lm_eval(two_models, tmp_path / "ds", costs={"b": 3.0})
    assert summary.n_questions == 4 and summary.dropped == 1 and summary.tasks == ["abc", "bool"]
    data = load_dataset(tmp_path / "ds")
    assert data.model_names == ["a", "b"] and data.model_costs.tolist() == [1.0, 3.0]
    assert data.task.tolist() == [0, 0, 1, 1] and data.labels.tolist() == [1, 2, 0, 1]
    assert data.choice_mask.sum(1).tolist() == [3, 3, 2, 2]
    expected = np.exp([-1.0, -0.5, -4.0]) / np.exp([-1.0, -0.5, -4.0]).sum()  # model a, abc doc 0
    assert data.probs[0, 0, :3] == pytest.approx(expected, rel=1e-5)
    assert data.probs[0, 1, :3] == pytest.approx([1 / 3] * 3, rel=1e-5)  # model b, abc doc 0
    assert data.probs[2, 1, :2] == pytest.approx(np.exp([-5.0, -0.01]) / np.exp([-5.0, -0.01]).sum(), rel=1e-5)
    tasks = json.loads((tmp_path / "ds" / "tasks.json").read_text())
    assert tasks[1] == {"id": 1, "name": "bool", "choices": ["False", "True"]}


def test_cli_import_then_replay(two_models, tmp_path):
    out = tmp_path / "ds"
    result = runner.invoke(
        app,
        ["import", "lm-eval", "--model", f"a={two_models['a']}", "--model", f"b={two_models['b']}", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "4 questions x 2 models" in result.output and "dropped 1" in result.output
    result = runner.invoke(
        app,
        [
            "replay",
            "--data",
            str(out),
            "--protocol",
            "stream",
            "--out",
            str(tmp_path / "r"),
            "--variants",
            "rl_focal",
            "--workers",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r" / "results.json").read_text())["n_test"] == 4


@pytest.mark.parametrize(
    "record, words",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"target": 0, "resps": [[-1.0], [-2.0]]}), "no 'doc_id'"),
        (json.dumps({"doc_id": 0, "resps": [[-1.0], [-2.0]]}), "no 'target'"),
        (json.dumps({"doc_id": 0, "target": 5, "resps": [[-1.0], [-2.0]]}), "outside the 2 choices"),
        (json.dumps({"doc_id": 0, "target": "maybe", "resps": [[-1.0], [-2.0]]}), "neither a choice index"),
        (json.dumps({"doc_id": 0, "target": 0, "resps": [["abc", "False"], [-2.0]]}), "not a log-likelihood"),
        (json.dumps({"doc_id": 0, "target": 0, "resps": ["only one"]}), "multiple-choice tasks only"),
    ],
)
def test_bad_sample_files_give_clear_errors(tmp_path, record, words):
    bad = write(tmp_path / "m" / "samples_t_2024-01-01T00-00-00.0.jsonl", [])
    bad.write_text(record + "\n")
    with pytest.raises(DatasetError, match=words):
        import_lm_eval({"m": tmp_path / "m"}, tmp_path / "out")
    result = runner.invoke(app, ["import", "lm-eval", "--model", f"m={tmp_path / 'm'}", "--out", str(tmp_path / "out")])
    assert (
        result.exit_code == 2
        and "samples_t_" in result.output
        and words in result.output
        and "Traceback" not in result.output
    )


def test_cli_argument_errors(two_models, tmp_path):
    result = runner.invoke(app, ["import", "lm-eval", "--model", "a", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "NAME=VALUE" in result.output
    result = runner.invoke(
        app, ["import", "lm-eval", "--model", f"a={two_models['a']}", "--cost", "z=2", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and "no --model of that name" in result.output
    result = runner.invoke(
        app, ["import", "lm-eval", "--model", f"a={tmp_path / 'nothing'}", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and "no such file or directory" in result.output
