"""Imports point down: the layers of docs/development.md, read from the
package's source with `ast` (nothing is imported, so it runs in a moment).

What counts (docs/development.md, "Layers: imports point down"): every
import that can run, at module level or inside a function; not the ones
under `if TYPE_CHECKING:`. An import of `keras_mgpu.a.b` is an edge to
that module only, not to the parent packages' `__init__` it also runs.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "keras_mgpu"
DOC = REPO / "docs" / "development.md"

# Known imports still to be removed: (importer, imported). An entry whose
# import is gone fails `test_known_until_merge_is_current`, so the list only
# shrinks.
KNOWN_UNTIL_MERGE: set = set()  # empty: no upward import, no circle left

# The top layers may use these private modules of lower layers.
PUBLIC_EXCEPTIONS = {"keras_mgpu._flavour"}
# From this layer up, imports of lower layers go through the public API.
PUBLIC_API_FROM_LAYER_OF = "_components"


@functools.cache
def layer_table() -> dict[str, int]:
    """Unit (first part of a module's name under keras_mgpu/, or
    `keras_mgpu` for the package's `__init__`) -> its layer, read from the
    table of docs/development.md."""
    text = DOC.read_text(encoding="utf-8")
    marker = "tests/test_layering.py reads this table"
    rows = text[text.index(marker) :].split("\n\n", 2)[1].splitlines()
    layers: dict[str, int] = {}
    for row in rows[2:]:  # after the header and its rule
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        for unit in re.findall(r"`([^`]+)`", cells[1]):
            assert unit not in layers, f"{unit} is in two layers of {DOC}"
            layers[unit] = int(cells[0])
    return layers


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def module_names(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
        node.test
    )


def imports_of(
    module: str, path: pathlib.Path, modules: dict, package: str
) -> list[tuple[str, str, int, tuple[str, ...]]]:
    """`(imported module, how, line, names)` for every import of the
    package in `module` that can run; `how` is "module" or "function"."""
    is_package = path.name == "__init__.py"
    found = []

    def target(base: str, name: str) -> str:
        # `from a import b`: the module a.b where it is one, else a.
        return f"{base}.{name}" if f"{base}.{name}" in modules else base

    def visit(node: ast.AST, how: str) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                for other in child.orelse:
                    visit(ast.Module(body=[other], type_ignores=[]), how)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == package:
                        found.append((alias.name, how, child.lineno, ()))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    here = module.split(".")
                    here = here if is_package else here[:-1]
                    here = here[: len(here) - child.level + 1]
                    base = ".".join(here + [child.module or ""]).strip(".")
                else:
                    base = child.module or ""
                if base.split(".")[0] != package:
                    continue
                for alias in child.names:
                    found.append(
                        (
                            target(base, alias.name),
                            how,
                            child.lineno,
                            (alias.name,),
                        )
                    )
            inner = isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            visit(child, "function" if inner else how)

    visit(ast.parse(path.read_text(encoding="utf-8")), "module")
    return found


@functools.cache
def import_graph(
    root: pathlib.Path = REPO, package: str = PACKAGE
) -> tuple[tuple[str, str, str, int, tuple[str, ...]], ...]:
    """`(importer, imported, how, line, names)` for the whole package."""
    modules = module_names(root, package)
    return tuple(
        (module, *found)
        for module, path in modules.items()
        for found in imports_of(module, path, modules, package)
    )


def upward_imports(graph, layers, allowed=frozenset()) -> list[str]:
    wrong = set()  # `from a import b, c` is one import
    for importer, imported, how, line, _ in graph:
        if (importer, imported) in allowed:
            continue
        here, there = unit_of(importer), unit_of(imported)
        if here != there and layers[there] >= layers[here]:
            wrong.add(
                f"{importer}:{line} imports {imported} ({how} level): "
                f"layer {layers[here]} ({here}) may not import layer "
                f"{layers[there]} ({there})"
            )
    return sorted(wrong)


def circles(graph, allowed=frozenset()) -> list[list[str]]:
    """The import circles (strongly connected components of more than one
    module), each in a fixed order."""
    edges: dict[str, set] = {}
    for importer, imported, *_ in graph:
        if importer != imported and (importer, imported) not in allowed:
            edges.setdefault(importer, set()).add(imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def private_imports_of_the_top(graph, layers) -> list[str]:
    wrong = []
    top = layers[PUBLIC_API_FROM_LAYER_OF]
    for importer, imported, _, line, names in graph:
        here, there = unit_of(importer), unit_of(imported)
        if layers[here] < top or layers[there] >= top or here == PACKAGE:
            continue
        private_module = any(
            part.startswith("_") for part in imported.split(".")[1:]
        )
        if private_module and imported not in PUBLIC_EXCEPTIONS:
            wrong.append(f"{importer}:{line} imports {imported}")
        elif imported not in PUBLIC_EXCEPTIONS:
            wrong += [
                f"{importer}:{line} imports {imported}.{name}"
                for name in names
                if name.startswith("_")
                and not name.endswith("__")  # __version__ is public
                and not imported.endswith(f".{name}")  # a module: above
            ]
    return wrong


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    """Overrides conftest.py's: nothing here runs Keras, and clearing its
    session costs ~1 s a test."""
    yield


def test_every_module_is_in_a_layer():
    units = {unit_of(module) for module in module_names(REPO, PACKAGE)}
    layers = layer_table()
    assert sorted(units - set(layers)) == [], (
        f"add these to the table of layers in {DOC}"
    )
    assert sorted(set(layers) - units) == [], f"gone: remove them from {DOC}"


def test_imports_point_down():
    wrong = upward_imports(import_graph(), layer_table(), KNOWN_UNTIL_MERGE)
    assert wrong == [], "\n".join(wrong)


def test_no_import_circle():
    found = circles(import_graph(), KNOWN_UNTIL_MERGE)
    assert found == [], found


def test_the_command_line_and_the_demo_use_the_public_api():
    wrong = private_imports_of_the_top(import_graph(), layer_table())
    assert wrong == [], "\n".join(wrong)


def test_known_until_merge_is_current():
    edges = {(importer, imported) for importer, imported, *_ in import_graph()}
    gone = sorted(KNOWN_UNTIL_MERGE - edges)
    assert gone == [], (
        f"these imports are gone: remove them from the list {gone}"
    )


@pytest.mark.parametrize(
    "files, expected",
    [
        (  # a lazy upward import from the bottom layer
            {"backend/__init__.py": "def f():\n    from pkg import top\n"},
            ("up", "pkg.backend:2 imports pkg.top (function level)"),
        ),
        (  # a circle closed by a relative import inside a function
            {
                "top/a.py": "from pkg.top import b\n",
                "top/b.py": "def f():\n    from . import a\n",
            },
            ("circle", ["pkg.top.a", "pkg.top.b"]),
        ),
        (  # what only type checkers read is no import
            {
                "backend/__init__.py": (
                    "from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from pkg import top\n"
                )
            },
            (None, None),
        ),
    ],
)
def test_the_checks_find_what_they_look_for(tmp_path, files, expected):
    files = {"__init__.py": "", "top/__init__.py": "", **files}
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        (path.parent / "__init__.py").touch()
    graph = import_graph(tmp_path, "pkg")
    layers = {"pkg": 3, "top": 2, "backend": 1}
    up, circle = upward_imports(graph, layers), circles(graph)
    kind, what = expected
    if kind == "up":
        assert len(up) == 1 and up[0].startswith(what), up
    elif kind == "circle":
        assert circle == [what]
    else:
        assert up == [] and circle == []
