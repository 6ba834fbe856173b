"""Local mode on a machine without Slurm: the same submit path, the embedded local executor."""

from __future__ import annotations

import os
import sys

import pytest

from tests.integration.helpers import ALLREDUCE, parse_submitted, read_json, submit_cli

pytestmark = pytest.mark.integration


def test_local_mode_on_a_path_without_slurm(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PATH"] = os.path.dirname(sys.executable)
    res = submit_cli(["+exp=tiny", "job.name=laptop", "submit.wait=true", ALLREDUCE,
                      f"submit.run_root={tmp_path}"], env, str(tmp_path), timeout_s=300)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = parse_submitted(res.stdout)
    assert "(local)" in res.stdout
    out = read_json(os.path.join(run_dir, "allreduce.json"))
    assert out["world_size"] == 4 and out["sum"] == 6.0
