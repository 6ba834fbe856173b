"""Ledger event names are written once (slurmkit/ledger/names.py), issue 35.

A misspelt event name fails nowhere at run time in a reader (``e.get("event") == "failrue"``
matches nothing, and the figure derived from it is silently zero) and only at append time in a
writer, on the path that writes it, which may be a rare one. So, read from the source with ast
(nothing of slurmkit is run):

- names.ALL is exactly the schema's events (slurmkit/ledger/events.py), one constant per name;
- every literal event name passed to a ledger's append anywhere in slurmkit/ and testkit/ (the
  writers may keep their literals) is one of them;
- no reader compares an event with a string literal: it compares with a constant, which a typo
  turns into an ImportError (and a mypy error), not a silent mismatch.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import slurmkit
from slurmkit.ledger import names
from slurmkit.ledger.events import EVENTS

ROOT = Path(slurmkit.__file__).resolve().parent.parent  # the repository
SCANNED = ("slurmkit", "testkit")


@functools.cache  # one parse for the whole file (the tests only read the trees)
def _sources() -> list[tuple[str, ast.Module]]:
    out = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                text = path.read_text(encoding="utf-8")
                out.append((path.relative_to(ROOT).as_posix(), ast.parse(text, filename=str(path))))
    return out


def _is_event_expr(node: ast.AST) -> bool:
    """``x.get("event")`` or ``x["event"]``: the name of a record read back."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "event"):
        return True
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "event"


def _str_literals(node: ast.AST) -> list[ast.Constant]:
    """``node`` if it is a string literal, or the string literals of a tuple/list/set of them."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _is_ledger_append(call: ast.Call, wrappers: set[str]) -> bool:
    """A call of a ledger's (or a spool's) append, or of a function that hands its first
    argument to one (Trainer._event): ``self.ledger.append("end", ...)``, ``append(...)`` where
    a ledger's append was passed in, ``Ledger(path, source="cancel").append(...)``."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id == "append" or func.id in wrappers
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr in wrappers:
        return True
    if func.attr != "append":
        return False
    receiver = ast.unparse(func.value).lower()
    return "ledger" in receiver or "spool" in receiver


def _wrappers(sources: list[tuple[str, ast.Module]]) -> set[str]:
    """Functions whose first parameter (after self) is the event name they append."""
    out: set[str] = set()
    for _, tree in sources:
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = [a.arg for a in fn.args.args if a.arg not in ("self", "cls")]
            if not params:
                continue
            for call in ast.walk(fn):
                if (isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Name)
                        and call.args[0].id == params[0] and _is_ledger_append(call, set())):
                    out.add(fn.name)
    return out


def literal_appends(sources: list[tuple[str, ast.Module]]) -> list[tuple[str, str]]:
    """(file:line, name) of every string literal passed as the event of a ledger append."""
    wrappers = _wrappers(sources)
    out = []
    for rel, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and _is_ledger_append(node, wrappers):
                out += [(f"{rel}:{c.lineno}", str(c.value)) for c in _str_literals(node.args[0])]
    return out


def _scope_of(tree: ast.Module) -> dict[ast.AST, ast.AST]:
    """Each node's nearest enclosing function (the module for top-level code)."""
    out: dict[ast.AST, ast.AST] = {}
    stack: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    while stack:
        node, scope = stack.pop()
        out[node] = scope
        inner = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else scope
        stack += [(child, inner) for child in ast.iter_child_nodes(node)]
    return out


def literal_comparisons(sources: list[tuple[str, ast.Module]]) -> list[tuple[str, str]]:
    """(file:line, literal) of every string literal compared with an event's name: with
    ``x.get("event")``/``x["event"]``, or with a variable its function assigned from one."""
    out = []
    for rel, tree in sources:
        scope_of = _scope_of(tree)
        kinds: dict[ast.AST, set[str]] = {}  # per function: ``kind = e.get("event")``
        for node, scope in scope_of.items():
            if isinstance(node, ast.Assign) and _is_event_expr(node.value):
                kinds.setdefault(scope, set()).update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node, scope in scope_of.items():
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if any(_is_event_expr(s) or (isinstance(s, ast.Name) and s.id in kinds.get(scope, ()))
                   for s in sides):
                out += [(f"{rel}:{c.lineno}", str(c.value)) for side in sides for c in _str_literals(side)]
    return out


def test_names_are_the_schemas_events() -> None:
    constants = {k: v for k, v in vars(names).items() if k.isupper() and k != "ALL"}
    assert all(v == k.lower() for k, v in constants.items()), \
        {k: v for k, v in constants.items() if v != k.lower()}
    assert names.ALL == set(constants.values())
    assert len(constants) == len(names.ALL)  # no name twice
    assert set(EVENTS) == names.ALL, (f"in events.py only: {sorted(set(EVENTS) - names.ALL)}; "
                                      f"in names.py only: {sorted(names.ALL - set(EVENTS))}")


def test_every_literal_event_appended_is_known() -> None:
    found = literal_appends(_sources())
    # the scan itself: the writers it must see (an agent's ending, the CLI, the trainer's wrapper)
    where = {(w.split(":")[0], name) for w, name in found}
    assert {("slurmkit/supervise/endings.py", "decision"), ("slurmkit/cli/submit.py", "submitted"),
            ("slurmkit/train/trainer.py", "train_started"),
            ("testkit/chaos/driver.py", "fault_injected")} <= where, sorted(where)
    assert len(found) >= 50
    unknown = [f"{w}: {name!r}" for w, name in found if name not in names.ALL]
    assert not unknown, ("ledger events appended that slurmkit/ledger/names.py does not know "
                         "(a typo, or a new event without its constant and schema):\n" + "\n".join(unknown))


def test_readers_compare_event_names_with_the_constants() -> None:
    found = literal_comparisons(_sources())
    assert not found, ("event names compared as string literals (use slurmkit.ledger.names: "
                       "e.get(\"event\") == FAILURE):\n" + "\n".join(f"{w}: {v!r}" for w, v in found))


def test_the_scans_catch_a_typo() -> None:
    """Both scans on made-up source: a misspelt append and a literal comparison."""
    text = '''
class Agent:
    def _note(self, event, **fields):
        self.ledger.append(event, **fields)

    def run(self, events, out):
        out.append("not an event")  # a list, not a ledger
        self.ledger.append("failrue", cls="x")
        self._note("decison", action="stop")
        Ledger(path, source="cli").append("end", status="ok")
        for e in events:
            kind = e.get("event")
            if kind == "end" or e["event"] in ("failure", "decision"):
                return e

    def inject(self, fault):
        kind = fault.kind  # another function's kind: not an event
        return kind == "node_loss"
'''
    sources = [("made_up.py", ast.parse(text))]
    assert sorted(literal_appends(sources)) == [("made_up.py:10", "end"), ("made_up.py:8", "failrue"),
                                                ("made_up.py:9", "decison")]
    assert sorted(v for _, v in literal_comparisons(sources)) == ["decision", "end", "failure"]
