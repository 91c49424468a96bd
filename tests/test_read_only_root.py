"""The processes run as the chart runs them: a read-only root, only a scratch folder (the chart's /tmp emptyDir) and
the learner's checkpoint folder (its volume) writable, HOME and TMPDIR in the scratch, no byte code written. Each
process runs in a mount namespace of its own (``unshare -m``, as root) where / (and /tmp, if it is a mount of its
own: the checkout and the stack's files may live there) is remounted read-only and a fresh tmpfs is mounted on
/mnt as the scratch. A query through the gateway is answered, its feedback joined, and the learner's checkpoint
written, while nothing else could be written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from brokers import replay_stack_for_tests
from rlens.local.servers import die_with_parent
from rlens.local.stack import LocalStack

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare (util-linux) to remount / read-only in a mount namespace",
)
SCRATCH = "/mnt"  # the process's one writable folder besides the learner's volume (the chart's /tmp emptyDir)


def read_only_spawn(stack: LocalStack):
    """``stack._spawn``, each process in a mount namespace with a read-only root (see the module's docstring)."""
    volume = (stack.workdir / "learner").resolve()

    def spawn(command: str, log_name: str, *args: str) -> subprocess.Popen:
        log = open(stack.workdir / log_name, "ab")  # opened here: the process writes through the descriptor
        env = stack.env(command) | {
            "HOME": SCRATCH,
            "TMPDIR": SCRATCH,
            "PYTHONDONTWRITEBYTECODE": "1",
            "HF_HOME": f"{SCRATCH}/hf",
            "MPLCONFIGDIR": f"{SCRATCH}/mpl",
        }
        steps = [f"mount --bind {volume} {volume}"] if command == "learner" else []
        steps += ["mount -o remount,bind,ro /", "{ ! mountpoint -q /tmp || mount -o remount,bind,ro /tmp; }"]
        if command == "learner":  # its checkpoint volume: the one folder it may write besides the scratch
            steps.append(f"mount -o remount,bind,rw {volume}")
        steps += [f"mount -t tmpfs -o size=256m tmpfs {SCRATCH}", 'exec "$@"']
        return subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", " && ".join(steps), "sh"]
            + [sys.executable, "-m", "rlens.cli", command, *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )

    return spawn


def mount_options(pid: int) -> dict[str, str]:
    """Mount point -> its options, as process ``pid`` sees them (/proc/<pid>/mountinfo)."""
    lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    return {fields[4]: fields[5] for fields in (line.split() for line in lines)}


def test_the_service_runs_with_a_read_only_root_and_only_its_volumes_writable(tmp_path):
    stack = replay_stack_for_tests(tmp_path, {"checkpoint_every_s": 1.0})
    (stack.workdir / "learner").mkdir(exist_ok=True)
    stack._spawn = read_only_spawn(stack)  # type: ignore[method-assign]
    try:
        stack.start_service(workers=1, gateway=True, wait_s=180)
        gateway = next(u for name, u in stack.http_urls().items() if name.startswith("gateway:"))
        key = {"Authorization": f"Bearer {stack.gateway_key.read_text().strip()}"}
        body = {
            "model": "rlens-focal",
            "messages": [{"role": "user", "content": "question 3"}],
            "rlens": {"choices": ["A", "B", "C", "D"], "reference_id": "3"},
        }
        answer = httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=key, timeout=120)
        assert answer.status_code == 200, answer.text
        given = httpx.post(
            f"{gateway}/v1/feedback", json={"id": answer.json()["id"], "label": 1}, headers=key, timeout=60
        )
        assert given.status_code == 202, given.text
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list((stack.workdir / "learner").glob("*")):
            time.sleep(0.5)
        assert list((stack.workdir / "learner").glob("*")), "the learner wrote no checkpoint to its volume"
        for process in [stack.learner, stack.gateway, *stack.workers]:
            assert process is not None and process.poll() is None, (stack.workdir / "learner.log").read_text()[-3000:]
            mounts = mount_options(process.pid)
            assert "ro" in mounts["/"].split(",") and "rw" in mounts[SCRATCH].split(","), mounts
            assert "/tmp" not in mounts or "ro" in mounts["/tmp"].split(","), mounts
        writable = {m for m, options in mount_options(stack.learner.pid).items() if "rw" in options.split(",")}
        volume = str((stack.workdir / "learner").resolve())  # its checkpoint folder
        assert {SCRATCH, volume} <= writable and not {"/", "/tmp"} & writable, writable
    finally:
        stack.stop()
    logs = "".join(p.read_text(errors="replace") for p in stack.workdir.glob("*.log"))
    assert "Read-only file system" not in logs, logs[-3000:]
    assert not [line for line in logs.splitlines() if "mount:" in line], logs[-3000:]
