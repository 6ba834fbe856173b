"""One-way layers for the control plane (issue 35): no import cycle among slurmkit's packages.

A node of the graph is a top-level package of slurmkit (``slurmkit/supervise/``) or a top-level
module (``slurmkit/layout.py``); ``slurmkit/__init__.py`` is the node ``slurmkit``. An edge A -> B
is any import, in any module of A, of any module of B: at module level, inside a function, under
``if TYPE_CHECKING:``, ``import x.y`` and ``from x import y`` alike, relative imports resolved.
A function-level import defers the cost, not the dependency, so it counts.

Read from the source with ast (nothing of slurmkit's packages is imported): a second or two.
A failure names each cycle, and every edge inside it with one importing file:line, so the next
engineer knows where to cut: move the shared fact down to the lower package or to a leaf module
(slurmkit/runtoken.py, slurmkit/gpufaults.py, slurmkit/contract.py), or pass a callback in.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import slurmkit

ROOT = Path(slurmkit.__file__).resolve().parent  # .../slurmkit
TOP = ROOT.name


@dataclass(frozen=True)
class Import:
    where: str  # "slurmkit/sweep/local.py:52"
    target: str  # the imported module, "slurmkit.layout"


# Back-edges that remain, each with the one module it may import and why it stays. An allowed
# edge is left out of the cycle check only for imports of that module; any other import across
# it counts. Each must still exist and still close a cycle (test_allowed_edges_are_still_needed):
# the list only shrinks.
ALLOWED_EDGES: dict[tuple[str, str], tuple[frozenset[str], str]] = {
    # none left: the last, config -> train (config/schema.py embeds train/config.py's sections),
    # closed a cycle only while the trainer wrote its events through supervise; the run's event
    # log is its own package now (slurmkit/ledger/, below config, train and supervise).
}

# Low packages: they import nothing of slurmkit but their own modules, slurmkit.errors,
# slurmkit.untrusted and other leaf modules (top-level modules that import only leaf modules:
# _leaves). When this test was written: store -> errors, runtoken; slurm -> errors, untrusted;
# topology -> errors; ledger (the run's event log) -> untrusted; adapters (what a third-party
# trainer's lines and folders tell, issue 36) -> errors.
LOW_PACKAGES = ("store", "slurm", "topology", "ledger", "adapters")
BASE_OF_LOW_PACKAGES = frozenset({"errors", "untrusted"})


def _module_name(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_module(parts: list[str]) -> bool:
    base = ROOT.parent.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def node_of(module: str) -> str:
    """``slurmkit.supervise.loop`` -> ``supervise``; ``slurmkit`` itself -> ``slurmkit``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(path: Path) -> list[Import]:
    """Every slurmkit module ``path`` imports, wherever the import statement is."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name[:-1]
    rel = path.relative_to(ROOT.parent).as_posix()
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        targets: list[list[str]] = []
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                module = base + (node.module.split(".") if node.module else [])
            else:
                module = (node.module or "").split(".")
            # ``from slurmkit import layout``: the module slurmkit.layout, not the package
            targets = [module + [a.name] if _is_module(module + [a.name]) else module for a in node.names]
        for target in targets:
            if target[0] == TOP:
                out.append(Import(f"{rel}:{node.lineno}", ".".join(target)))
    return out


@functools.cache  # one walk for the whole file (callers do not change what it returns)
def package_edges() -> dict[tuple[str, str], list[Import]]:
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        src = node_of(".".join(_module_name(path)))
        for imp in _imports(path):
            dst = node_of(imp.target)
            if dst != src and imp not in edges[(src, dst)]:
                edges[(src, dst)].append(imp)
    return dict(edges)


def checked_edges(edges: dict[tuple[str, str], list[Import]]) -> dict[tuple[str, str], list[Import]]:
    """``edges`` without the imports ALLOWED_EDGES allows (an edge with none left is gone)."""
    out = {}
    for edge, imports in edges.items():
        allowed = ALLOWED_EDGES.get(edge, (frozenset(), ""))[0]
        kept = [imp for imp in imports if imp.target not in allowed]
        if kept:
            out[edge] = kept
    return out


def cycles(edges: dict[tuple[str, str], list[Import]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted({n for edge in edges for n in edge}):
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_path(edges: dict[tuple[str, str], list[Import]], start: str, goal: str) -> list[str] | None:
    """The nodes of a shortest path from ``start`` to ``goal`` (both included), None if none."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in sorted(edges):
        graph[a].append(b)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in graph[v]:
            if w not in paths:
                paths[w] = [*paths[v], w]
                if w == goal:
                    return paths[w]
                queue.append(w)
    return None


def describe(component: list[str], edges: dict[tuple[str, str], list[Import]]) -> str:
    lines = [f"cycle among {', '.join(component)}:"]
    for a in component:
        for b in component:
            if (a, b) in edges:
                imp = edges[(a, b)][0]
                more = len(edges[(a, b)]) - 1
                lines.append(f"  {a} -> {b}: {imp.where} imports {imp.target}"
                             + (f" (and {more} more)" if more else ""))
    # one closed path through the component, the shortest back from its first edge
    a = component[0]
    b = next(b for b in component if (a, b) in edges)
    back = shortest_path({e: i for e, i in edges.items() if e[0] in component and e[1] in component}, b, a)
    if back:
        lines.append("  e.g. " + " -> ".join([a, *back]))
    return "\n".join(lines)


def test_the_walk_sees_the_imports_it_must() -> None:
    """The scan itself: function-level, ``from slurmkit import m`` and relative imports."""
    preflight = {i.target for i in _imports(ROOT / "health" / "preflight.py")}
    assert "slurmkit.failures.classify" in preflight  # inside Preflight.run
    agent = {i.target for i in _imports(ROOT / "launch" / "agent.py")}
    assert "slurmkit.contract" in agent and "slurmkit" not in agent  # from slurmkit import contract
    topology = {i.target for i in _imports(ROOT / "topology" / "__init__.py")}
    assert "slurmkit.topology.apply" in topology  # from .apply import ...
    edges = package_edges()
    assert ("launch", "supervise") in edges and ("supervise", "launch") not in edges


def test_no_package_cycles() -> None:
    edges = checked_edges(package_edges())
    found = cycles(edges)
    assert not found, "package import cycles (tests/unit/test_import_contract.py):\n" + "\n".join(
        describe(c, edges) for c in found)


def test_allowed_edges_are_still_needed() -> None:
    """An allowed back-edge that is gone, or that no longer closes a cycle, leaves the list."""
    edges = package_edges()
    for (a, b), (modules, reason) in ALLOWED_EDGES.items():
        assert reason
        used = {imp.target for imp in edges.get((a, b), [])} & modules
        assert used, f"{a} -> {b} no longer imports {sorted(modules)}: remove it from ALLOWED_EDGES"
        back = shortest_path(checked_edges(edges), b, a)
        assert back is not None, (f"{a} -> {b} no longer closes a cycle ({b} does not reach {a}): "
                                  "remove it from ALLOWED_EDGES")


def _leaves(edges: dict[tuple[str, str], list[Import]]) -> set[str]:
    """Top-level modules (files, not packages) that import only other leaves: errors,
    untrusted, runtoken, contract, layout, rundir, ..."""
    modules = {p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__")}
    uses: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        uses[a].add(b)
    leaves: set[str] = set()
    while True:
        more = {m for m in modules - leaves if uses[m] <= leaves}
        if not more:
            return leaves
        leaves |= more


def test_low_packages_import_only_leaves() -> None:
    edges = package_edges()
    leaves = _leaves(edges)
    assert BASE_OF_LOW_PACKAGES | {"runtoken"} <= leaves
    bad = [f"{a} -> {b}: {imp.where} imports {imp.target}"
           for (a, b), imports in sorted(edges.items()) if a in LOW_PACKAGES and b not in leaves
           for imp in imports[:1]]
    assert not bad, ("store, slurm, topology, ledger and adapters import only slurmkit.errors, "
                     "slurmkit.untrusted, their own modules and leaf modules:\n" + "\n".join(bad))


# The failure vocabulary (slurmkit/failures/: classes, classify, stacks, programs) is imported by
# launch, health, supervise, train and the chaos tests, and imports none of them: only these leaf
# modules (when this test was written: failures -> contract, gpufaults).
FAILURES_MAY_IMPORT = frozenset({"errors", "untrusted", "gpufaults", "contract"})


def test_failures_is_pure_vocabulary() -> None:
    edges = package_edges()
    assert FAILURES_MAY_IMPORT <= _leaves(edges)
    assert any(a == "failures" for a, _ in edges), "slurmkit/failures/ imports nothing: is it still there?"
    bad = [f"failures -> {b}: {imp.where} imports {imp.target}"
           for (a, b), imports in sorted(edges.items()) if a == "failures" and b not in FAILURES_MAY_IMPORT
           for imp in imports[:1]]
    assert not bad, ("slurmkit/failures imports only slurmkit.errors, untrusted, gpufaults and contract "
                     "(never launch, supervise, health, train):\n" + "\n".join(bad))


def test_the_checks_catch_a_cycle() -> None:
    """The cycle check on a made-up graph: a -> b -> c -> a and d alone."""
    made_up = {("a", "b"): [Import("slurmkit/a.py:1", "slurmkit.b")],
               ("b", "c"): [Import("slurmkit/b.py:2", "slurmkit.c")],
               ("c", "a"): [Import("slurmkit/c.py:3", "slurmkit.a.x")],
               ("a", "d"): [Import("slurmkit/a.py:4", "slurmkit.d")]}
    assert cycles(made_up) == [["a", "b", "c"]]
    text = describe(["a", "b", "c"], made_up)
    assert "c -> a: slurmkit/c.py:3 imports slurmkit.a.x" in text and "e.g. a -> b -> c -> a" in text


# The command line (slurmkit/cli/: the dispatcher and one module per verb) is the top layer: it
# imports the library, the library never imports it. Besides cli itself only slurmkit/__main__.py
# (``python -m slurmkit``) and the ``python -m slurmkit.VERB`` spellings at the root may: each of
# those is a docstring and a run of slurmkit.cli.VERB, imported by nothing.
CLI = "cli"


def _python_m_spellings() -> set[str]:
    """Top-level modules with a namesake in slurmkit/cli/: ``slurmkit/submit.py``, ..."""
    return {p.stem for p in (ROOT / CLI).glob("*.py")
            if p.stem != "__init__" and (ROOT / f"{p.stem}.py").is_file()}


def test_the_library_never_imports_the_cli() -> None:
    edges = package_edges()
    spellings = _python_m_spellings()
    assert {"submit", "status"} <= spellings, "slurmkit/submit.py and slurmkit/cli/submit.py: still there?"
    bad = [f"{a} -> cli: {imp.where} imports {imp.target}"
           for (a, b), imports in sorted(edges.items()) if b == CLI and a not in spellings | {"__main__"}
           for imp in imports[:1]]
    assert not bad, ("the library imports slurmkit.cli (move what it needs down, to a library or "
                     "leaf module):\n" + "\n".join(bad))
    for name in sorted(spellings):
        targets = {imp.target for imp in _imports(ROOT / f"{name}.py")}
        assert targets == {f"slurmkit.{CLI}.{name}"}, (f"slurmkit/{name}.py runs slurmkit.cli.{name} and "
                                                      f"imports nothing else of slurmkit: {sorted(targets)}")
    importers = [f"{imp.where} imports {imp.target}"
                 for (a, b), imports in sorted(edges.items()) if b in spellings for imp in imports]
    assert not importers, ("import the verb's own module (slurmkit.cli.VERB), not its `python -m` "
                           "spelling:\n" + "\n".join(importers))
