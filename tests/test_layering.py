"""The package's layering (DESIGN.md, "One protocol-neutral output path"; issue 27), read
from the source with ``ast`` (nothing is imported, so the test sees every file, also the
ones whose dependencies are not installed, in a few seconds).

What counts as "module A imports module B":
- every ``import`` / ``from ... import`` statement anywhere in A: at module level, inside
  functions and methods (lazy imports run too, just later), inside ``try`` blocks;
  relative imports resolved; ``from pkg import name`` is an import of ``pkg.name`` when
  that is a module, else of ``pkg``. ``importlib.import_module("llmserve....")`` with a
  literal (or an f-string's literal head, such as the bench CLI's
  ``f"llmserve.benchmarks.{name}"``) counts as an import of that module;
- not imports under ``if TYPE_CHECKING:`` (they never run: annotations only);
- not imports under ``if __name__ == "__main__":`` (run as a script the file is the
  ``__main__`` module, not the one others import, so it closes no circle);
- package ``__init__`` files are modules like any other, and importing ``a.b.c`` also runs
  ``a/__init__.py`` and ``a/b/__init__.py``: so an import of ``a.b.c`` is also an import of
  each package above it, except the packages the importer itself is inside (those are
  already being imported when it runs). A package ``__init__`` re-exporting its own
  submodules is therefore fine; a submodule importing its own package's ``__init__``
  (``from llmserve.tool_parsers import X`` inside ``llmserve/tool_parsers/``) is an
  ordinary edge and closes a circle when that ``__init__`` imports the submodule.

The rules checked:
1. nothing under the engine and parser floors (``engine/``, ``core/``, ``worker/``,
   ``models/``, ``tool_parsers/``, ``reasoning/``, ``structured_output/``, and the low
   floor ``parsing_types.py``) imports ``llmserve.entrypoints``, directly or through any
   chain of other modules (the chain is reported);
2. no import circle between modules of ``llmserve/`` (each strongly connected component
   of the import graph is reported with one circle through it);
3. no runtime module (anything of ``llmserve/`` outside ``llmserve/benchmarks/``) imports a
   benchmark (``llmserve.benchmarks`` or the top-level ``benchmarks/`` scripts), except the
   bench CLI's dispatch (``llmserve/entrypoints/cli.py``);
4. the multi-API-server launcher reaches no executor or worker code through module-level
   imports or its own lazy ones (the engine processes it starts load those).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llmserve"

LOW_FLOORS = ("engine", "core", "worker", "models", "tool_parsers", "reasoning", "structured_output",
              "parsing_types")
BENCH_DISPATCH = {"llmserve.entrypoints.cli"}
LAUNCHER = "llmserve.entrypoints.openai.multi_api_server"


# ----------------------------------------------------------------------------- the graph
def _module_files(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package __init__) for every .py under llmserve/."""
    mods = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _skipped_blocks(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` and ``if __name__ == "__main__":``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        test = ast.unparse(node.test)
        if "TYPE_CHECKING" in test or test.replace("'", '"') == '__name__ == "__main__"':
            for stmt in node.body:
                skipped.update(id(n) for n in ast.walk(stmt))
    return skipped


def _function_nodes(tree: ast.AST) -> set[int]:
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner.update(id(n) for n in ast.walk(node) if n is not node)
    return inner


def _literal_head(arg: ast.expr) -> str | None:
    """The module named by ``import_module``'s argument: a literal, or an f-string's literal
    head up to its last dot (``f"llmserve.benchmarks.{x}"`` -> ``llmserve.benchmarks``)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value)
        return head.rsplit(".", 1)[0] if "." in head else None
    return None


def _imported_names(module: str, is_pkg: bool, node: ast.AST, known: dict) -> list[str]:
    """The dotted names one import statement (or import_module call) imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            pkg = ".".join(base + ([node.module] if node.module else []))
        else:
            pkg = node.module or ""
        return [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in known else pkg for a in node.names]
    head = _literal_head(node.args[0]) if node.args else None  # an import_module call
    return [head] if head else []


def _is_import_module(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id == "import_module")


def _target(name: str, known: dict) -> str | None:
    """The llmserve module a dotted name lands in (its longest known prefix)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def build_graph(root: Path = ROOT) -> tuple[dict[str, dict[str, tuple[int, bool]]], dict[str, set[str]]]:
    """(llmserve module -> {imported llmserve module: (line, lazy)}, module -> the names of
    benchmark modules it imports: ``llmserve.benchmarks...`` or top-level ``benchmarks...``)."""
    known = _module_files(root)
    graph: dict[str, dict[str, tuple[int, bool]]] = {}
    bench: dict[str, set[str]] = {}
    for module, (path, is_pkg) in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        skipped, lazy = _skipped_blocks(tree), _function_nodes(tree)
        own_parents = set(_parents(module))
        edges: dict[str, tuple[int, bool]] = {}
        for node in ast.walk(tree):
            if id(node) in skipped or not (isinstance(node, (ast.Import, ast.ImportFrom)) or _is_import_module(node)):
                continue
            for name in _imported_names(module, is_pkg, node, known):
                if name == "benchmarks" or name.startswith(("benchmarks.", "llmserve.benchmarks")):
                    bench.setdefault(module, set()).add(name)
                target = _target(name, known) if name.startswith(PACKAGE + ".") else None
                if target is None:
                    continue
                for t in [target, *_parents(target)]:
                    if t != module and t not in own_parents and t != PACKAGE:
                        edges.setdefault(t, (node.lineno, id(node) in lazy))
        graph[module] = edges
    return graph, bench


@pytest.fixture(scope="module")
def walked():
    return build_graph()


@pytest.fixture(scope="module")
def graph(walked):
    return walked[0]


# ----------------------------------------------------------------------------- helpers
def _path(graph: dict, start: str, goal) -> list[str] | None:
    """A shortest import chain from ``start`` to a module ``goal(m)`` accepts (BFS)."""
    prev = {start: None}
    queue = [start]
    for m in queue:
        if goal(m) and m != start:
            chain = [m]
            while prev[chain[-1]] is not None:
                chain.append(prev[chain[-1]])
            return chain[::-1]
        for t in graph.get(m, {}):
            if t not in prev:
                prev[t] = m
                queue.append(t)
    return None


def _describe(graph: dict, chain: list[str]) -> str:
    """``a -> b (file:line[, in a function]) -> ...``, one step a line."""
    files = _module_files(ROOT)
    steps = [chain[0]]
    for a, b in zip(chain, chain[1:]):
        line, lazy = graph[a][b]
        where = files[a][0].relative_to(ROOT) if a in files else a
        steps.append(f"-> {b}  ({where}:{line}{', in a function' if lazy else ''})")
    return "\n    ".join(steps)


def strongly_connected(graph: dict) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


# ----------------------------------------------------------------------------- the rules
def _is_low_floor(module: str) -> bool:
    rest = module[len(PACKAGE) + 1:]
    return rest.split(".")[0] in LOW_FLOORS


def test_engine_and_parsers_import_nothing_of_entrypoints(graph):
    bad = []
    for module in sorted(graph):
        if _is_low_floor(module):
            chain = _path(graph, module, lambda m: m.startswith("llmserve.entrypoints"))
            if chain:
                bad.append(_describe(graph, chain))
    assert not bad, "low-floor modules reach llmserve.entrypoints:\n  " + "\n  ".join(bad)


def test_no_import_circles(graph):
    circles = []
    for comp in strongly_connected(graph):
        members = set(comp)
        sub = {m: {t: v for t, v in graph[m].items() if t in members} for m in comp}
        start = comp[0]
        back = _path(sub, start, lambda m: start in sub[m])
        chain = (back or [start]) + [start]
        circles.append(f"{len(comp)} modules {comp}:\n    " + _describe(graph, chain))
    assert not circles, "import circles:\n  " + "\n  ".join(circles)


def test_no_runtime_module_imports_a_benchmark(walked):
    bench = walked[1]
    bad = {m: sorted(names) for m, names in bench.items()
           if not m.startswith("llmserve.benchmarks") and m not in BENCH_DISPATCH}
    assert not bad, f"runtime modules importing benchmarks: {bad}"
    assert "llmserve.entrypoints.cli" in bench  # the dispatch is seen, so the walk sees import_module


def test_multi_api_server_launcher_imports_no_executor_or_worker(graph):
    # Module-level imports everywhere, plus the launcher's own lazy ones: what its process loads.
    eager = {m: {t: v for t, v in edges.items() if not v[1] or m == LAUNCHER} for m, edges in graph.items()}
    chain = _path(eager, LAUNCHER, lambda m: m.startswith(("llmserve.executor", "llmserve.worker")))
    assert chain is None, "the launcher loads executor/worker code:\n    " + _describe(graph, chain)


# ----------------------------------------------------------------------------- the walker itself
def test_the_walker_sees_lazy_relative_and_typing_imports(tmp_path):
    """The rules above can fail: a planted circle through a lazy relative import and a
    planted engine -> entrypoints import are found; TYPE_CHECKING and __main__ imports are not."""
    pkg = tmp_path / "llmserve"
    for d in ("engine", "entrypoints", "tool_parsers"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "core.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llmserve.entrypoints import api\n"
        "def f():\n    from ..tool_parsers import hermes\n")
    (pkg / "tool_parsers" / "__init__.py").write_text("from llmserve.tool_parsers.hermes import X\n")
    (pkg / "tool_parsers" / "hermes.py").write_text("import llmserve.engine.core\nX = 1\n")
    (pkg / "entrypoints" / "api.py").write_text(
        "import importlib\nm = importlib.import_module(f'llmserve.benchmarks.{1}')\n"
        "if __name__ == '__main__':\n    import llmserve.engine.core\n")
    (pkg / "engine" / "bad.py").write_text("from llmserve.entrypoints.api import m\n")
    g, bench = build_graph(tmp_path)
    assert "llmserve.entrypoints.api" not in g["llmserve.engine.core"]
    assert g["llmserve.engine.core"]["llmserve.tool_parsers.hermes"] == (5, True)
    assert "llmserve.tool_parsers" in g["llmserve.engine.core"]  # the package __init__ runs too
    assert g["llmserve.entrypoints.api"] == {}
    assert bench == {"llmserve.entrypoints.api": {"llmserve.benchmarks"}}
    comps = strongly_connected(g)
    assert comps == [["llmserve.engine.core", "llmserve.tool_parsers", "llmserve.tool_parsers.hermes"]]
    assert _path(g, "llmserve.engine.bad", lambda m: m.startswith("llmserve.entrypoints")) == [
        "llmserve.engine.bad", "llmserve.entrypoints.api"]
