"""What a new user meets first, on real processes: Ctrl-C in `rlens replay` stops it and every worker process at
once with one line, and Ctrl-C while rlens loads is quiet; tests skipped for want of the shared dataset say what they need."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def interrupt(process: subprocess.Popen) -> None:
    """Ctrl-C to the process's group, as a terminal sends it; nothing if the group has already exited (a command
    that failed at its start), so that a test's own failure is the one it reports."""
    try:
        os.killpg(process.pid, signal.SIGINT)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("when", ["starting", "running"])
def test_ctrl_c_stops_the_replay_and_its_worker_processes_with_one_line(tmp_path, when):
    """Ctrl-C reaches the whole process group, as from a terminal: while the worker processes start (they used to
    print a KeyboardInterrupt traceback each) and while they run (the replay used to hang)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "rlens.cli", "demo", "--protocol", "paper", "--workers", "2", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group, so the signal reaches its children too, as Ctrl-C does
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a shell's background jobs ignore it
    )
    assert process.stdout is not None
    seen = [process.stdout.readline()]  # the dataset line, printed before the worker processes start
    if when == "running":
        while "%" not in seen[-1] and seen[-1]:  # the first progress line: the variants are at work
            seen.append(process.stdout.readline())
    else:
        time.sleep(0.5)
    assert process.poll() is None, "".join(seen)
    os.killpg(process.pid, signal.SIGINT)
    rest, _ = process.communicate(timeout=180)
    output = "".join(seen) + rest
    assert process.returncode == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert output.strip().splitlines()[-1].startswith("interrupted: stopped the replay"), output
    deadline = time.monotonic() + 10
    while group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(process.pid), "a worker process outlived the replay"
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("later_s", [0.0, 0.03, 0.1, 0.3])
def test_ctrl_c_while_the_command_line_loads_exits_quietly(later_s):
    """Ctrl-C while rlens loads its modules (``later_s`` after pydantic's library is loaded, a third of the way) or
    typer builds its commands ends with 130 and no traceback (not even Python's "Exception ignored" of an interrupt
    that landed in one of importlib's callbacks: 5 of 150 random moments did before); a command that finished first
    ends with 0, and one interrupted while the interpreter shuts down, after Python put SIGINT's default action back,
    ends killed by it (a shell's 130 too: 13 of 40 moments 0.33-0.44 s after pydantic's library on a fast VM)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "rlens.cli", "--help"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a shell's background jobs ignore it
    )
    maps, deadline = Path(f"/proc/{process.pid}/maps"), time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline and "pydantic_core" not in maps.read_text():
        time.sleep(0.005)
    time.sleep(later_s)
    process.send_signal(signal.SIGINT)
    _, errors = process.communicate(timeout=120)
    assert process.returncode in (0, 130, -signal.SIGINT) and "Traceback" not in errors, errors


def test_tests_skipped_without_the_shared_dataset_say_what_they_need(tmp_path):
    env = {**os.environ, "RLENS_SHARED_DATA": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "tests/test_dataset_and_cli.py",
            "-k",
            "load_round_trip or costs_are_read",  # two of the tests that need it
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"skipped: they need the recorded dataset bbh_dev at {tmp_path / 'bbh_dev'}" in result.stdout, result.stdout


def test_the_suite_leaves_the_readme_default_ports_to_a_running_stack():
    """While a README-default `rlens up` holds port 8000, the suite's gateways take free ones (conftest.py)."""
    from rlens.settings import settings

    assert settings().gateway.port == 0 and settings().metrics.port == 0


def test_no_help_page_shows_a_flag_as_taking_a_value():
    """typer 0.29 wrote every flag as `--flag <bool>` (pyproject.toml bounds it below that)."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from rlens.cli import app

    def commands(group, path):
        for name, command in getattr(group, "commands", {}).items():
            yield [*path, name]
            yield from commands(command, [*path, name])

    runner = CliRunner()
    for path in [[], *commands(get_command(app), [])]:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and "<bool>" not in result.output, (path, result.output)


def start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """A CLI command in a process group of its own, as a terminal runs it (SIGINT not ignored)."""
    return subprocess.Popen(
        [sys.executable, "-m", "rlens.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def read_until(process: subprocess.Popen, words: str, timeout_s: float = 600.0) -> list[str]:
    """The process's lines up to the first that holds ``words``. The wait is long: `rlens up` has its own limits
    (Apache Kafka's start, every process ready: 180 s each) and says why it gives up; on 2 busy cores a start takes
    minutes. A reader thread keeps the deadline real while a line is awaited."""
    assert process.stdout is not None
    stdout = process.stdout
    lines: list[str] = []

    def read() -> None:
        for line in iter(stdout.readline, ""):
            lines.append(line)
            if words in line:
                return

    started = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    waited = f"after {time.monotonic() - started:.0f} s, exit code {process.poll()}:\n"
    assert lines and words in lines[-1], waited + "".join(lines)
    return lines


@pytest.fixture
def zoo_env(quick_zoo, monkeypatch):
    """`rlens up`'s default pool runs the zoo's models: the quick zoo's, so that no test builds the real one."""
    monkeypatch.setenv("RLENS_ZOO_DIR", str(quick_zoo))


@pytest.mark.usefixtures("zoo_env")
def test_a_default_stack_answers_any_prompt_refuses_a_second_one_feeds_load_and_stops_on_ctrl_c(tmp_path):
    """The default pool is the recording's models, real and in process, behind the output cache the recording seeds:
    a question nobody recorded (multiple choice or open-ended) gets a real answer, asked again it comes from Redis,
    and a recorded question is answered from the recording. A second stack on the same work folder is refused in one
    line; `rlens load` finds the stack from its folder; Ctrl-C stops it (one stack with real models for all of it)."""
    import re

    import httpx

    from rlens.ports import free_port, port_taken
    from rlens.settings import settings
    from rlens.zoo.record import QUESTIONS_FILE, read_questions

    workdir = tmp_path / "up"
    up = start(
        ["up", "--workdir", str(workdir), "--workers", "1", "--gateway-port", "0", "--broker-port", str(free_port())]
    )
    try:
        lines = read_until(up, "OpenAI-compatible gateway:")
        assert any("send traffic with: rlens load --stack" in line for line in lines), "".join(lines)
        gateway = re.search(r"gateway: (http://\S+)/v1", lines[-1])
        worker = next((re.search(r"(http://\S+/metrics)", x) for x in lines if x.lstrip().startswith("worker")), None)
        assert gateway and worker, "".join(lines)
        headers = {"authorization": f"Bearer {(workdir / 'gateway.key').read_text().strip()}"}

        def ask(prompt: str, choices: list[str] | None = None) -> dict:
            body = {"model": "rlens-focal", "messages": [{"role": "user", "content": prompt}]}
            response = httpx.post(
                f"{gateway.group(1)}/v1/chat/completions",
                headers=headers,
                json={**body, **({"rlens": {"choices": choices}} if choices else {})},
                timeout=240.0,
            )
            assert response.status_code == 200, response.text
            return response.json()

        choices = [" a kitchen", " a violin", " a comet"]
        first = ask("Q: Where would you keep a spoon?\nA:", choices)
        assert first["choices"][0]["message"]["content"] in choices and first["rlens"]["answered_models"], first
        again = ask("Q: Where would you keep a spoon?\nA:", choices)
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        open_ended = ask("Q: add: 3+4=\nA:")
        assert open_ended["rlens"]["answered_models"] and open_ended["rlens"]["candidates"], open_ended
        assert open_ended["choices"][0]["message"]["content"] in open_ended["rlens"]["candidates"]
        recorded = read_questions(settings().service.demo_data / QUESTIONS_FILE)[0]
        assert ask(recorded.prompt, recorded.choices)["rlens"]["answered_models"]
        counts: dict[str, float] = {}
        for name, result, value in re.findall(
            r'^rlens_worker_model_cache_total\{model="([^"]+)",result="(\w+)"\} (\S+)$',
            httpx.get(worker.group(1), timeout=30).text,
            re.M,
        ):
            counts[result] = counts.get(result, 0) + float(value)
        both = set(first["rlens"]["answered_models"]) & set(again["rlens"]["answered_models"])
        assert counts.get("miss", 0) >= len(first["rlens"]["answered_models"]) and counts.get("hit", 0) >= len(both)
        assert counts.get("recorded", 0) >= 1 and not counts.get("error"), counts

        # a second stack on the same work folder: one line, before it starts anything
        port = free_port()
        second = subprocess.run(
            [sys.executable, "-m", "rlens.cli", "up", "--workdir", str(workdir), "--broker-port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = (second.stdout + second.stderr).strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, lines
        assert f"work folder {workdir} is in use by pid {up.pid}" in lines[0]
        assert not port_taken(port)
        # `rlens load` finds the stack from its work folder; through a pipe it shows progress as it goes
        load = subprocess.run(
            [sys.executable, "-m", "rlens.cli", "load", "--stack", str(workdir), "--limit", "60", "--rate", "60"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert load.returncode == 0, load.stdout + load.stderr
        out = load.stdout.splitlines()
        assert out[0].startswith("answered: 6/60 (10 %)") and "answered 60 of 60" in out[-1], load.stdout
        border = max(i for i, line in enumerate(out) if line.startswith("└"))
        assert out[border + 1] == "" and out[border + 2].startswith("  "), load.stdout  # not glued to the table
    finally:
        interrupt(up)
        rest, _ = up.communicate(timeout=180)
    assert up.returncode == 0, rest
    assert "stopping (workers drain and commit" in rest
    logs = "".join(p.read_text() for p in workdir.glob("*.log"))
    # the broker and Redis outlive the processes that drain through them; no rebalancing noise at the start
    assert "Unable connect" not in logs and "Redis unreachable" not in logs, logs[-3000:]
    assert "because it is rebalancing" not in logs


@pytest.mark.usefixtures("zoo_env")
def test_ctrl_c_while_the_stack_starts_stops_it_at_once_with_one_line(tmp_path):
    from rlens.ports import free_port, port_taken

    port = free_port()
    up = start(["up", "--workdir", str(tmp_path / "up"), "--gateway-port", "0", "--broker-port", str(port)])
    deadline = time.monotonic() + 120  # on a loaded machine the imports alone may take seconds
    while not port_taken(port) and up.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the broker is up, the service processes are starting
    assert up.poll() is None and port_taken(port)
    os.killpg(up.pid, signal.SIGINT)
    output, _ = up.communicate(timeout=180)
    assert up.returncode == 130, output
    assert output.strip().splitlines()[-1] == "interrupted: the stack was stopped before it was up"
    assert "Traceback" not in output and not port_taken(port)


@pytest.mark.usefixtures("zoo_env")
def test_an_unreachable_redis_or_broker_or_a_missing_feature_is_one_line(tmp_path):
    from rlens.ports import free_port

    for variable, words in (
        ("RLENS_REDIS_URL", "Redis does not answer at"),
        ("RLENS_KAFKA_BOOTSTRAP", "no Kafka"),
        ("RLENS_KAFKA_IDEMPOTENCE", "refused an idempotent producer"),  # tansu has none
    ):
        value = {
            "RLENS_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "RLENS_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
            "RLENS_KAFKA_IDEMPOTENCE": "true",
        }[variable]
        result = subprocess.run(
            [sys.executable, "-m", "rlens.cli", "up", "--workdir", str(tmp_path / "up"), "--no-gateway"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, variable: value},
        )
        lines = (result.stdout + result.stderr).strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and words in lines[0] and variable in lines[0], lines


def test_more_learner_shards_than_partitions_is_one_line_before_anything_starts(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rlens.cli", "up", "--workdir", str(tmp_path / "up"), "--learner-shards", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, lines
    assert "--learner-shards 5 exceeds --partitions 4" in lines[0] and not (tmp_path / "up" / "learner").exists()


async def records_in(bootstrap: str, topic: str) -> int:
    """How many records ``topic`` holds (its partitions' end offsets; nothing is deleted here)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    partitions = [TopicPartition(topic, p["partition"]) for p in described["partitions"]]
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        return sum((await consumer.end_offsets(partitions)).values())
    finally:
        await consumer.stop()


def test_a_new_kafka_clusters_id_never_starts_with_a_dash(monkeypatch):
    """One random UUID in 64 starts with "-" in URL-safe base64, and Kafka's storage tool read it as an option:
    `rlens up` failed at its start (CI did). Such a UUID is drawn again, as Kafka's own ``random-uuid`` does."""
    import uuid

    from rlens.local import kafka

    draws = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x04" + bytes(15))])
    monkeypatch.setattr(kafka.uuid, "uuid4", lambda: next(draws))
    assert kafka.cluster_id() == "BAAAAAAAAAAAAAAAAAAAAA"  # 0xf8's first six bits are 62: "-AAA…", drawn again


@pytest.mark.kafka
def test_up_runs_apache_kafka_in_its_work_folder_and_a_restart_keeps_the_topics(tmp_path):
    """`rlens up --broker kafka`: Apache Kafka with its data in the work folder. Stopped with Ctrl-C (the broker
    with it) and started again on the same folder, on another port, it holds the first run's records beside the
    second's, and the learner resumes."""
    import asyncio
    import re

    from rlens.local import kafka
    from rlens.ports import free_port

    if not os.environ.get("RLENS_TEST_KAFKA_BOOTSTRAP") or not kafka.fetched() or kafka.java_problem():
        pytest.skip("needs Java and Apache Kafka's jars: runs in CI's Kafka phase (RLENS_TEST_KAFKA_BOOTSTRAP set)")
    workdir = tmp_path / "up"
    for run in (1, 2):
        port = free_port()
        up = start(
            ["up", "--broker", "kafka", "--recorded-only", "--workdir", str(workdir), "--workers", "1"]
            + ["--gateway-port", "0", "--broker-port", str(port)]
        )
        try:
            said = "".join(read_until(up, "OpenAI-compatible gateway:"))
            assert f"broker: Apache Kafka {kafka.VERSION}, its data in {workdir / 'kafka'}" in said, said
            assert (run == 2) == ("the learner resumes its checkpoint" in said), said
            bootstrap = re.search(r"Kafka (127\.0\.0\.1:\d+)", said)
            assert bootstrap and bootstrap.group(1) == f"127.0.0.1:{port}", said
            client = (workdir / "client.env").read_text()  # Kafka answers a waiting fetch at once: a long wait
            assert f"RLENS_KAFKA_FETCH_MAX_WAIT_MS={kafka.LocalKafka.FETCH_MAX_WAIT_MS}\n" in client, client
            load = subprocess.run(
                [sys.executable, "-m", "rlens.cli", "load", "--stack", str(workdir), "--limit", "30", "--rate", "30"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert load.returncode == 0 and "answered 30 of 30" in load.stdout, load.stdout + load.stderr
            assert asyncio.run(records_in(bootstrap.group(1), "rlens.queries")) == 30 * run
        finally:
            interrupt(up)
            rest, _ = up.communicate(timeout=240)
        assert up.returncode == 0, rest
        left = subprocess.run(["pgrep", "-f", f"kafka.Kafka {workdir}"], capture_output=True, text=True).stdout
        assert not left.strip(), f"Apache Kafka outlived the stack: {left}"
