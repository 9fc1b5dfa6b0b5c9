"""One-way layers: server -> scheduler -> runners -> model_executor, and no import circles.

Each package imports only itself and the packages below it (benchmarks/ and tests/ may import anything;
no product package imports them). Read from the source by tests/import_graph.py: every import statement
counts, inside functions too; only `if TYPE_CHECKING:` blocks are skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import cycles, project_import_graph

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["model_executor", "runners", "scheduler", "server"]  # bottom to top


def _package(module: str) -> str:
    return module.split(".")[0]


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """module -> the modules it imports from a higher layer, or from benchmarks/ or tests/."""
    found = {}
    for module, imported in graph.items():
        if _package(module) not in LAYERS:
            continue  # benchmarks/ and tests/ may import anything
        level = LAYERS.index(_package(module))
        bad = sorted(m for m in imported if _package(m) not in LAYERS[:level + 1])
        if bad:
            found[module] = bad
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return project_import_graph(ROOT, LAYERS + ["benchmarks", "tests"])


def test_the_graph_covers_every_layer(graph):
    assert {_package(m) for m in graph} >= set(LAYERS)
    assert "scheduler.scheduler_process" in graph["server.scheduler_entry"]


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_itself_and_the_packages_below(graph, package):
    offenders = {m: bad for m, bad in upward_imports(graph).items() if _package(m) == package}
    assert offenders == {}


def test_no_import_circles():
    graph = project_import_graph(ROOT, LAYERS)
    assert cycles(graph) == []


# ---- the checker itself, on a small made-up project ----------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_sees_lazy_relative_and_submodule_imports(tmp_path):
    _write(tmp_path, {
        "model_executor/__init__.py": "",
        "model_executor/a.py": "def f():\n    from server import c  # lazy, and a submodule by from-import\n",
        "model_executor/b.py": "from . import a\nfrom .a import f\n",
        "server/__init__.py": "",
        "server/c.py": ("from typing import TYPE_CHECKING\n"
                        "if TYPE_CHECKING:\n    from model_executor import a\n"
                        "else:\n    import model_executor.b.f\n"),
    })
    graph = project_import_graph(tmp_path, ["model_executor", "server"])
    assert graph == {"model_executor": set(), "model_executor.a": {"server.c"},
                     "model_executor.b": {"model_executor.a"},
                     "server": set(), "server.c": {"model_executor.b"}}  # (not .a: TYPE_CHECKING only)
    assert upward_imports(graph) == {"model_executor.a": ["server.c"]}
    assert cycles(graph) == [["model_executor.a", "model_executor.b", "server.c"]]


def test_type_checking_imports_do_not_count(tmp_path):
    _write(tmp_path, {
        "runners/__init__.py": "",
        "runners/x.py": "import typing\nif typing.TYPE_CHECKING:\n    from runners.y import Y\n",
        "runners/y.py": "from runners.x import X\n",
    })
    graph = project_import_graph(tmp_path, ["runners"])
    assert graph["runners.x"] == set() and graph["runners.y"] == {"runners.x"}
    assert cycles(graph) == []
