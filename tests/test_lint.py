"""The code base passes ruff's pyflakes and syntax checks (unused imports or variables, undefined names): the
configuration is in pyproject.toml, so `ruff check` gives the same answer by hand."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    result = subprocess.run([ruff, "check", "rlens", "tests", "bench", "services"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
