"""Replay end to end on a slice of the real bbh_dev data: results.json's shape, reports, determinism."""

import json
import os
from dataclasses import replace

import numpy as np
from typer.testing import CliRunner

from rlens.cli import app
from rlens.records.dataset import load_dataset, save_dataset
from rlens.focal.config import FocalConfig
from rlens.evaluation.protocols import Protocol, split, task_half
from rlens.evaluation.replay import DEFAULT_VARIANTS, PORTABLE_NUMERICS, replay
from rlens.evaluation.results import SCHEMA_PATH, ReplayResults
from rlens.evaluation.synthetic import synthetic_dataset

FAST = replace(FocalConfig(), decider_warm_passes=1, fusion_warm_passes=1, joint_warm_passes=1, warm_rollouts=2)


def test_paper_protocol_split(bbh):
    warm, test = split(bbh, Protocol.paper)
    assert len(test) == 600 and len(warm) == 2400 and not set(warm) & set(test)
    for task_id in range(12):  # per task: first 80% warm, last 20% test
        rows = np.flatnonzero(bbh.task == task_id)
        assert set(rows[:200]) <= set(warm) and set(rows[200:]) <= set(test)
    warm, test = split(bbh, Protocol.stream)
    assert len(warm) == 0 and len(test) == 3000


def test_cli_replay_writes_every_output(bbh_slice_dir, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["replay", "--data", str(bbh_slice_dir), "--out", str(out), "--seed", "3", "--workers", "2"]
    )
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    ReplayResults.model_validate(results)
    assert results["protocol"] == "paper" and results["seed"] == 3 and results["n_test"] == 24
    expected = {
        "rl_focal",
        "best_single",
        "best_single_per_task",
        "plurality",
        "soft_vote",
        "hedge",
        "stacking",
        "oracle",
        *DEFAULT_VARIANTS,
    }
    assert expected <= set(results["methods"])
    focal = results["methods"]["rl_focal"]
    assert set(focal["per_task"]) == {"boolean_expressions", "date_understanding", "formal_fallacies"}
    assert 0 <= focal["accuracy"] <= 1 and 1 <= focal["mean_models_called"] <= 5
    singles = [m["accuracy"] for name, m in results["methods"].items() if name.startswith("single:")]
    assert len(singles) == 5 and results["methods"]["oracle"]["accuracy"] >= max(singles)  # any-model-correct
    assert (out / "report.png").stat().st_size > 10_000
    assert "| rl_focal |" in (out / "report.md").read_text()
    assert len((out / "per_query.csv").read_text().splitlines()) == 25
    assert "rl_focal" in result.output


def test_stream_protocol_and_determinism(bbh_slice_dir):
    """Portable numerics: the same seed gives the same answers whatever the worker processes; the environment
    that selects the portable kernels is set for the variant processes only."""
    data = load_dataset(bbh_slice_dir)
    a = replay(data, Protocol.stream, seed=5, config=FAST, variants=["rl_focal"], workers=1)
    b = replay(data, Protocol.stream, seed=5, config=FAST, variants=["rl_focal_kappa", "rl_focal"], workers=2)
    assert a.results.n_test == 120 and "stacking" not in a.results.methods and a.results.numerics == "portable"
    assert np.array_equal(a.answers["rl_focal"], b.answers["rl_focal"])
    assert a.results.methods["rl_focal"] == b.results.methods["rl_focal"]
    assert not set(PORTABLE_NUMERICS) & set(os.environ)
    native = replay(data, Protocol.stream, seed=5, config=FAST, variants=["rl_focal"], numerics="native")
    assert native.results.numerics == "native" and native.results.n_test == 120


def test_cli_replay_rejects_unknown_variants(bbh_slice_dir, tmp_path):
    result = CliRunner().invoke(
        app, ["replay", "--data", str(bbh_slice_dir), "--out", str(tmp_path), "--variants", "rl_focal,rl_fokal"]
    )
    assert result.exit_code == 2 and "unknown ['rl_fokal']" in result.output and "rl_focal_kappa" in result.output


def test_results_schema_file_is_current():
    assert json.loads(SCHEMA_PATH.read_text()) == ReplayResults.model_json_schema()


def test_replay_reports_drift_detections_and_recovery_on_one_stream_key(zoo, tmp_path):
    from rlens.evaluation.replay import DriftOptions
    from rlens.evaluation.report import write_outputs

    data = zoo.subset(list(range(360)))  # ordering, antonyms, pattern: two switches
    per_task = replay(data, Protocol.stream, variants=["rl_focal"]).results.drift
    one = replay(data, Protocol.stream, variants=["rl_focal"], drift=DriftOptions(one_stream=True))
    drift = one.results.drift
    assert not per_task.one_stream and drift.one_stream and drift.switches == per_task.switches == 2
    assert drift.detections and len(drift.signals) == len(drift.detections) and len(drift.recovery) == 2
    assert drift.switches - drift.missed_switches >= 1 and all(d >= 0 for d in drift.delays)
    assert all(20 <= r <= 120 for r in drift.recovery)  # at least the rolling window, at most the block
    write_outputs(one, tmp_path)
    assert (
        "## Drift" in (tmp_path / "report.md").read_text()
        and json.loads((tmp_path / "results.json").read_text())["drift"]["one_stream"]
    )
    bad = CliRunner().invoke(app, ["replay", "--data", "x", "--drift-reaction", "forget"])
    assert bad.exit_code == 2 and "--drift-reaction must be none, trim or reset" in bad.output


def test_task_halves_split_the_tasks_and_keep_stream_order(bbh):
    tune, holdout = task_half(bbh, "tune"), task_half(bbh, "holdout")
    tune_tasks, holdout_tasks = set(tune.task.tolist()), set(holdout.task.tolist())
    assert tune_tasks == {0, 2, 4, 6, 8, 10} and holdout_tasks == {1, 3, 5, 7, 9, 11}
    assert tune.n_questions + holdout.n_questions == bbh.n_questions
    assert np.array_equal(tune.labels, bbh.labels[np.isin(bbh.task, list(tune_tasks))])


def test_synthetic_datasets_are_seeded_valid_and_any_shape(tmp_path):
    a, b = synthetic_dataset(300, 7, n_tasks=3, seed=4), synthetic_dataset(300, 7, n_tasks=3, seed=4)
    assert a.probs.shape == (300, 7, 4) and np.array_equal(a.probs, b.probs) and np.array_equal(a.labels, b.labels)
    assert not np.array_equal(a.probs, synthetic_dataset(300, 7, n_tasks=3, seed=5).probs)
    np.testing.assert_allclose(a.probs.sum(-1), 1.0, atol=1e-5)
    assert a.task.tolist() == [0] * 100 + [1] * 100 + [2] * 100
    accuracy = (a.probs.argmax(-1) == a.labels[:, None]).mean()
    assert 0.3 < accuracy < 0.9  # models better than chance (0.25), not perfect
    save_dataset(a, tmp_path / "synthetic")
    # passes the format's validation
    np.testing.assert_allclose(load_dataset(tmp_path / "synthetic").probs, a.probs, atol=1e-6)


def test_the_task_switch_validation_sets_change_the_best_model_from_task_to_task():
    """bench.common.datasets' ``synthetic-switches-G``: 12 tasks of 250 questions, 5 models; what they are for is a
    model order that changes with the task (a new stream's first pools matter): at least 3 models are each the best
    on some task."""
    from bench.common.datasets import SYNTHETIC, dataset

    for g in (1, 2, 3):
        data = dataset(f"synthetic-switches-{g}")
        assert data.probs.shape == (3000, 5, 4) and np.bincount(data.task).tolist() == [250] * 12
        right = data.probs.argmax(-1) == data.labels[:, None]
        best = [int(right[data.task == t].mean(0).argmax()) for t in range(12)]
        assert len(set(best)) >= 3, best
    assert {"synthetic-plain", "synthetic-families"} <= set(SYNTHETIC)


def test_task_labels_on_the_plot_are_short_and_still_tell_the_tasks_apart():
    from rlens.evaluation.report import short_labels

    names = ["hyperbaton", "tracking_shuffled_objects_five_objects", "tracking_shuffled_objects_three_objects"]
    assert short_labels(names) == ["hyperbaton", "trackin…five_objects", "tracki…three_objects"]
    assert short_labels(["a" * 30 + "b", "a" * 30 + "c"], width=10) == ["aaaaaaaa…b", "aaaaaaaa…c"]


def test_the_cost_panel_gives_points_that_nearly_coincide_one_label():
    from rlens.evaluation.report import shared_labels

    points = [("a", 1.5, 86.0), ("b", 1.6, 85.5), ("c", 1.5, 80.0), ("d", 5.0, 85.9), ("e", 1.75, 86.0)]
    # b is within 0.3 and 1.0 of a; c is 6 points below; d is 3.5 models right; e is 0.25 right of a but joins
    # a's label, whose point stays where a is
    assert shared_labels(points, near=1.0) == [(1.5, 86.0, ["a", "b", "e"]), (1.5, 80.0, ["c"]), (5.0, 85.9, ["d"])]
    assert shared_labels(points, near=0.4) == [
        (1.5, 86.0, ["a", "e"]),
        (1.6, 85.5, ["b"]),
        (1.5, 80.0, ["c"]),
        (5.0, 85.9, ["d"]),
    ]


def test_the_baselines_cost_shares_by_hand():
    """Model a costs 1, b costs 3 (shares 0.25 and 0.75). Task 0 has three questions that a gets right and b wrong,
    task 1 one that b gets right and a wrong: the best single model is a (3 of 4), the best per task a, then b."""
    import numpy as np

    from rlens.evaluation.baselines import best_single, best_single_per_task, single_models, soft_voting
    from rlens.records.recorded import RecordedDataset

    probs = np.array([[[0.9, 0.1], [0.2, 0.8]]] * 4, dtype=np.float32)  # a says choice 0, b says 1, every time
    data = RecordedDataset(
        "hand",
        probs,
        np.ones((4, 2), bool),
        np.array([0, 0, 0, 1]),
        np.array([0, 0, 0, 1]),
        ["a", "b"],
        np.array([1.0, 3.0]),
        {0: "t0", 1: "t1"},
    )
    assert [run.cost_share for run in single_models(data).values()] == [0.25, 0.75]
    assert best_single(data, data).cost_share == 0.25
    assert best_single_per_task(data, data).cost_share == (3 * 0.25 + 0.75) / 4  # a on 3 questions, b on 1
    assert soft_voting(data).cost_share == 1.0


def test_the_online_stacker_by_hand():
    """Two models, two choices, one task: it starts as the product of the models' distributions, and one wrong
    answer moves its weights by one SGD step on the cross-entropy."""
    import numpy as np

    from rlens.evaluation.baselines import online_stacking
    from rlens.records.recorded import RecordedDataset

    probs = np.array([[[0.9, 0.1], [0.2, 0.8]], [[0.9, 0.1], [0.2, 0.8]]], dtype=np.float32)
    data = RecordedDataset(
        "hand", probs, np.ones((2, 2), bool), np.array([1, 1]), np.array([0, 0]), ["a", "b"], np.ones(2), {0: "t"}
    )
    run = online_stacking(data, lr=1.0)
    # first: scores 0.5 (log .9 + log .2) = -0.857 for choice 0, 0.5 (log .1 + log .8) = -1.263 for choice 1
    assert run.answers[0] == 0
    # p = softmax(-0.857, -1.263) = (0.600, 0.400); label 1: gradient (0.600, -0.600) on the scores;
    # w -= log_p @ g: w_a = 0.5 - (0.600 log .9 - 0.600 log .1) = -0.818, w_b = 0.5 - 0.6 (log .2 - log .8) = 1.332;
    # b = (-0.600, 0.600); second scores: -0.818 log .9 + 1.332 log .2 - 0.6 = -2.657 and
    # -0.818 log .1 + 1.332 log .8 + 0.6 = 2.187: choice 1
    assert run.answers[1] == 1
