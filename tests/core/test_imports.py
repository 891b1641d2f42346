"""The packages' import structure, read from their sources with ``ast`` (nothing is imported).

Every ``.py`` file under the four packages' source directories is walked, so modules added later are covered
without listing them. An import counts wherever it is written: at module level or inside a function (a cycle
hidden in a function still runs, only later). Relative imports are resolved against the importing module.
Imports under ``if TYPE_CHECKING:`` are left out of the graph, since they never run. Imports by name at run
time (``importlib``, entry points) are not read: that is how the core reaches the plugins and the server.

``import a.b`` and ``from a import b`` (b a submodule) are edges to ``a.b`` only: the implicit import of the
parent package ``a`` is not counted, or every package whose ``__init__`` re-exports a submodule would be a cycle.
``from a import name`` (name not a submodule) is an edge to ``a``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Collection, Iterator, Mapping
from importlib.metadata import entry_points
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2] / "packages"
SOURCES = {  # top-level package -> the directory holding it
    "pocketllm": PACKAGES / "pocketllm-core" / "src",
    "pocketllm_torch": PACKAGES / "pocketllm-torch" / "src",
    "pocketllm_cpp": PACKAGES / "pocketllm-cpp" / "src",
    "pocketllm_server": PACKAGES / "pocketllm-server" / "src",
}
CORE = "pocketllm"

Graph = Mapping[str, frozenset[str]]


def module_files(top: str, src: Path) -> dict[str, Path]:
    """Module name -> source file, for every module of package ``top`` under ``src``."""
    files = {}
    for path in sorted((src / top).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, except those that only run under TYPE_CHECKING."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from _import_nodes(ast.Module(body=child.orelse, type_ignores=[]))
        else:
            yield from _import_nodes(child)


def imported_names(module: str, path: Path, is_package: bool) -> set[str]:
    """The dotted names ``module`` imports. ``from a import b`` gives ``a.b``: whether that is a module or a
    name defined in ``a`` is known only against the set of modules (``resolve``)."""
    names = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            anchor = package[: len(package) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def resolve(name: str, modules: Collection[str]) -> str:
    """The module an imported dotted name runs: itself, else the module it was taken from (``a`` for ``a.x``)."""
    return name if name in modules or "." not in name else name.rsplit(".", 1)[0]


def import_graph(sources: Mapping[str, Path]) -> tuple[dict[str, frozenset[str]], dict[str, set[str]]]:
    """The edges between the given packages' modules, and every dotted name each module imports."""
    files = {name: path for top, src in sources.items() for name, path in module_files(top, src).items()}
    imports = {name: imported_names(name, path, path.name == "__init__.py") for name, path in files.items()}
    graph = {name: frozenset(m for m in (resolve(t, files) for t in targets) if m in files)
             for name, targets in imports.items()}
    return graph, imports


def cycles(graph: Graph) -> list[list[str]]:
    """The modules of each import cycle: every strongly connected component of more than one module, or of one
    module that imports itself (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
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
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                connect(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(components)


def cycle_through(component: list[str], graph: Graph) -> list[str]:
    """A shortest cycle from the component's first module back to itself, staying inside the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, ())):
                if target == start:
                    return [*paths[node], start]
                if target in members and target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def test_cycles_finds_a_cycle_in_a_synthetic_graph() -> None:
    graph = {"a": frozenset({"b"}), "b": frozenset({"c", "d"}), "c": frozenset({"a"}), "d": frozenset(),
             "e": frozenset({"e"}), "f": frozenset({"a"})}
    assert cycles(graph) == [["a", "b", "c"], ["e"]]
    assert cycle_through(["a", "b", "c"], graph) == ["a", "b", "c", "a"]
    assert cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


def test_import_graph_reads_relative_function_local_and_type_checking_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.sub import leaf\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import other\n"
        "def f():\n    from .. import other\n")
    (package / "other.py").write_text("import pkg.sub.leaf\nfrom pkg import thing\n")
    graph, _ = import_graph({"pkg": tmp_path})
    assert graph["pkg.sub.leaf"] == {"pkg.other"}
    assert graph["pkg.other"] == {"pkg.sub.leaf", "pkg"}
    assert graph["pkg"] == {"pkg.sub.leaf"}
    assert cycles(graph) == [["pkg", "pkg.other", "pkg.sub.leaf"]]


def test_no_import_cycles() -> None:
    graph, _ = import_graph(SOURCES)
    found = cycles(graph)
    assert not found, "import cycles (each: one path round it, then all the modules tied in it):\n" + "\n".join(
        f"{' -> '.join(cycle_through(component, graph))}  [{', '.join(component)}]" for component in found)


def _backends_and_server() -> set[str]:
    """The top-level packages the core must not import: torch's, cpp's and the server's, and those of every
    installed ``pocketllm.backends`` entry point (the test fixtures' too)."""
    plugins = {entry.module.split(".")[0] for entry in entry_points(group="pocketllm.backends")}
    return (set(SOURCES) - {CORE}) | plugins


def test_the_core_imports_no_backend_nor_the_server() -> None:
    _, imports = import_graph({CORE: SOURCES[CORE]})
    forbidden = _backends_and_server()
    assert {"pocketllm_torch", "pocketllm_cpp", "pocketllm_server", "pocketllm_echo"} <= forbidden
    reaching = sorted(f"{module} imports {name}" for module, names in imports.items() for name in names
                      if name.split(".")[0] in forbidden)
    assert not reaching, "the core reaches up (it may name a backend only in a string):\n" + "\n".join(reaching)


@pytest.mark.parametrize("top", sorted(SOURCES))
def test_every_package_is_walked(top: str) -> None:
    assert f"{top}" in module_files(top, SOURCES[top])
