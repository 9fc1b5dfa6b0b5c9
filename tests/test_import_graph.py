"""tests/import_graph.py reads every import statement (relative ones, inside functions, `from pkg import
submodule`), and the quantization and Triton-op modules take part in no import circle."""

from __future__ import annotations

from pathlib import Path

from import_graph import import_cycles, project_import_graph

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["model_executor", "runners", "scheduler", "server"]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_every_import_statement_is_an_edge(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "import os\n\ndef f():\n    from . import b\n    from .sub import c\n",
        "pkg/b.py": "from pkg.sub.c import g\nfrom pkg import a as _a\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..b import X\n"
                        "else:\n    import pkg.sub\ntry:\n    from pkg.sub import missing\nexcept ImportError:\n"
                        "    pass\n",
        "other/__init__.py": "",
    })
    graph = project_import_graph(tmp_path, ["pkg"])
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b", "pkg.sub.c"},  # (os is not a project module)
        "pkg.b": {"pkg.sub.c", "pkg.a"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.b", "pkg.sub"},  # (a name that is no submodule: the package's __init__)
    }
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    without_type_checking = project_import_graph(tmp_path, ["pkg"], include_type_checking=False)
    assert without_type_checking["pkg.sub.c"] == {"pkg.sub"}
    assert import_cycles(without_type_checking) == [["pkg.a", "pkg.b"]]


def test_quantization_and_triton_ops_are_in_no_import_circle():
    graph = project_import_graph(ROOT, PACKAGES)
    prefixes = ("model_executor.layers.quantization", "model_executor.layers.triton_ops")
    assert "model_executor.layers.triton_ops.small_m_gemm_dispatch" in graph
    in_circles = [c for c in import_cycles(graph) if any(m == p or m.startswith(p + ".") for m in c for p in prefixes)]
    assert in_circles == []
