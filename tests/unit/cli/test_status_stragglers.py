"""``slurmkit status`` names the nodes the ledger calls stragglers, with their figures."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from rich.console import Console

from slurmkit.cli import status
from slurmkit.ledger.ledger import LEDGER_NAME
from slurmkit.runview import stragglers_of
from tests.unit.watch_runs import FakeRun


def _status(run_dir: str) -> str:
    c = Console(file=io.StringIO(), width=200, force_terminal=False)
    assert status.main([run_dir], env={"PATH": ""}, console=c) == 0
    return c.file.getvalue()  # type: ignore[attr-defined]


def test_status_shows_a_named_straggler(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted()
    run.allocation()
    assert "stragglers" in _status(run.run_dir) and "none" in _status(run.run_dir)
    run.agent.append("straggler", node="node2", score=0.4123, generation=0, rank=3, own_s=0.25,
                     job_median_s=0.1, windows=3, step=35, sections={"data": 0.0, "compute": 0.25,
                                                                     "comm": 0.01, "ckpt": 0.0},
                     threshold=0.7, action="report")
    run.agent.flush()
    out = _status(run.run_dir)
    assert "node2 (score 0.41, step 35)" in out, out


def test_malformed_straggler_lines_are_skipped(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted()
    with open(os.path.join(run.run_dir, LEDGER_NAME), "a") as f:  # written by hand: untrusted
        for e in ({"node": 7, "score": 0.3}, {"node": "n1", "score": "low"}, {"node": "n2", "score": True}):
            f.write(json.dumps({"t": 1.0, "event": "straggler", "source": "x", **e}) + "\n")
    assert "stragglers" in _status(run.run_dir)
    assert stragglers_of([{"event": "straggler", "node": "n3", "score": 0.5, "step": 9},
                          {"event": "straggler", "node": "n3", "score": 0.4}]) == {"n3": (0.4, None)}
