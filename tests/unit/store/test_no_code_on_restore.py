"""Every path of slurmkit that reads a checkpoint goes through the safe reader (issue 10).

The hostile-checkpoint tests prove that ``restore_newest``, the peer fetch, deep verification
and ``store verify`` refuse crafted files. This audit keeps it so for paths added later: it
reads the package's source (no import) and fails on any call that could run code from a
checkpoint or read its index without the allowlist:

  * ``pickle``/``marshal``/``shelve`` loads anywhere, and ``torch.load`` without a literal
    ``weights_only=True``;
  * DCP's ``load``/``load_state_dict`` without ``planner=SafeLoadPlanner()`` and a storage
    reader that is a SafeReader (``MappedReader``);
  * a ``FileSystemReader`` built directly, or ``.metadata`` unpickled outside
    ``safe_reader.load_metadata``.
Each offence is reported as ``file:line: what``.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PACKAGE = os.path.join(ROOT, "slurmkit")
# the restricted unpickler (inert stand-ins, no real class) and the reader built on it
SAFE_READER = {os.path.join("slurmkit", "store", "safe_reader.py"),
               os.path.join("slurmkit", "store", "metadata_pickle.py")}
UNSAFE_MODULES = {"pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
SAFE_READERS = {"MappedReader", "SafeReader"}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain, else ''."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _call_name(node: ast.expr | None) -> str:
    return _dotted(node.func) if isinstance(node, ast.Call) else ""


class _Audit(ast.NodeVisitor):
    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.found: list[str] = []
        self.dcp_aliases = {"dcp", "torch.distributed.checkpoint"}

    def _bad(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.rel}:{getattr(node, 'lineno', 0)}: {what}")

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            # metadata_pickle needs pickle for its stand-in Unpickler subclass only
            if a.name.split(".")[0] in UNSAFE_MODULES and self.rel not in SAFE_READER:
                self._bad(node, f"imports {a.name}")
            if a.name == "torch.distributed.checkpoint" and a.asname:
                self.dcp_aliases.add(a.asname)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if mod.split(".")[0] in UNSAFE_MODULES and self.rel not in SAFE_READER:
            self._bad(node, f"imports from {mod}")
        if mod.startswith("torch.distributed.checkpoint"):
            for a in node.names:
                if a.name in ("load", "load_state_dict"):
                    self._bad(node, f"imports DCP's {a.name} by name (call it as dcp.{a.name} "
                                    "so this audit sees its planner)")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func)
        head, _, last = name.rpartition(".")
        if head.split(".")[0] in UNSAFE_MODULES and last.startswith("load"):
            self._bad(node, f"calls {name}")
        elif name == "torch.load":
            wo = _kw(node, "weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                self._bad(node, "torch.load without weights_only=True")
        elif head in self.dcp_aliases and last in ("load", "load_state_dict"):
            planner, reader = _kw(node, "planner"), _kw(node, "storage_reader")
            if _call_name(planner) != "SafeLoadPlanner":
                self._bad(node, f"{name} without planner=SafeLoadPlanner()")
            if _call_name(reader) not in SAFE_READERS:
                self._bad(node, f"{name} without a SafeReader storage_reader")
        elif last == "FileSystemReader" and self.rel not in SAFE_READER:
            self._bad(node, "builds DCP's FileSystemReader (its read_metadata is plain pickle)")
        elif last == "Unpickler" and self.rel not in SAFE_READER:
            self._bad(node, "builds an Unpickler")
        self.generic_visit(node)


def _sources() -> Iterator[tuple[str, str]]:
    for dirpath, _dirs, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, ROOT), path


def audit(rel: str, text: str) -> list[str]:
    a = _Audit(rel)
    a.visit(ast.parse(text, filename=rel))
    return a.found


def test_no_path_of_the_package_can_run_code_from_a_checkpoint() -> None:
    found: list[str] = []
    count = 0
    for rel, path in _sources():
        with open(path, encoding="utf-8") as f:
            found += audit(rel, f.read())
        count += 1
    assert count > 100, count  # the walk saw the package
    assert not found, "\n".join(found)


def test_the_restore_paths_the_audit_relies_on_exist() -> None:
    """The safe calls are where the audit expects them (else it would pass on nothing)."""
    with open(os.path.join(PACKAGE, "store", "restore.py"), encoding="utf-8") as f:
        restore = f.read()
    assert "planner=SafeLoadPlanner()" in restore and "storage_reader=MappedReader(" in restore


@pytest.mark.parametrize("source, what", [
    ("import pickle\npickle.loads(b'')\n", "imports pickle"),
    ("import torch\ntorch.load('x')\n", "torch.load without weights_only=True"),
    ("import torch\ntorch.load('x', weights_only=False)\n", "torch.load without weights_only"),
    ("import torch.distributed.checkpoint as dcp\ndcp.load({}, checkpoint_id='d')\n",
     "without planner=SafeLoadPlanner()"),
    ("import torch.distributed.checkpoint as ck\n"
     "ck.load({}, storage_reader=FileSystemReader('d'), planner=SafeLoadPlanner())\n",
     "without a SafeReader storage_reader"),
    ("from torch.distributed.checkpoint import load\n", "imports DCP's load by name"),
    ("from torch.distributed.checkpoint import FileSystemReader\n"
     "FileSystemReader('d').read_metadata()\n", "builds DCP's FileSystemReader"),
    ("import io, _pickle\n_pickle.Unpickler(io.BytesIO(b''))\n", "builds an Unpickler"),
    ("x = pickle.load(f)\n", "calls pickle.load"),
])
def test_the_audit_finds_each_unsafe_shape(source: str, what: str) -> None:
    found = audit("slurmkit/x.py", source)
    assert any(what in f for f in found), found


def test_the_audit_accepts_the_safe_shapes() -> None:
    ok = ("import torch\nimport torch.distributed.checkpoint as dcp\n"
          "torch.load('x', weights_only=True)\n"
          "dcp.load({}, storage_reader=MappedReader(p), planner=SafeLoadPlanner(), no_dist=True)\n")
    assert audit("slurmkit/x.py", ok) == []
