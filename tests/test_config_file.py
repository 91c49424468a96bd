"""The configuration file (rlens.toml): every setting in one group, nested keys read onto the settings, variables
over the file, wrong keys named with the valid ones, `rlens config show` (redacted) read back as the same settings,
and a newcomer's stack: a three-model `openai` pool, the budget and the gateway's keys in one file, `rlens up
--config`, an answer through the gateway from those three models."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from brokers import EXTERNAL
from rlens.cli import app
from rlens.config_file import ConfigError, read_config
from rlens.focal.config import FocalConfig
from rlens.settings import GATED_PROBE_RATE, Settings, variables

GROUPS = Settings.group_keys()


@pytest.fixture(autouse=True)
def no_config_left_behind(monkeypatch):
    """`--config` sets RLENS_CONFIG in this process (as a CLI run does): put it back after each test."""
    monkeypatch.setenv("RLENS_CONFIG", "")


def test_each_setting_is_one_field_of_its_group_and_the_algorithm_configs_take_theirs():
    """Issue 55: a setting is declared once, in its group; its variables and its key in the file follow from it,
    and RL-Focal's and RLAE's configs are built from their groups' fields."""
    table = variables()
    for group, keys in GROUPS.items():
        for key in keys:  # each setting answers to RLENS_<GROUP>_<KEY>
            assert table[f"RLENS_{group}_{key}".upper()] == (group, key)
    assert table["RLENS_KAFKA_BOOTSTRAP"] == ("kafka", "bootstrap") and table["RLENS_WORKER_BATCH"] == (
        "worker",
        "batch",
    )
    # the names of earlier releases still set the same settings
    assert table["RLENS_TOPIC_PREFIX"] == ("kafka", "topic_prefix") and table["RLENS_PROMOTION"] == (
        "learner",
        "promotion",
    )
    assert table["RLENS_POOL_FILE"] == ("pool", "file") and table["RLENS_STRATEGY"] == ("service", "strategy")
    assert len(table) == sum(map(len, GROUPS.values())) + sum(
        len(m.SHORT) for m in map(type, (model for _, model in Settings()))
    )
    custom = Settings.model_validate(
        {"focal": {"alpha": 0.5, "joint_rows": 10, "stream_budgets": {"b": 0.3, "a": 0.2}}}
    )
    config = custom.focal_config()
    assert (config.alpha, config.joint_rows, config.stream_budgets) == (0.5, 10, (("a", 0.2), ("b", 0.3)))
    assert config.window == custom.focal.window and config.explore_rate == custom.focal.explore_rate
    assert custom.updated(rlae_span=3, focal_window=9).rlae.span == 3
    assert custom.updated({"focal": {"window": 9}}).focal_config().window == 9
    with pytest.raises(ValueError, match="no setting is named so"):
        custom.updated(focal_windw=9)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rlens.toml"
    path.write_text(text)
    return path


def test_nested_keys_become_settings_and_variables_override_them(tmp_path, monkeypatch):
    path = write(
        tmp_path,
        '[kafka]\nbootstrap = "k:9093"\n[focal]\nalpha = 0.5\nwindow = 64\n[learner]\ngate_delta = 0.05\n'
        '[[pool.models]]\nname = "a"\nbackend = "openai"\n',
    )
    values = read_config(path, GROUPS)
    assert values["kafka"]["bootstrap"] == "k:9093" and values["focal"]["alpha"] == 0.5
    assert values["learner"]["gate_delta"] == 0.05
    assert values["pool"] == {"models": [{"name": "a", "backend": "openai"}]}
    monkeypatch.setenv("RLENS_CONFIG", str(path))
    monkeypatch.setenv("RLENS_FOCAL_ALPHA", "0.1")
    s = Settings()
    assert (s.kafka.bootstrap, s.focal.alpha, s.focal.window) == ("k:9093", 0.1, 64)
    with_streams = write(tmp_path, '[focal]\nbudget = 0.5\nstream_budgets = { support = 0.3, "legal-eu" = 0.8 }\n')
    monkeypatch.setenv("RLENS_CONFIG", str(with_streams))
    assert Settings().focal.stream_budgets == {"support": 0.3, "legal-eu": 0.8}
    monkeypatch.setenv("RLENS_FOCAL_STREAM_BUDGETS", '{"support": 0.2}')  # the variable's streams over the file's
    assert Settings().focal.stream_budgets == {"support": 0.2, "legal-eu": 0.8}
    monkeypatch.setenv("RLENS_FOCAL_STREAM_BUDGETS", '{"support": 1.5}')
    with pytest.raises(ValueError, match="less than or equal to 1"):
        Settings()
    monkeypatch.delenv("RLENS_FOCAL_STREAM_BUDGETS")
    no_budget = write(tmp_path, '[focal]\nbudget = "none"\nbudget_cap = false\n')  # TOML has no null
    monkeypatch.setenv("RLENS_CONFIG", str(no_budget))
    assert (Settings().focal.budget, Settings().focal_config().budget_cap) == (None, False)
    monkeypatch.setenv("RLENS_FOCAL_BUDGET", "0.4")
    assert Settings().focal_config().budget == 0.4
    monkeypatch.setenv("RLENS_FOCAL_BUDGET", "None")
    assert Settings().focal_config().budget is None


def test_wrong_keys_are_named_with_the_valid_ones(tmp_path):
    path = write(tmp_path, '[kafka]\nbootstrp = "x"\n[focall]\nalpha = 1\n')
    with pytest.raises(ConfigError) as caught:
        read_config(path, GROUPS)
    message = str(caught.value)
    assert "[kafka] bootstrp: unknown (did you mean 'bootstrap'?)" in message and "[kafka] takes acks," in message
    assert "unknown group [focall] (did you mean 'focal'?)" in message
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2 and "did you mean 'bootstrap'" in result.output
    bad_value = write(tmp_path, "[focal]\nalpha = -1\n")
    result = CliRunner().invoke(app, ["config", "check", str(bad_value)])
    assert result.exit_code == 2 and "[focal] alpha: Input should be greater than or equal to 0" in result.output
    bad_pool = write(tmp_path, '[[pool.models]]\nname = "a"\nbackend = "nope"\n')
    result = CliRunner().invoke(app, ["config", "check", str(bad_pool)])
    assert result.exit_code == 2 and "unknown backend 'nope'" in result.output and str(bad_pool) in result.output


def test_config_check_names_every_bad_address_at_once(tmp_path):
    """Issue 56: a bootstrap server without a port and a URL that is no Redis URL, both in one error."""
    path = tmp_path / "rlens.toml"
    path.write_text('[kafka]\nbootstrap = "kafka-0:9092,localhost"\n[redis]\nurl = "not a url"\n')
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2
    assert "[kafka] bootstrap: 'localhost' is not host:port (e.g. 127.0.0.1:9092" in result.output
    assert "[redis] url: not a Redis URL (its scheme must be one of redis, rediss" in result.output
    assert "redis+sentinel://host:port,host:port/<service>" in result.output  # how to write one
    assert "Value error" not in result.output


def test_config_show_reads_back_as_the_same_settings_with_secrets_redacted(tmp_path, monkeypatch):
    path = write(
        tmp_path,
        '[security]\nadmin_token = "a-long-admin-token-0123456789"\n[drift]\nreaction = "trim"\n'
        '[[pool.models]]\nname = "a"\nbackend = "openai"\noptions = { base_url = "http://a/v1", model = "a" }\n',
    )
    result = CliRunner().invoke(app, ["config", "show", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert "a-long-admin-token" not in result.output and 'admin_token = "**********"' in result.output
    shown = tomllib.loads(result.output)
    assert shown["drift"]["reaction"] == "trim" and shown["pool"]["models"][0]["options"]["model"] == "a"
    expected = Settings()  # RLENS_CONFIG was set by --config
    for group, model in expected:
        for key, value in model:
            if key in shown[group] and not hasattr(value, "get_secret_value"):
                assert shown[group][key] == json.loads(json.dumps(value, default=str)), (group, key)
    # issue 60: a pool model's key, a password in a model's URL or in the OTLP endpoint, in text and in JSON
    secrets = write(
        tmp_path,
        '[service]\notel_endpoint = "http://otel:pw-otel-123@collector:4318/v1/traces"\n'
        '[[pool.models]]\nname = "a"\nbackend = "openai"\n'
        'options = { base_url = "http://user:pw-url-456@models:8000/v1", model = "a", api_key = "sk-key-789" }\n',
    )
    for extra in ([], ["--json"]):
        shown_secrets = CliRunner().invoke(app, ["config", "show", "--config", str(secrets), *extra])
        assert shown_secrets.exit_code == 0, shown_secrets.output
        assert not any(s in shown_secrets.output for s in ("pw-otel-123", "pw-url-456", "sk-key-789")), extra
        assert (
            "http://user:***@models:8000/v1" in shown_secrets.output
            and "http://otel:***@collector:4318" in shown_secrets.output
        )


def test_a_newcomers_stack_from_one_file(tmp_path, quick_zoo):
    """Three `openai` model servers, the pool, the budget and the gateway's keys in rlens.toml; `rlens up
    --config` serves them; an answer through the gateway comes from those three models."""
    from test_first_hour import interrupt, read_until, start

    from rlens.models.serve import ServerProcess
    from rlens.ports import free_port
    from rlens.service.gateway.api_keys import add_key
    from rlens.zoo.build import load_zoo

    specialists = [m for m in load_zoo(quick_zoo) if m.gguf_file is None][:3]  # small, quick to serve
    servers = [ServerProcess(Path(m.path), m.name) for m in specialists]
    up = None
    try:
        key, _ = add_key(tmp_path / "keys.json", "newcomer", ["*"], rate_per_s=100.0, burst=100)
        pool = "".join(
            f'[[pool.models]]\nname = "{m.name}"\nbackend = "openai"\ncost = {i + 1}.0\n'
            f'options = {{ base_url = "{s.url}", model = "{m.name}" }}\n'
            for i, (m, s) in enumerate(zip(specialists, servers))
        )
        kafka = f'[kafka]\nbootstrap = "{EXTERNAL}"\ntopic_prefix = "cfg{os.getpid()}."\n' if EXTERNAL else ""
        config = write(
            tmp_path,
            f'[focal]\nbudget = 0.5\n[gateway]\nport = 0\nkeys_file = "{tmp_path / "keys.json"}"\n{kafka}{pool}',
        )
        assert CliRunner().invoke(app, ["config", "check", str(config)]).exit_code == 0
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLENS_")}
        up = start(
            ["up", "--config", str(config), "--workdir", str(tmp_path / "up"), "--broker-port", str(free_port())],
            env,
        )
        lines = read_until(up, "OpenAI-compatible gateway:")
        url = re.search(r"gateway: (http://\S+)/v1", lines[-1])
        assert url, "".join(lines)
        assert any("pool " in line and "pool.json" in line for line in lines), "".join(lines)
        response = httpx.post(
            f"{url.group(1)}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={
                "model": "rlens-focal",
                "messages": [{"role": "user", "content": "Q: add: 12+7=\nA:"}],
                "rlens": {"choices": [" 19", " 18", " 29", " 20"]},
            },
            timeout=120.0,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["message"]["content"] in (" 19", " 18", " 29", " 20")
        used = set(body["rlens"]["answered_models"])
        assert used and used <= {m.name for m in specialists}, body
    finally:
        if up is not None:
            interrupt(up)
            up.communicate(timeout=90)
        for server in servers:
            server.kill()


def test_the_probe_rate_defaults_to_more_probes_under_gated_promotion():
    """The gate ranks candidates by evidence the probes give: 20 % of queries unless set (5 % otherwise)."""
    base = Settings()
    assert base.updated(promotion="direct").probe_rate == FocalConfig.probe_rate == 0.05
    assert (
        base.updated(promotion="gated").probe_rate == base.updated(promotion="holdback").probe_rate == GATED_PROBE_RATE
    )
    assert GATED_PROBE_RATE == 0.2
    assert base.updated(promotion="gated", focal_probe_rate=0.02).probe_rate == 0.02
    assert base.updated(promotion="direct", focal_probe_rate=0.0).focal_config().probe_rate == 0.0


def test_the_example_configuration_is_valid():
    example = Path(__file__).resolve().parent.parent / "infra" / "rlens.example.toml"
    result = CliRunner().invoke(app, ["config", "check", str(example)])
    assert result.exit_code == 0 and "a pool of 3 models" in result.output, result.output


def test_log_records_are_json_lines_with_the_query_they_are_about(capfd):
    """RLENS_LOG_FORMAT=json: one JSON object per line, the process's role and strategy on each, and a record about
    a query carries its id, stream, tenant and policy version."""
    import logging

    from rlens.service.common.logs import query_fields, setup_logging

    setup_logging("worker", "rl_focal", "json")
    try:
        log = logging.getLogger("rlens.worker")
        log.info("ready")
        log.error("query %s failed", "q1", extra=query_fields("q1", "@acme/support", 7))
    finally:
        logging.getLogger().handlers.clear()
    lines = capfd.readouterr().err.strip().splitlines()
    first, second = (json.loads(line) for line in lines[-2:])
    assert first["message"] == "ready" and first["role"] == "worker" and first["strategy"] == "rl_focal"
    assert first["level"] == "INFO" and first["logger"] == "rlens.worker" and first["time"].endswith("+00:00")
    assert (second["query_id"], second["stream"], second["tenant"], second["policy_version"]) == (
        "q1",
        "@acme/support",
        "acme",
        7,
    )


def test_the_log_handler_writes_to_stderr_as_it_is_when_a_record_comes():
    """A command run in process (the CLI runner) sets logging up on a stderr it closes afterwards: a later record
    (a library's INFO line) goes to the stderr of its own time, not to the closed one."""
    import io
    import logging
    import sys

    from rlens.service.common.logs import setup_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    first, second = io.StringIO(), io.StringIO()
    try:
        sys.stderr = first
        setup_logging("worker", "rl_focal", "text")
        logging.getLogger("rlens.test").info("at the setup")
        first.close()
        sys.stderr = second
        logging.getLogger("a.library").info("a library's line")
        written = second.getvalue()
    finally:
        sys.stderr = sys.__stderr__
        root.handlers[:] = handlers
        root.setLevel(level)
    assert "a library's line" in written and "Logging error" not in written, written


def test_variables_are_as_strict_as_the_file_and_take_the_files_group_names(tmp_path, monkeypatch):
    """Issue 54: a typo in an RLENS_* variable is named with the closest setting by every command (and every
    process, through its log); the name a reader of the file guesses, RLENS_<GROUP>_<KEY>, works."""
    from rlens.config_file import unknown_variables

    monkeypatch.setenv("RLENS_REDIS_PREFX", "x")
    monkeypatch.setenv("RLENS_KAFKA_TOPIC_PREFIX", "mine.")
    monkeypatch.setenv("RLENS_CONFIG", str(write(tmp_path, "[kafka]\ntopic_prefix = 'file.'\n")))
    assert Settings().kafka.topic_prefix == "mine."  # the variable over the file, by either name
    monkeypatch.setenv("RLENS_TOPIC_PREFIX", "flat.")
    assert Settings().kafka.topic_prefix == "flat."  # the setting's own name first
    lines = unknown_variables(
        {"RLENS_REDIS_PREFX": "x", "RLENS_KAFKA_TOPIC_PREFIX": "y", "RLENS_CONFIG": "z"}, set(variables())
    )
    assert lines == [
        "RLENS_REDIS_PREFX is not a setting of rlens and changes nothing (did you mean 'RLENS_REDIS_PREFIX'?)"
    ]
    result = CliRunner().invoke(app, ["config", "show"])
    assert result.exit_code == 0 and "warning: RLENS_REDIS_PREFX is not a setting" in result.output
    assert "did you mean 'RLENS_REDIS_PREFIX'" in result.output and "KAFKA_TOPIC_PREFIX" not in result.output


def test_up_names_where_an_unreachable_address_came_from(tmp_path, monkeypatch):
    """Issue 54: `rlens up --config FILE` blamed RLENS_REDIS_URL for a URL the file set."""
    from rlens.local.up import UpError, redis_to_use
    from rlens.ports import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    path = write(tmp_path, f'[redis]\nurl = "{url}"\n')
    monkeypatch.delenv("RLENS_REDIS_URL", raising=False)
    monkeypatch.setenv("RLENS_CONFIG", str(path))
    with pytest.raises(UpError, match=re.escape(f"[redis] url in {path}")):
        redis_to_use(Settings(), url)
    monkeypatch.setenv("RLENS_REDIS_URL", url)
    with pytest.raises(UpError, match=r"\(RLENS_REDIS_URL\)"):
        redis_to_use(Settings(), url)
