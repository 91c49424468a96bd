"""Pool configurations: validation errors name the field; `rlens pool check` probes every model for real
(in-process zoo models, a replay model, a dead server) and exits 1 when one fails."""

import json

import re

import pytest
from typer.testing import CliRunner

from rlens.cli import app
from rlens.models.pool import PoolConfigError, load_pool_config


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "not valid JSON"),
        ('{"models": []}', "models: List should have at least 1 item"),
        ('{"models": [{"name": "a", "backend": "nope"}]}', "unknown backend 'nope'"),
        (
            '{"models": [{"name": "a", "backend": "replay", "options": {"dataset": "d", "model": 0}}, {"name": "a", "backend": "replay", "options": {"dataset": "d", "model": 1}}]}',
            "unique",
        ),
        (
            '{"models": [{"name": "a", "backend": "openai", "options": {"base_ur": "http://x/v1", "model": "m"}}]}',
            "model 'a': unknown option(s) base_ur for backend openai; its options: api_key, backoff_s, base_url, max_concurrency, model, retries, timeout_s",
        ),
        (
            '{"models": [{"name": "a", "backend": "openai", "options": {"base_url": "http://x/v1"}}]}',
            "model 'a': backend openai needs option(s) model",
        ),
        (
            '{"models": [{"name": "z", "backend": "transformers", "options": {"path": "p", "devise": "cpu"}}]}',
            "its options: device, gguf_file, path",
        ),
        ('{"models": [{"name": "a", "backend": "openai", "cost": 0}]}', "models.0.cost"),
        (  # issue 56: every bad value at once, typed and bounded as the backend's constructor declares
            '{"models": [{"name": "a", "backend": "openai", "options": {"base_url": "ftp://x", "model": "m", '
            '"timeout_s": -3, "retries": -2}}, {"name": "b", "backend": "openai", "options": {"base_url": '
            '"http://y/v1", "model": "m", "timeout_s": "soon"}}]}',
            "models.0: model 'a': option base_url: String should match pattern '^https?://\\S+$'; option timeout_s: "
            "Input should be greater than 0; option retries: Input should be greater than or equal to 0; models.1: "
            "model 'b': option timeout_s: Input should be a valid number",
        ),
        (
            '{"models": [{"name": "r", "backend": "replay", "options": {"dataset": "d", "model": [1]}}]}',
            "model 'r': option model.int: Input should be a valid integer; option model.str: Input should be a valid string",
        ),
    ],
)
def test_bad_pool_files_are_named_errors(tmp_path, content, message):
    path = tmp_path / "pool.json"
    path.write_text(content)
    with pytest.raises(PoolConfigError, match=re.escape(message)):
        load_pool_config(path)


def test_shipped_pool_files_are_valid():
    from pathlib import Path

    for path in Path(__file__).parents[1].glob("infra/pool.*.json"):
        assert load_pool_config(path).models


def test_pool_check_probes_every_model(tmp_path, quick_zoo, bbh_slice_dir):
    pool = {
        "models": [
            {"name": "arith", "backend": "transformers", "options": {"path": str(quick_zoo / "arith-char")}},
            {"name": "recorded", "backend": "replay", "options": {"dataset": str(bbh_slice_dir), "model": 1}},
            {
                "name": "dead",
                "backend": "openai",
                "options": {"base_url": "http://127.0.0.1:9/v1", "model": "x", "retries": 0, "timeout_s": 1},
            },
        ]
    }
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(pool))
    result = CliRunner().invoke(app, ["pool", "check", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 1, result.output
    lines = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") > 3}
    assert "ok: P(' 4')" in lines["arith"] and "ok" in lines["recorded"]
    assert "failed" in lines["dead"] and "ConnectError" in lines["dead"]


def test_up_refuses_a_pool_with_a_typo_before_starting_anything(tmp_path):
    pool = tmp_path / "pool.json"
    pool.write_text(
        '{"models": [{"name": "a", "backend": "openai", "options": {"base_url": "http://x/v1", "modle": "m"}}]}'
    )
    result = CliRunner().invoke(
        app, ["up", "--pool", str(pool), "--workdir", str(tmp_path / "up"), "--no-gateway", "--broker-port", "1"]
    )
    assert result.exit_code == 2 and "unknown option(s) modle for backend openai; its options: api_key" in result.output
    assert not (tmp_path / "up").exists()  # nothing was started or written


def test_pool_check_passes_the_pool_rlens_up_serves(tmp_path):
    """`rlens up` serves the bundled stream's models as replay backends; each is probed with a question it has
    recorded (its first one has 4 choices, so a fixed two-choice probe failed every model)."""
    from rlens.local.stack import write_replay_pool
    from rlens.settings import settings

    path = write_replay_pool(settings().service.demo_data, tmp_path / "pool.json")
    result = CliRunner().invoke(app, ["pool", "check", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.count("│") > 3 and "replay" in line]
    assert len(rows) == 5 and all("ok: P('choice 0')" in row for row in rows), result.output
