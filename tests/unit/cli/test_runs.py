"""``slurmkit runs``: runs under a run root, newest first, a sweep followed by its variants."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from rich.console import Console

from slurmkit.cli import runs
from tests.unit.watch_runs import FakeRun, run_with_one_crash


def _age(path: str, mtime: float) -> None:
    for name in ("config.yaml", "sweep.json"):
        p = os.path.join(path, name)
        if os.path.exists(p):
            os.utime(p, (mtime, mtime))


def test_runs_newest_first_with_sweep_variants(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    old = run_with_one_crash(str(root / "tiny" / "20260101-000000-aaaa"))
    done = FakeRun(str(root / "tiny" / "20260102-000000-bbbb"))
    done.submitted(job_id="900")
    done.allocation(job_id="900")
    done.start_generation()
    done.step(1, 3.0)
    done.finish(1)
    sweep = root / "tiny" / "20260103-000000-sweep"
    variants = []
    for i in range(2):
        v = FakeRun(str(sweep / str(i)))
        v.submitted(job_id=f"77_{i}")
        variants.append({"index": i, "overrides": [f"train.lr={i}"], "run_dir": v.run_dir})
    (sweep / "sweep.json").write_text(json.dumps({"kind": "sweep", "name": "tiny", "job_id": "77",
                                                  "variants": variants}))
    _age(old.run_dir, 1_000)
    _age(done.run_dir, 2_000)
    _age(str(sweep), 3_000)
    c = Console(file=io.StringIO(), width=250)
    assert runs.main(["--root", str(root)], env={"PATH": ""}, console=c) == 0
    lines = [ln for ln in c.file.getvalue().splitlines() if "runs/tiny" in ln]  # type: ignore[attr-defined]
    assert [ln.split("│")[-2].strip() for ln in lines] == [
        str(sweep), str(sweep / "0"), str(sweep / "1"), done.run_dir, old.run_dir]
    assert "77_0" in lines[1] and "77_1" in lines[2]
    assert "900" in lines[3] and "completed" in lines[3] and "1/60" in lines[3]
    assert "4242" in lines[4] and "30/60" in lines[4]
    c = Console(file=io.StringIO(), width=250)
    runs.main(["--root", str(root), "--limit", "1"], env={"PATH": ""}, console=c)
    assert done.run_dir not in c.file.getvalue()  # type: ignore[attr-defined]


def test_missing_root_is_a_clear_error(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert runs.main(["--root", str(tmp_path / "nope")], env={"PATH": ""}) == 2
    assert "Fix:" in capsys.readouterr().err
