"""No import cycle in oxygen_ros: neither between modules nor between its packages (models, engine, node, tools,
training, bench, assets, demo_task), counting every import statement — at module level and inside functions.

The graphs are read from the source with ``ast`` (nothing is imported): an edge A → B for each ``import`` /
``from ... import`` in A that names module B of the package (``from oxygen_ros.tools import demo_data`` names the
module ``oxygen_ros.tools.demo_data``; ``from oxygen_ros.models import get_preset`` names ``oxygen_ros.models``).
Importing a submodule also runs its parents' ``__init__``; that implicit step is not an edge (a package's
``__init__`` re-exporting its modules is not a cycle). Imports under ``if TYPE_CHECKING:`` never run (they name a
type for an annotation) and are not edges either.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "oxygen_ros"
ROOT_NAME = "oxygen_ros"

# Edges allowed to close a cycle for now, each with the reason; empty when the package is acyclic.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def module_names(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Dotted module name -> source file for every ``.py`` under ``root`` (``pkg/__init__.py`` is ``pkg``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (ROOT_NAME, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of dotted ``name`` that is one of ``modules`` (None for outside modules)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` test is ``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` (function and class bodies included) except the body of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(module: str, source: str, modules: set[str], is_package: bool = False) -> set[str]:
    """The modules of ``modules`` that ``source`` (the text of ``module``) imports anywhere in its body.

    ``from X import y`` names ``X.y`` when that is a module, else ``X``; relative imports are resolved against
    ``module`` (``is_package``: ``module`` is a package's ``__init__``).
    """
    found = set()
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def module_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """module -> the package's modules it imports (module level and inside functions)."""
    files = module_names(root)
    names = set(files)
    return {name: imports_of(name, path.read_text(), names, path.name == "__init__.py") for name, path in files.items()}


def package_of(module: str) -> str:
    """The first-level package of a module: ``oxygen_ros.engine.cycle`` -> ``engine``; the root -> ``oxygen_ros``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """package -> the other packages its modules import."""
    graph: dict[str, set[str]] = {}
    for module, targets in modules.items():
        graph.setdefault(package_of(module), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(module))
    return graph


def find_cycle(graph: dict[str, set[str]], ignore: set[tuple[str, str]] = frozenset()) -> list[str] | None:
    """One cycle of ``graph`` as its node list ``[a, b, ..., a]``, or None when it is acyclic (edges in ``ignore``
    are left out). Depth-first search with white / grey / black marks."""
    state: dict[str, int] = {}     # absent: unvisited, 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if (node, nxt) in ignore:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_passes_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"a"}}, ignore={("b", "a")}) is None


def test_imports_inside_functions_and_relative_imports_are_edges():
    modules = {"oxygen_ros.tools", "oxygen_ros.tools.a", "oxygen_ros.tools.b", "oxygen_ros.training",
               "oxygen_ros.training.t"}
    source = ("import numpy\n"
              "from oxygen_ros.tools import b\n"
              "def f():\n"
              "    from oxygen_ros.training.t import g\n"
              "    from . import b as again\n"
              "if TYPE_CHECKING:\n"
              "    from oxygen_ros.training import t\n"
              "    import oxygen_ros.tools\n")
    assert imports_of("oxygen_ros.tools.a", source, modules) == {"oxygen_ros.tools.b", "oxygen_ros.training.t"}
    assert imports_of("oxygen_ros.tools.a", "if typing.TYPE_CHECKING:\n    import oxygen_ros.tools.b\n", modules) == set()
    graph = {"oxygen_ros.tools.a": {"oxygen_ros.training.t"}, "oxygen_ros.training.t": {"oxygen_ros.tools.b"}}
    assert package_graph(graph) == {"tools": {"training"}, "training": {"tools"}}
    assert find_cycle(package_graph(graph)) == ["tools", "training", "tools"]


def test_the_graph_covers_the_package():
    graph = module_graph()
    assert {"oxygen_ros.engine.cycle", "oxygen_ros.node.oxygen_node", "oxygen_ros.demo_task",
            "oxygen_ros.training.train"} <= set(graph)
    # a function-level import is seen (the data tool builds the demo robot's scene inside its replay)
    assert "oxygen_ros.tools.sim_robot" in graph["oxygen_ros.tools.demo_data"]
    assert {"models", "engine", "node", "tools", "training", "bench", "demo_task"} <= set(package_graph(graph))


@pytest.mark.parametrize("level", ["module", "package"])
def test_no_import_cycle(level):
    modules = module_graph()
    graph = modules if level == "module" else package_graph(modules)
    cycle = find_cycle(graph, KNOWN_EXCEPTIONS)
    assert cycle is None, f"{level} import cycle: {' -> '.join(cycle)}"
