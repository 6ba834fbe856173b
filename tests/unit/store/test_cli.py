"""The store CLI on real local tiers: ls, verify (finds corruption), promote, gc."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from typing import Any

import torch

from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.store.catalog import check_step
from slurmkit.store.cli import main
from slurmkit.store.tier import make_tier


def _make(tmp_path: Any) -> str:
    st = CheckpointStore.from_config(StoreConfig(nvme_uri=f"{tmp_path}/nvme"), rank=0,
                                     world_size=1, node="n0", env={})
    for s in (1, 2, 3):
        st.save(s, {"w": torch.full((1000,), float(s))})
        st.wait()
    st.close()
    return f"{tmp_path}/nvme/n0"


def test_ls_and_verify_report_corruption(tmp_path: Any, capsys: Any) -> None:
    root = _make(tmp_path)
    shard = sorted(glob.glob(f"{root}/step_0000000002/__0_*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 10)
        f.write(b"X")
    assert main(["ls", root], env={}) == 0
    assert main(["verify", root], env={}) == 1
    out = capsys.readouterr().out
    assert "checksum mismatch" in out and "verified" in out


def test_promote_and_gc(tmp_path: Any, capsys: Any) -> None:
    root = _make(tmp_path)
    dest = f"{tmp_path}/shared"
    assert main(["promote", root, dest], env={}) == 0
    assert check_step(make_tier("d", dest, {}), 3, deep=True).ok  # the newest verified step
    assert main(["gc", root, "--keep", "1"], env={}) == 0
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_0000000003"]


def test_module_entry_point_runs(tmp_path: Any) -> None:
    root = _make(tmp_path)
    r = subprocess.run([sys.executable, "-m", "slurmkit.store", "ls", root],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "step" in r.stdout and "verified" in r.stdout
