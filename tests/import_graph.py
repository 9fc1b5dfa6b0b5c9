"""The project's import graph, read from the source with `ast` (nothing is imported).

Every import statement counts, at module level or inside a function (a lazy import is still a dependency),
except those under `if TYPE_CHECKING:`. Relative imports are resolved against the importing module, and
`from pkg import name` is an edge to `pkg.name` when that is a module of the project, else to `pkg`.
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path, packages: list[str]) -> dict[str, Path]:
    """Every module of the given top-level packages: dotted name -> file."""
    return {module_name(root, p): p for pkg in packages for p in sorted((Path(root) / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes, skipping the bodies of `if TYPE_CHECKING:` (their `else:` still runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _longest_module(name: str, modules) -> str | None:
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def module_imports(module: str, path: Path, modules) -> set[str]:
    """The project modules (of `modules`) that `module`'s import statements name."""
    is_package = path.name == "__init__.py"
    found: set[str | None] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {_longest_module(alias.name, modules) for alias in node.names}
            continue
        if node.level:  # relative: the importing module's package, then up level - 1 more
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module
        for alias in node.names:  # `from pkg import sub` names the module pkg.sub; `from mod import f`, mod
            sub = f"{target}.{alias.name}"
            found.add(sub if sub in modules else _longest_module(target, modules))
    return {m for m in found if m is not None and m != module}


def project_import_graph(root, packages) -> dict[str, set[str]]:
    """module -> the project modules it imports, for every module of the top-level `packages` under root.

    Only modules of `packages` appear, as nodes and as edges (imports of anything else are dropped)."""
    modules = project_modules(Path(root), list(packages))
    return {module: module_imports(module, path, modules) for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each an import circle), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative Tarjan: deep graphs must not hit the recursion limit
        nonlocal counter
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)
