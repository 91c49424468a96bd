"""The install is reproducible: constraints.txt pins every dependency pyproject.toml names (every extra but vllm,
which lives in its own environment), at a version its bounds allow, and the README's install and .ci/run use it."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    found = {}
    for line in lines:
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not NAME==VERSION"
            found[canonical(name)] = version.strip()
    return found


def test_every_dependency_is_pinned_within_its_bounds():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {k: v for k, v in project["optional-dependencies"].items() if k != "vllm"}
    requirements = [Requirement(r) for r in project["dependencies"] + sum(extras.values(), [])]
    pinned = pins()
    for requirement in requirements:
        name = canonical(requirement.name)
        assert name in pinned, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {requirement.name}=={pinned[name]}, outside pyproject.toml's {requirement.specifier}"
        )


def test_the_readme_install_and_ci_use_the_constraints():
    readme = (ROOT / "README.md").read_text()
    install = next(line for line in readme.splitlines() if line.startswith("pip install torch"))
    assert install.count("-c constraints.txt") == 2, install
    ci = (ROOT / ".ci" / "run").read_text()
    assert install.split("   #")[0].replace("pip install", "pip install --quiet") in ci
    assert "python3 -m venv" in ci
