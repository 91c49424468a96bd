"""The layout's rules (ARCHITECTURE.md): no import cycle among rlens's modules, and the dependency arrows one way:
what a production image runs (rlens.service and below) imports neither the command line nor the local stack; and
ARCHITECTURE.md names no module that is gone, and its module map is the modules' own docstrings
(``python tests/test_layout.py`` writes it again)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rlens

ROOT = Path(rlens.__file__).parent
ARCHITECTURE = ROOT.parent / "ARCHITECTURE.md"
MAP_START = "<!-- module map: written by `python tests/test_layout.py` from each module's docstring -->"
MAP_END = "<!-- end of the module map -->"


def import_graph() -> dict[str, set[str]]:
    """Module -> the rlens modules it imports (at the top, in functions or for type checking alike)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target.startswith("rlens") and (found := resolve(target)) not in (None, name):
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_production_code_imports_neither_the_command_line_nor_the_local_stack():
    graph = import_graph()
    production = [
        m for m in graph if m.startswith(("rlens.service", "rlens.focal", "rlens.messages", "rlens.settings"))
    ]
    wrong = {m: sorted(t for t in graph[m] if t.startswith(("rlens.cli", "rlens.local"))) for m in production}
    assert not {m: t for m, t in wrong.items() if t}


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """rlens's packages and top-level modules (``rlens.focal``, ``rlens.settings``) -> those their modules import."""

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {package(m): set() for m in graph}
    for module, targets in graph.items():
        packages[package(module)] |= {package(t) for t in targets} - {package(module)}
    return packages


def test_package_arrows_go_one_way():
    """Issue 55: no cycle among packages either (a module-level cycle check lets two packages import each other)."""
    assert cycles(package_graph(import_graph())) == []


def test_records_and_the_algorithms_import_nothing_above_them():
    """Issue 55: the recorded formats and answer parsing (``rlens.records``) import nothing else of rlens; the
    algorithm packages (RL-Focal, RLAE) neither the offline evaluation, the models' side, the service, the local stack
    nor the command line."""
    packages = package_graph(import_graph())
    assert packages["rlens.records"] == set()
    above = {"rlens.evaluation", "rlens.models", "rlens.service", "rlens.local", "rlens.cli"}
    assert {p: sorted(packages[p] & above) for p in ("rlens.focal", "rlens.rlae")} == {
        "rlens.focal": [],
        "rlens.rlae": [],
    }


def summary(path: Path) -> str:
    """A module docstring's first paragraph on one line, its reST roles as Markdown code."""
    paragraph = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0].split())
    return re.sub(r"(?::[a-z]+:)?``?([^`]+)``?", r"`\1`", paragraph)


def module_map() -> str:
    """Every module of rlens, folder by folder, with its docstring's first paragraph."""
    lines = [MAP_START]
    folders: dict[Path, list[Path]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        folders.setdefault(path.parent, []).append(path)
    for folder, paths in sorted(folders.items()):
        lines += ["", f"**`{folder.relative_to(ROOT.parent)}/`**", ""]
        lines += [f"- `{path.name}`: {summary(path) or '(no docstring)'}" for path in paths]
    return "\n".join([*lines, "", MAP_END])


def written_map(text: str) -> str:
    start, end = text.index(MAP_START), text.index(MAP_END)
    return text[start : end + len(MAP_END)]


def test_architecture_md_maps_every_module_as_its_docstring_says():
    """Issue 55: the map in ARCHITECTURE.md is the code's (a module added, moved or described anew: run
    ``python tests/test_layout.py``)."""
    assert written_map(ARCHITECTURE.read_text()) == module_map(), "run `python tests/test_layout.py`"


def test_architecture_md_names_no_module_that_is_gone():
    named = set(re.findall(r"\brlens/[\w/]+\.py\b", ARCHITECTURE.read_text()))
    assert sorted(p for p in named if not (ROOT.parent / p).exists()) == []


def test_every_module_says_what_it_is():
    assert [str(p) for p in sorted(ROOT.rglob("*.py")) if not summary(p)] == []


if __name__ == "__main__":
    text = ARCHITECTURE.read_text()
    ARCHITECTURE.write_text(text.replace(written_map(text), module_map()))
