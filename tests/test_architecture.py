"""The import graph obeys the architecture (README "Layout", ../shared/DESIGN.md), read with ``ast``.

Nothing is imported: every ``.py`` under ``tltsim/``, ``tltrun/``, ``kernels/`` and ``analysis/``
is parsed, and every import statement (module level, inside functions, under ``TYPE_CHECKING``)
becomes an edge, because a lazy import is still a dependency and a cycle through it still means
a module imports its own caller. Rules checked:

* zero import cycles;
* ``tltsim`` never imports torch, triton or ``tltrun``; ``kernels`` never imports ``tltrun``;
* ``tltsim.policy`` imports only the standard library (and itself);
* ``tltsim.trace`` imports no simpy;
* library code (everything outside ``tltsim.cli`` and ``tltrun.cli``) imports neither the CLI
  packages nor argparse: libraries raise ``tltsim.errors`` types, the CLI prints them.

The subprocess test in ``test_policy.py`` checks the same ``tltsim.policy`` rule at run time.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tltsim", "tltrun", "kernels", "analysis")
CLI_PACKAGES = ("tltsim.cli", "tltrun.cli")
# ``python -m tltrun`` (torchrun -m tltrun train ...): a package's __main__ is a command-line
# entry point by definition, so it may import its CLI package (it holds nothing else)
CLI_ENTRY_MODULES = ("tltrun.__main__", "tltsim.__main__")


def module_name(path: Path, root: Path = ROOT) -> str:
    """``tltsim/sim/replay.py`` -> ``tltsim.sim.replay``; ``pkg/__init__.py`` -> ``pkg``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def walk_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root`` by dotted name."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            modules[module_name(path, root)] = path
    return modules


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from X import ...`` statement names (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    # A package's own module is its __init__, so ``from . import x`` there means the package.
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``module`` imports: project modules by full name, others by full name too
    (``numpy.linalg``); ``from pkg import mod`` names ``pkg.mod`` when that is a project module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    found.discard(module)
    return found


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> every module it imports (project and third-party)."""
    modules = walk_modules(root, packages)
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component that has one, found with
    Tarjan's algorithm (iterative: the graph's depth is not bounded by Python's stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(sorted(component))
    return [_cycle_in(graph, set(component)) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A concrete cycle through the first member of a strongly connected component (BFS back to it)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle in component {sorted(component)}")


def _top(name: str) -> str:
    return name.split(".")[0]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_cycle_finder_on_synthetic_graphs():
    acyclic = {"a": {"b", "c"}, "b": {"c", "os"}, "c": set()}
    assert find_cycles(acyclic) == []
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    cycles = find_cycles(planted)
    assert sorted(cycles) == [["a", "b", "c", "a"], ["e", "e"]]
    # Two cycles sharing a node are one component; the reported cycle is a real path.
    knot = {"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}
    (cycle,) = find_cycles(knot)
    assert cycle[0] == cycle[-1] == "a"
    assert all(v in knot[u] for u, v in zip(cycle, cycle[1:], strict=False))


def test_a_planted_cycle_through_a_lazy_import_is_found(tmp_path):
    # The walker and the finder together, on a tiny package tree on disk: a module whose
    # function imports its caller closes a cycle (as tltrun/cli <-> bench.py once did).
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "main.py").write_text("from pkg.sub import lib\n")
    (pkg / "sub" / "lib.py").write_text("def f():\n    from ..main import g\n")
    (pkg / "other.py").write_text("import pkg.sub.lib\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert find_cycles(graph) == [["pkg.main", "pkg.sub.lib", "pkg.main"]]
    (pkg / "sub" / "lib.py").write_text("def f():\n    return 1\n")
    assert find_cycles(import_graph(tmp_path, ("pkg",))) == []


def test_import_resolution(tmp_path):
    known = {"pkg", "pkg.sub", "pkg.sub.mod", "pkg.other"}
    source = (
        "import numpy.linalg\n"
        "from . import mod\n"
        "from .mod import thing\n"
        "from .. import other\n"
        "from pkg.sub import CONST\n"
        "def f():\n"
        "    import argparse\n"
    )
    path = tmp_path / "helper.py"
    path.write_text(source)
    found = imports_of("pkg.sub.helper", path, known)
    assert found == {"numpy.linalg", "pkg.sub.mod", "pkg.other", "pkg.sub", "argparse"}
    init = tmp_path / "__init__.py"
    init.write_text("from . import mod\nfrom .missing import x\n")
    assert imports_of("pkg.sub", init, known) == {"pkg.sub.mod", "pkg.sub.missing"}


def test_graph_sees_the_whole_tree(graph):
    # Guards the walker itself: a walker that found nothing would pass every rule below.
    assert len(graph) > 60
    assert "tltsim.sim.simulator" in graph["tltsim.sim.replay"]
    assert any(_within(m, "tltsim.policy") for m in graph["tltrun.rollout.engine"])


def test_no_import_cycles(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_tltsim_never_imports_torch_triton_or_tltrun(graph):
    bad = {
        (module, target)
        for module, targets in graph.items()
        if _within(module, "tltsim")
        for target in targets
        if _top(target) in {"torch", "triton", "tltrun"}
    }
    assert not bad, sorted(bad)


def test_kernels_never_import_tltrun(graph):
    bad = {
        (module, target)
        for module, targets in graph.items()
        if _within(module, "kernels")
        for target in targets
        if _top(target) == "tltrun"
    }
    assert not bad, sorted(bad)


def test_policy_imports_only_the_standard_library(graph):
    bad = {
        (module, target)
        for module, targets in graph.items()
        if _within(module, "tltsim.policy")
        for target in targets
        if not _within(target, "tltsim.policy") and _top(target) not in sys.stdlib_module_names
    }
    assert not bad, sorted(bad)


def test_trace_imports_no_simpy(graph):
    bad = {
        (module, target)
        for module, targets in graph.items()
        if _within(module, "tltsim.trace")
        for target in targets
        if _top(target) == "simpy"
    }
    assert not bad, sorted(bad)


def test_libraries_import_neither_cli_nor_argparse(graph):
    bad = {
        (module, target)
        for module, targets in graph.items()
        if not any(_within(module, cli) for cli in CLI_PACKAGES) and module not in CLI_ENTRY_MODULES
        for target in targets
        if _top(target) == "argparse" or any(_within(target, cli) for cli in CLI_PACKAGES)
    }
    assert not bad, sorted(bad)
