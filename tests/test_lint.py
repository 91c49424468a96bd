"""The code base passes ruff's pyflakes and syntax checks (unused imports or variables, undefined names), is laid out
as `ruff format` lays it out (120 columns), and passes mypy's type check on the whole package: the configuration is
in pyproject.toml, so `ruff check`, `ruff format --check` and `mypy` give the same answers by hand."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the ruff of this environment (its version is pinned in constraints.txt), else one on the PATH
RUFF = (
    str(Path(sys.executable).parent / "ruff")
    if (Path(sys.executable).parent / "ruff").is_file()
    else shutil.which("ruff")
)


def test_ruff_finds_nothing():
    result = subprocess.run(
        [RUFF, "check", "rlens", "tests", "bench", "services"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_code_is_laid_out_by_ruff_format():
    result = subprocess.run([RUFF, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout + result.stderr


def test_mypy_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
