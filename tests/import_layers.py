"""The import rules of the three packages, checked by parsing source (nothing is imported).

Layers: ``lcv_kernels`` <- ``lightning_plugin`` <- ``lcv_vision`` (an arrow means "may import"). A lower layer never
imports a higher one, at module level or lazily inside a function: a lazy import is still a dependency, and it
would make ``kernels`` unusable without the plugin (or the plugin without the recipes).

Cycles: only imports that run while a module is being imported (module level, including inside ``if``/``try``
and class bodies) form cycles. An import inside a function runs when the function is called, after every
module has finished importing, so it cannot meet a half-initialised module; it is how a module defers a heavy
or optional dependency. Those imports are still held to the layers above. ``if TYPE_CHECKING:`` blocks never
run and are left out of the cycle check too.

Used by ``tests/test_layers.py`` on the real tree and on planted trees (so the check is known to fail).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LAYERS: tuple[str, ...] = ("lcv_kernels", "lightning_plugin", "lcv_vision")
#: The folder of the repository that holds each import package (``kernels/`` and ``vision/`` are plain folders).
FOLDERS: dict[str, str] = {"lcv_kernels": "kernels/lcv_kernels", "lcv_vision": "vision/lcv_vision"}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the file that imports
    imported: str  # dotted module name it resolves to (a module or package of the tree, or an outside name)
    line: int
    module_level: bool  # runs while the importer is being imported


def module_names(root: Path, packages: tuple[str, ...] = LAYERS) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted name -> file (``pkg/__init__.py`` is ``pkg``)."""
    names: dict[str, Path] = {}
    for package in packages:
        folder = root / FOLDERS.get(package, package)
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, with whether it runs at import time (not in a function nor TYPE_CHECKING)."""

    def walk(node: ast.AST, module_level: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, module_level
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), module_level)
            else:
                yield from walk(child, module_level)

    yield from walk(tree, True)


def _resolve(
    importer: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]
) -> list[str]:
    """The modules an import statement loads, most specific first: ``from a.b import c`` is ``a.b.c`` when
    that is a module of the tree, otherwise ``a.b`` (``c`` is a name defined there)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    targets = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}" if base else alias.name
        targets.append(candidate if candidate in known else base)
    return targets


def imports(root: Path, packages: tuple[str, ...] = LAYERS) -> list[Import]:
    names = module_names(root, packages)
    known = set(names)
    found: list[Import] = []
    for module, path in names.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, module_level in _import_nodes(tree):
            for target in _resolve(module, is_package, node, known):
                found.append(Import(module, target, node.lineno, module_level))
    return found


def layer_violations(root: Path, layers: tuple[str, ...] = LAYERS) -> list[str]:
    """One line per import of a higher layer from a lower one (module level or inside a function)."""
    rank = {name: i for i, name in enumerate(layers)}
    problems = []
    for imp in imports(root, layers):
        importer_rank = rank[imp.importer.split(".")[0]]
        imported_rank = rank.get(imp.imported.split(".")[0])
        if imported_rank is not None and imported_rank > importer_rank:
            where = "module level" if imp.module_level else "inside a function"
            problems.append(
                f"{imp.importer} (line {imp.line}, {where}) imports {imp.imported}: "
                f"{layers[importer_rank]} may not import {layers[imported_rank]} "
                f"(layers, lowest first: {' <- '.join(layers)})"
            )
    return problems


#: Inside ``lightning_plugin``: which folders each folder may import (``top`` = the modules directly in
#: ``lightning_plugin/``; each folder may import itself). ``__init__`` and the ``pytorch_lightning`` support module
#: are the public face and register the strategies, so they are exempt; the old paths forward lazily.
PLUGIN_FOLDERS: dict[str, frozenset[str]] = {
    "cpu": frozenset({"top"}),
    "blocks": frozenset({"top"}),
    "kernel_choice": frozenset({"top", "blocks", "cpu"}),
    "compile": frozenset({"top", "blocks", "cpu", "kernel_choice"}),
    "callbacks": frozenset({"top", "blocks", "cpu", "compile", "kernel_choice"}),
    "strategies": frozenset({"top", "blocks", "cpu", "compile", "kernel_choice", "callbacks"}),
    "top": frozenset({"top"}),
}
_PLUGIN_FACE = {"lightning_plugin", "lightning_plugin.pytorch_lightning_support"}


def plugin_folder(module: str) -> str | None:
    """The folder of ``lightning_plugin`` that holds ``module`` (``top`` for its own modules), else None."""
    parts = module.split(".")
    if parts[0] != "lightning_plugin" or module in _PLUGIN_FACE:
        return None
    return parts[1] if len(parts) >= 2 and parts[1] in PLUGIN_FOLDERS and parts[1] != "top" else "top"


def folder_violations(root: Path) -> list[str]:
    """One line per import, inside ``lightning_plugin``, of a folder the importer's folder may not import."""
    problems = []
    for imp in imports(root):
        src, dst = plugin_folder(imp.importer), plugin_folder(imp.imported)
        if src is None or dst is None or dst == src or dst in PLUGIN_FOLDERS[src]:
            continue
        problems.append(
            f"{imp.importer} (line {imp.line}) imports {imp.imported}: lightning_plugin/{src}/ may import only "
            f"{', '.join(sorted(PLUGIN_FOLDERS[src]))} (docs/architecture.md, Layers and folders)"
        )
    return problems


def import_cycles(
    root: Path, packages: tuple[str, ...] = LAYERS, include_lazy: bool = False
) -> list[list[str]]:
    """Every cycle of module-level imports (with ``include_lazy``, of any imports) between modules of the tree,
    as its strongly connected component (sorted names), found with Tarjan's algorithm."""
    known = set(module_names(root, packages))
    graph: dict[str, set[str]] = {name: set() for name in known}
    for imp in imports(root, packages):
        if (imp.module_level or include_lazy) and imp.imported in known and imp.imported != imp.importer:
            graph[imp.importer].add(imp.imported)

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(components)
