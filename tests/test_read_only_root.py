"""The processes run as the chart runs them: a read-only root, only /tmp (an emptyDir there) and the learner's
checkpoint folder (its volume) writable, HOME in /tmp, no byte code written. Each process runs in a mount namespace
of its own (``unshare -m``, as root) where / is remounted read-only and a fresh tmpfs is mounted on /tmp; the
stack's files (pool, keys) are seen read-only at /mnt. A query through the gateway is answered, its feedback
joined, and the learner's checkpoint written, while nothing else could be written."""

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
VIEW = "/mnt"  # where a process sees the stack's folder (the host's /tmp, read-only)


def read_only_spawn(stack: LocalStack):
    """``stack._spawn``, each process in a mount namespace with a read-only root (see the module's docstring)."""
    workdir = stack.workdir.resolve()
    assert workdir.is_relative_to("/tmp"), workdir  # pytest's tmp_path
    seen = Path(VIEW) / workdir.relative_to("/tmp")

    def spawn(command: str, log_name: str, *args: str) -> subprocess.Popen:
        log = open(stack.workdir / log_name, "ab")  # opened here: the process writes through the descriptor
        env = {k: VIEW + v.removeprefix("/tmp") if v.startswith("/tmp/") else v for k, v in stack.env(command).items()}
        env |= {"HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "HF_HOME": "/tmp/hf", "MPLCONFIGDIR": "/tmp/mpl"}
        steps = [f"mount --rbind /tmp {VIEW}"]
        if command == "learner":  # its checkpoint volume: the one folder it may write besides /tmp
            steps.append(f"mount --bind {seen / 'learner'} {seen / 'learner'}")
        steps += ["mount -o remount,bind,ro /", f"mount -o remount,bind,ro {VIEW}"]
        if command == "learner":
            steps.append(f"mount -o remount,bind,rw {seen / 'learner'}")
        steps += ["mount -t tmpfs -o size=256m tmpfs /tmp", 'exec "$@"']
        script = " && ".join(steps)
        return subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
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
            assert "ro" in mounts["/"] and "ro" in mounts[VIEW] and "rw" in mounts["/tmp"], mounts
        writable = {m for m, options in mount_options(stack.learner.pid).items() if "rw" in options.split(",")}
        volume = VIEW + str((stack.workdir / "learner").resolve()).removeprefix("/tmp")  # its checkpoint folder
        assert {"/tmp", volume} <= writable and not {"/", VIEW} & writable, writable
    finally:
        stack.stop()
    logs = "".join(p.read_text(errors="replace") for p in stack.workdir.glob("*.log"))
    assert "Read-only file system" not in logs, logs[-3000:]
    assert not [line for line in logs.splitlines() if "mount:" in line], logs[-3000:]
