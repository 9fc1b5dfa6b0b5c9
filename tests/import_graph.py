"""The project's import graph, read from the source with `ast` (nothing is imported), for tests of its shape.

    graph = project_import_graph(ROOT, ["model_executor", "runners", "scheduler", "server"])
    graph["runners.capture_lists"]    # {"model_executor.layers.triton_ops.small_m_gemm_dispatch", ...}
    import_cycles(graph)               # [["pkg.a", "pkg.b"], ...]: each set of modules that import each other

A module is named as Python names it (`pkg/sub/mod.py` -> "pkg.sub.mod", `pkg/__init__.py` -> "pkg"). Its edges
are every import statement in the file, at module level or inside a function or class, relative ones resolved
against the module's package; only modules of the given packages are kept. Each statement counts for the module
it names: `from pkg import name` is an edge to `pkg.name` where that is a module, else to `pkg` (its
`__init__`); `import a.b.c` is an edge to `a.b.c`. The `__init__` of the packages above a module, which Python
runs first, is not an edge (otherwise a package's `__init__` that re-exports its modules would put every module
of the package in a circle with it). Imports under `if TYPE_CHECKING:` count too (a circle a type checker
follows is still a circle to a reader); include_type_checking=False leaves them out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path


def _module_names(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root/<package>."""
    names = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, include_type_checking: bool) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement in the tree (nested in functions, classes, try and if blocks alike)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not include_type_checking:
            stack.extend(node.orelse)  # (the else branch runs)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module name of a `from <dots><name> import ...` in `module`."""
    if level == 0:
        return name or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(package):
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def project_import_graph(root: str | Path, packages: Iterable[str],
                         include_type_checking: bool = True) -> dict[str, set[str]]:
    """{module: the project modules it imports} for every module under root/<package> (module docstring)."""
    root = Path(root)
    files = _module_names(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in _import_nodes(ast.parse(path.read_text(), str(path)), include_type_checking):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
                continue
            source = _absolute(module, is_package, node.level, node.module)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in files else source)
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected component of more than one module, sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(start: str) -> None:  # iterative: no recursion limit on a long import chain
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(components)
