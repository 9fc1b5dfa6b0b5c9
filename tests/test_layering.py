"""The package layering: model_executor/ (the model) < runners/ (what runs it) < scheduler/ and server/.

The two lower packages never import a package above them. (scheduler/ and server/ share the IPC messages
in server/ipc.py, so they are one layer here.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["model_executor", "runners", "scheduler", "server"]


def _imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ["model_executor", "runners"])
def test_no_import_from_a_higher_layer(package):
    higher = set(LAYERS[LAYERS.index(package) + 1:])
    offenders = {str(f.relative_to(ROOT)): sorted(_imported_packages(f) & higher)
                 for f in sorted((ROOT / package).rglob("*.py")) if _imported_packages(f) & higher}
    assert offenders == {}
