"""Dataset validation and the CLI's one-line errors (exit code 2, the file named, no traceback)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from rlens.cli import app
from rlens.records.dataset import load_dataset
from rlens.records.recorded import DatasetError
from rlens.settings import settings

runner = CliRunner()


def replay_error(data: Path, tmp_path: Path) -> str:
    result = runner.invoke(app, ["replay", "--data", str(data), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:")
    return lines[0]


def test_load_round_trip(bbh_slice_dir):
    data = load_dataset(bbh_slice_dir)
    assert data.n_questions == 120 and data.n_models == 5
    assert data.task_name(0) == "boolean_expressions"
    assert np.allclose(data.probs.sum(2), 1, atol=1e-5)


@pytest.mark.parametrize(
    "breakage, file, words",
    [
        (lambda d: (d / "labels.npy").unlink(), "labels.npy", "missing"),
        (lambda d: (d / "probs.npy").write_bytes(b"not numpy"), "probs.npy", "not a readable"),
        (lambda d: np.save(d / "labels.npy", np.full(120, 7)), "labels.npy", "not one of its valid choices"),
        (lambda d: np.save(d / "task.npy", np.zeros(3, np.int64)), "task.npy", "integer array [120]"),
        (lambda d: np.save(d / "choice_mask.npy", np.ones((120, 3))), "choice_mask.npy", "must be bool"),
        (lambda d: (d / "models.json").write_text('[{"index": 0}]'), "models.json", "lists 1 models"),
        (lambda d: (d / "models.json").write_text("{oops"), "models.json", "not valid JSON"),
        (lambda d: np.save(d / "probs.npy", np.load(d / "probs.npy") * 2), "probs.npy", "sum to"),
        (lambda d: np.save(d / "probs.npy", np.full_like(np.load(d / "probs.npy"), np.nan)), "probs.npy", "NaN"),
    ],
)
def test_bad_dataset_files_give_one_line_errors(bbh_slice_dir, tmp_path, breakage, file, words):
    breakage(bbh_slice_dir)
    with pytest.raises(DatasetError) as info:
        load_dataset(bbh_slice_dir)
    assert info.value.file.endswith(file) and words in info.value.problem
    line = replay_error(bbh_slice_dir, tmp_path)
    assert file in line and words in line


def test_missing_directory_and_bad_options(tmp_path):
    missing = replay_error(tmp_path / "nowhere", tmp_path)
    assert (
        "no such dataset directory" in missing and "RLENS_SHARED_DATA" in missing and "rlens import lm-eval" in missing
    )
    (tmp_path / "a_file").write_text("")
    assert "not a directory" in replay_error(tmp_path / "a_file", tmp_path)
    result = runner.invoke(app, ["replay", "--data", str(tmp_path), "--protocol", "weekly"])
    assert result.exit_code == 2 and "weekly" in result.output


def test_costs_are_read_from_models_json(bbh_slice_dir):
    models = json.loads((bbh_slice_dir / "models.json").read_text())
    models[0]["cost"] = 4.0
    (bbh_slice_dir / "models.json").write_text(json.dumps(models))
    assert load_dataset(bbh_slice_dir).model_costs.tolist() == [4.0, 1.0, 1.0, 1.0, 1.0]
    models[1]["cost"] = -1
    (bbh_slice_dir / "models.json").write_text(json.dumps(models))
    with pytest.raises(DatasetError, match="costs must be positive"):
        load_dataset(bbh_slice_dir)


def test_a_dataset_with_another_pool_size_and_choice_counts_is_accepted(tmp_path):
    rng = np.random.default_rng(0)
    n, m, c = 40, 7, 4
    mask = np.zeros((n, c), bool)
    mask[:, :2] = True
    mask[20:, 2:] = True  # the stream mixes 2- and 4-choice questions
    probs = rng.dirichlet(np.ones(c), size=(n, m)) * mask[:, None, :]
    probs /= probs.sum(2, keepdims=True)
    directory = tmp_path / "seven"
    directory.mkdir()
    np.save(directory / "probs.npy", probs.astype(np.float32))
    np.save(directory / "choice_mask.npy", mask)
    np.save(directory / "labels.npy", np.where(np.arange(n) < 20, 1, 3).astype(np.int64))
    np.save(directory / "task.npy", (np.arange(n) >= 20).astype(np.int64))
    (directory / "models.json").write_text(json.dumps([{"index": i, "name": f"m{i}"} for i in range(m)]))
    data = load_dataset(directory)
    assert data.n_models == 7 and data.task_name(1) == "task_1"  # tasks.json is optional
    shutil.rmtree(directory)


def test_demo_is_the_main_job_on_the_bundled_stream(tmp_path):
    """`rlens demo` with no data argument: RL-Focal learns the bundled stream from a cold start and beats every
    single model and the soft vote while calling fewer than half of the models."""
    import json

    result = runner.invoke(app, ["demo", "--out", str(tmp_path), "--workers", "1"])
    assert result.exit_code == 0, result.output
    # the stream protocol's stages
    assert "RL-Focal online from a cold start" in result.output and "warm start" not in result.output
    outputs = {"results.json", "report.md", "report.png", "per_query.csv", "policy.safetensors"}
    assert {p.name for p in tmp_path.iterdir()} == outputs
    methods = json.loads((tmp_path / "results.json").read_text())["methods"]
    rl = methods["rl_focal"]
    assert rl["accuracy"] > methods["best_single"]["accuracy"] + 0.2
    assert rl["accuracy"] > methods["soft_vote"]["accuracy"] + 0.1
    assert rl["mean_models_called"] < 2.5
    assert "each task had its own window" in result.output  # why nothing drifted
    # the accuracy against cost: as run (the default, a cap of half the pool's cost), then with the cost weight alone
    # and under the demo's tighter caps, each held under its budget (within what its bucket lets a short stream save)
    curve = json.loads((tmp_path / "results.json").read_text())["cost_curve"]
    assert [(p["budget"], p["cap"]) for p in curve] == [(0.5, True), (None, False), (0.2, True), (0.3, True)]
    assert curve[0]["accuracy"] == rl["accuracy"] and curve[0]["cost_share"] == rl["cost_share"]
    assert all(p["cost_share"] < p["budget"] + 0.05 for p in curve if p["budget"] is not None), curve
    assert "Accuracy against cost" in (tmp_path / "report.md").read_text() and "cost share spent" in result.output


def test_bad_budgets_are_one_line_errors(tmp_path):
    for value, words in (("0.2,abc", "'abc' is not a number"), ("0.5,1.5", "1.5 is outside 0.001-1")):
        result = runner.invoke(app, ["demo", "--out", str(tmp_path), "--budgets", value])
        assert result.exit_code == 2 and words in result.output, result.output
        assert "Traceback" not in result.output and not (tmp_path / "results.json").exists()
    data = str(settings().service.demo_data)
    for value, words in (("abc", "'abc' is not a number"), ("0.3,0.4", "is not one share"), ("2", "2 is outside")):
        result = runner.invoke(app, ["replay", "--data", data, "--out", str(tmp_path), "--budget", value])
        assert result.exit_code == 2 and words in result.output, result.output
        assert "Traceback" not in result.output and not (tmp_path / "results.json").exists()


def test_demo_as_one_stream_detects_the_task_switches(tmp_path):
    """`rlens demo --one-stream`: the task unknown (one window), the learner's detector finds most task switches."""
    import json

    result = runner.invoke(app, ["demo", "--one-stream", "--out", str(tmp_path), "--workers", "1", "--budgets", ""])
    assert result.exit_code == 0, result.output
    drift = json.loads((tmp_path / "results.json").read_text())["drift"]
    assert drift["switches"] == 9 and drift["switches"] - drift["missed_switches"] >= 6
    assert "each task had its own window" not in result.output


def test_service_commands_say_in_one_line_what_is_missing(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("RLENS_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # nothing listens there
    result = CliRunner().invoke(app, ["load", "--limit", "5"])
    assert (
        result.exit_code == 2
        and "no Kafka broker answers at 127.0.0.1:1: start the service with `rlens up`" in result.output
    )
    assert "Traceback" not in result.output
    monkeypatch.delenv("RLENS_KAFKA_BOOTSTRAP")
    with socket.socket() as taken:  # a port something else listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(
            app, ["up", "--broker-port", str(port), "--workdir", str(tmp_path / "up"), "--no-gateway"]
        )
        gateway = CliRunner().invoke(app, ["up", "--gateway-port", str(port), "--workdir", str(tmp_path / "up")])
    assert (
        result.exit_code == 2
        and f"port {port} is taken (another `rlens up`, or another program): pass --broker-port" in result.output
    )
    assert (
        gateway.exit_code == 2
        and f"port {port} is taken (another `rlens up`, or another program): pass --gateway-port, or --no-gateway"
        in gateway.output
    )


def test_progress_without_a_terminal_prints_a_line_per_tenth():
    from io import StringIO

    from rich.console import Console

    from rlens.progress import LineProgress, progress_bar

    out = StringIO()
    console = Console(file=out, width=200)
    assert isinstance(progress_bar(console), LineProgress)  # a StringIO is not a terminal
    with progress_bar(console) as bar:
        task = bar.add_task("replay", total=40)
        for _ in range(40):
            bar.advance(task, 1)
    lines = out.getvalue().splitlines()
    assert (
        len(lines) == 10
        and lines[0].startswith("replay: 4/40 (10 %), ")
        and lines[-1].startswith("replay: 40/40 (100 %), ")
    )
    assert "s left" in lines[0] and "s left" not in lines[-1]


def test_the_time_left_comes_from_the_pace_after_the_start():
    """10 s of starting processes, then 10 % in 10 s: 90 s left (counting the start, it said 180)."""
    from rlens.progress import LineProgress, _Task

    task = _Task("replay", total=100, done=10, started=0.0, first=(10.0, 0.0))
    assert LineProgress.line(task, now=20.0) == "replay: 10/100 (10 %), 20 s, about 90 s left"


def test_piped_output_is_wide_enough_for_the_widest_table():
    """Piped or logged, rich would print 80 columns and cut `rlens load`'s 9-column header; the CLI prints 160."""
    import subprocess
    import sys

    code = (
        "from rich.table import Table\nfrom rlens.cli.common import console\nt = Table()\n"
        "[t.add_column(c) for c in ('sent', 'answered', 'accuracy %', 'last 200 %', 'calls / query', 'p50 ms', 'p99 ms', 'duplicates', 'policy')]\n"
        "console.print(t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "accuracy %" in out and "duplicates" in out and "…" not in out


def test_a_replays_policy_starts_another_replay_and_the_learner_but_not_another_pool(bbh_slice_dir, tmp_path, zoo_dir):
    """`rlens replay` writes its final policy; `--pretrained` starts a replay from it (no warm start), the learner's
    warm start takes it too; another pool's policy is one line."""
    import torch

    from rlens.focal.engine import FocalEngine
    from rlens.service.learner.online import FocalOnlineTrainer

    first = runner.invoke(
        app, ["replay", "--data", str(bbh_slice_dir), "--variants", "rl_focal", "--out", str(tmp_path / "a")]
    )
    assert first.exit_code == 0, first.output
    policy = tmp_path / "a" / "policy.safetensors"
    assert policy.is_file() and not list((tmp_path / "a").glob(".*partial"))
    second = runner.invoke(
        app,
        ["replay", "--data", str(bbh_slice_dir), "--variants", "rl_focal", "--protocol", "stream"]
        + ["--pretrained", str(tmp_path / "a"), "--out", str(tmp_path / "b")],
    )
    assert second.exit_code == 0 and "online from the policy" in second.output, second.output
    data = load_dataset(bbh_slice_dir)
    trainer = FocalOnlineTrainer(FocalEngine(data.n_models, data.model_costs, seed=7), data.model_names)
    trainer.warm_start(policy)
    from safetensors.torch import load_file

    saved = load_file(str(policy))
    assert all(torch.equal(trainer.policy_tensors()[k], v) for k, v in saved.items())
    other = runner.invoke(
        app, ["replay", "--data", str(zoo_dir), "--pretrained", str(policy), "--out", str(tmp_path / "c")]
    )
    assert other.exit_code == 2 and "a policy for models" in other.output and "this pool is" in other.output


@pytest.fixture()
def zoo_dir(tmp_path, zoo):
    from rlens.records.dataset import save_dataset

    return save_dataset(zoo, tmp_path / "zoo")


def test_load_names_a_missing_stack_folder_in_one_line(tmp_path):
    """Issue 54: `rlens load --stack <folder>` where no stack runs says so, and how to start one."""
    for folder, what in ((tmp_path / "nowhere", "no such folder"), (tmp_path, "no client.env there")):
        result = runner.invoke(app, ["load", "--stack", str(folder)])
        lines = [line for line in result.output.strip().splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and what in lines[0] and "rlens up --workdir" in lines[0]
