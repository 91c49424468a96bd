"""What a new user meets first, on real processes: Ctrl-C in `rlens replay` stops it and every worker process at
once with one line; tests skipped for want of the shared dataset say what they need."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    rest, _ = process.communicate(timeout=60)
    output = "".join(seen) + rest
    assert process.returncode == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert output.strip().splitlines()[-1].startswith("interrupted: stopped the replay"), output
    deadline = time.monotonic() + 10
    while group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(process.pid), "a worker process outlived the replay"
    assert not (tmp_path / "results.json").exists()


def test_tests_skipped_without_the_shared_dataset_say_what_they_need(tmp_path):
    env = {**os.environ, "RLENS_SHARED_DATA": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "tests/test_dataset_and_cli.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"skipped: they need the recorded dataset bbh_dev at {tmp_path / 'bbh_dev'}" in result.stdout, result.stdout
