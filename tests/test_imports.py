"""The project's modules import cleanly: no import cycles, and every module imports alone.

A cycle hides behind an import moved into a function body (it still binds the two modules
together, and breaks when one of them is imported first from elsewhere), so the graph here
takes every import of a project module wherever it appears, except under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler", "moe", "dist_engine", "launcher")


def project_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name imported from a package counts as
    the package, unless it is a module of its own)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets.update(resolve(f"{base}.{alias.name}") for alias in node.names)
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_project_has_no_import_cycles():
    modules = project_modules()
    assert len(modules) > 50, sorted(modules)
    assert cycles(import_graph(modules)) == []


def test_the_cycle_finder_sees_imports_in_function_bodies_but_not_type_checking(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import thing\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n"
    )
    (package / "d.py").write_text("import pkg.c\n")
    graph = import_graph(project_modules(tmp_path, ("pkg",)))
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def preload_third_party(modules: dict[str, Path]) -> None:
    """Import every third-party name the project's modules import at their top level (the
    names too: transformers resolves them lazily), so that a fork imports project code only."""
    for path in modules.values():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                pairs = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in pairs:
                if module.partition(".")[0] in PACKAGES or module in sys.stdlib_module_names:
                    continue
                # An optional package that is missing: the fork of its module reports it.
                with contextlib.suppress(ImportError):
                    getattr(importlib.import_module(module), name or "__name__", None)


def test_every_module_imports_alone():
    """Each module in a process of its own that has imported no other project module (forked
    from one that imported only third-party packages), two at a time."""
    preload_third_party(project_modules())  # shared by the forks: each pays only for its own

    failures = []
    running: dict[int, str] = {}

    def reap() -> None:
        pid, status = os.wait()
        module = running.pop(pid)
        if status != 0:
            failures.append(module)

    for module in project_modules():
        if len(running) >= 2:
            reap()
        pid = os.fork()
        if pid == 0:  # the child: import one module, report by exit status
            code = 1
            try:
                for name in [n for n in sys.modules if n.partition(".")[0] in PACKAGES]:
                    del sys.modules[name]  # whatever earlier tests imported
                importlib.import_module(module)
                code = 0
            except BaseException as error:
                print(f"{module}: {type(error).__name__}: {error}", file=sys.stderr)
            finally:
                os._exit(code)
        running[pid] = module
    while running:
        reap()
    assert failures == []
