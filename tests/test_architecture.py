"""The import graph of ``src/remat``, as ``ast`` sees it: one-way layers, no cycle.

Every ``import`` and ``from ... import`` counts, at module level or inside a function or
an ``if TYPE_CHECKING`` block. ``docs/architecture.md`` draws the same layers; this test
keeps it true.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: bottom to top; a module may import its own layer and those below it, never above.
LAYERS: tuple[str, ...] = (
    "remat.core",
    "remat.models",
    "remat.measure",
    "remat.runtime",
    "remat.parallel.tensor",  # below the profiler, which records a TP model's collectives
    "remat.tensor_parallel",  # old import path, re-exports remat.parallel.tensor
    "remat.plans",
    "remat.profiling",
    "remat.verification",
    "remat.parallel",
    "remat.distributed",  # old import paths, re-exporting remat.parallel
    "remat.pipelining",
    "remat.benchmarking",
    "remat.in_script",
    "remat.integrations",
    "remat.demo",
    "remat.cli",
    "remat",  # the package itself: remat/__init__.py and remat/__main__.py
)
#: what remat.core may import besides itself (the standard library is always allowed)
CORE_THIRD_PARTY = {"numpy", "numba"}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in (SRC / "remat").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


MODULES = _modules()


def _imports(name: str) -> tuple[set[str], set[str]]:
    """(remat modules, other top-level packages) that module ``name`` imports."""
    path, package = MODULES[name]
    inner: set[str] = set()
    outer: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from remat import plans` imports the module remat.plans, and the package
            # remat too: its __init__ runs first and gives the name (import-graph tools
            # count both), so a package's own modules importing it this way close a cycle
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module
                       for a in node.names]
            if module in MODULES and MODULES[module][1]:
                targets.append(module)
        else:
            continue
        for target in targets:
            if target == "remat" or target.startswith("remat."):
                while target not in MODULES:  # an attribute of a module: the module
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    inner.add(target)
            else:
                outer.add(target.split(".")[0])
    return inner, outer


GRAPH = {name: _imports(name) for name in MODULES}


def layer(name: str) -> int:
    """The index in LAYERS of the longest layer prefix of ``name``."""
    best = [i for i, prefix in enumerate(LAYERS) if name == prefix or name.startswith(prefix + ".")]
    if name == "remat.__main__":
        return LAYERS.index("remat")
    assert best, f"{name} is in no layer: add it to LAYERS and docs/architecture.md"
    return max(best, key=lambda i: len(LAYERS[i]))


def test_every_module_is_in_a_layer() -> None:
    for name in MODULES:
        layer(name)


def test_no_import_cycle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v][0]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    assert not cycles, f"import cycles: {cycles}"


def test_imports_go_down_the_layers() -> None:
    upward = [
        f"{name} ({LAYERS[layer(name)]}) imports {target} ({LAYERS[layer(target)]})"
        for name, (inner, _) in sorted(GRAPH.items())
        for target in sorted(inner)
        if layer(target) > layer(name)
    ]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_core_imports_neither_torch_nor_the_layers_above() -> None:
    import sys

    allowed = CORE_THIRD_PARTY | set(sys.stdlib_module_names) | {"__future__"}
    bad = []
    for name, (inner, outer) in sorted(GRAPH.items()):
        if layer(name) != 0:
            continue
        bad += [f"{name} imports {t}" for t in sorted(inner) if layer(t) != 0]
        bad += [f"{name} imports {t}" for t in sorted(outer - allowed)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("mutation", ["cycle", "torch", "upward"])
def test_the_checks_fail_on_a_broken_graph(mutation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check above catches the defect it is named for (checked on a copy of the graph)."""
    broken = {name: (set(inner), set(outer)) for name, (inner, outer) in GRAPH.items()}
    if mutation == "cycle":
        broken["remat.core.errors"][0].add("remat.core.plan_format")
        check = test_no_import_cycle
    elif mutation == "torch":
        broken["remat.core.units"][1].add("torch")
        check = test_the_core_imports_neither_torch_nor_the_layers_above
    else:
        broken["remat.measure.step"][0].add("remat.profiling.profiler")
        check = test_imports_go_down_the_layers
    monkeypatch.setitem(globals(), "GRAPH", broken)
    with pytest.raises(AssertionError):
        check()


ENTRY_POINTS = ("plan", "profile", "apply", "remove", "verify", "bench", "auto")


def test_public_entry_points_are_plain_functions_and_no_module_shares_their_names() -> None:
    import importlib
    import sys
    import types

    import remat

    # importing a submodule binds it on its package: these once shadowed the functions
    for module in ("remat.core.plan_format", "remat.verification.hazards",
                   "remat.benchmarking.main_job", "remat.profiling.profiler"):
        importlib.import_module(module)
    for name in ENTRY_POINTS:
        assert f"remat.{name}" not in MODULES, f"module remat.{name} shadows remat.{name}()"
        assert type(getattr(remat, name)) is types.FunctionType, name
    swapped = [name for name, module in sys.modules.items()
               if name.startswith("remat") and type(module) is not types.ModuleType]
    assert not swapped, f"modules with their class swapped: {swapped}"


def test_no_package_exports_a_name_that_is_also_its_submodule() -> None:
    """``remat.runtime.apply`` is the function, never sometimes the module ``apply.py``."""
    clashes = []
    for name, (path, package) in sorted(MODULES.items()):
        if not package:
            continue
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ImportFrom):
                continue
            source = name if node.level == 1 and not node.module else (
                f"{name}.{node.module}" if node.level == 1 else node.module)
            if source == name:  # `from remat.models import gpt`: the submodule itself
                continue
            clashes += [f"{name}.{alias.asname or alias.name}" for alias in node.names
                        if f"{name}.{alias.asname or alias.name}" in MODULES]
    assert not clashes, f"names that are both a module and something else: {clashes}"


def test_from_a_package_import_a_module_counts_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``from remat.core.solve import dp`` runs the package's ``__init__`` to give the name,
    so a module of the package written that way closes a cycle through it; the graph counts
    the package as import-graph tools do (it once saw only ``remat.core.solve.dp``)."""
    module = tmp_path / "solvers.py"
    module.write_text("from remat.core.solve import dp\nimport remat.core.solve.flat as flat\n")
    monkeypatch.setitem(MODULES, "remat.core.solve.solvers", (module, False))
    inner, _ = _imports("remat.core.solve.solvers")
    assert inner == {"remat.core.solve", "remat.core.solve.dp", "remat.core.solve.flat"}
