"""The package has no import circles.

An edge ``a -> b`` is an import that runs when ``a`` is imported: a statement at module level,
including those under ``if``/``try`` (``if TYPE_CHECKING:`` too: a type checker follows it) and
in class bodies, but not inside functions (lazy imports, which the layering uses on purpose).
``from p import name`` is an edge to ``p.name`` when that is a module of the package, else to
``p``. Read from the sources (``ast``), so nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_zeppelin"


def module_files(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _eager_imports(body: list[ast.stmt]):
    """Import statements that run at import time (not inside functions)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _eager_imports(getattr(node, field, []) or [])


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that importing ``name`` (file ``path``) imports eagerly."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _eager_imports(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        found |= {t for t in targets if t in modules and t != name}
    return found


def import_circles(root: Path) -> list[list[str]]:
    """Every circle of eager imports in the package at ``root``, each as a path
    ``[a, b, ..., a]`` (one per strongly connected group of modules)."""
    modules = module_files(root)
    graph = {name: sorted(imports_of(name, path, modules)) for name, path in modules.items()}
    circles = []
    for group in _strong_groups(graph):
        if len(group) > 1:
            circles.append(_circle_in(graph, set(group)))
    return circles


def _strong_groups(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    groups.append(sorted(group))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(graph[nxt])))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return groups


def _circle_in(graph: dict[str, list[str]], group: set[str]) -> list[str]:
    """A shortest circle through the first module of ``group`` (breadth first)."""
    start = min(group)
    parent = {start: None}
    queue = [start]
    for node in queue:
        for nxt in graph[node]:
            if nxt == start:
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return [start] + path[::-1][1:] + [start] if node != start else [start, start]
            if nxt in group and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def test_the_package_has_no_import_circles():
    assert len(module_files(PACKAGE)) > 50  # the package was found
    circles = import_circles(PACKAGE)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_finder_sees_circles_through_type_checking_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from ..c import C\n")
    (pkg / "c.py").write_text("import pkg.a\n\ndef lazy():\n    from pkg import d\n")
    (pkg / "d.py").write_text("from pkg import c\n")  # c -> d is lazy: no circle
    assert import_circles(pkg) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    (pkg / "c.py").write_text("class C:\n    from pkg import d\n")  # class bodies run
    assert import_circles(pkg) == [["pkg.c", "pkg.d", "pkg.c"]]
