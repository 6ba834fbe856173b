"""The run, not the Slurm job, names its checkpoints: a resubmitted run (a new job id, the
same run directory) resumes its own checkpoints; another run never sees them."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import yaml

from slurmkit.errors import ConfigError
from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.store.config import run_identity, store_env

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "store")


def test_the_identity_is_the_run_directory_not_the_job() -> None:
    cfg = StoreConfig(nvme_uri="/x")
    a = run_identity(cfg, {"SLURMKIT_RUN_DIR": "/runs/llm/20261201-0900-ab12",
                           "SLURM_JOB_ID": "1"})
    again = run_identity(cfg, {"SLURMKIT_RUN_DIR": "/runs/llm/20261201-0900-ab12/",
                               "SLURM_JOB_ID": "2"})
    other = run_identity(cfg, {"SLURMKIT_RUN_DIR": "/runs/other/20261201-0900-ab12"})
    assert a == again and a is not None and a.startswith("20261201-0900-ab12-")
    assert other != a  # same directory name, another run: never the same checkpoints
    assert run_identity(StoreConfig(nvme_uri="/x", run_id="pretrain-7"), {}) == "pretrain-7"
    assert run_identity(cfg, {}) is None


@pytest.mark.parametrize("bad", ["../up", "a/b", ".hidden", "x\ny", "", "a" * 129])
def test_an_unsafe_run_id_is_refused(bad: str) -> None:
    if bad:
        with pytest.raises(ConfigError, match="run_id"):
            StoreConfig(nvme_uri="/x", run_id=bad)
    with pytest.raises(ConfigError, match="SLURMKIT_RUN_ID"):
        store_env(StoreConfig(nvme_uri="/x"), {"SLURMKIT_RUN_ID": bad or "/"})


def test_no_shipped_store_config_keys_checkpoints_by_the_job_id() -> None:
    for name in os.listdir(CONF):
        with open(os.path.join(CONF, name)) as f:
            body = yaml.safe_load(f)
        for key in ("nvme_uri", "lustre_uri", "object_uri"):
            assert "SLURM_JOB_ID" not in str(body.get(key, "")), (name, key)
    with open(os.path.join(CONF, "tiered.yaml")) as f:
        assert "$SLURMKIT_RUN_ID" in yaml.safe_load(f)["lustre_uri"]


def _store(root: str, run_dir: str, job: str) -> CheckpointStore:
    cfg = StoreConfig(nvme_uri=f"{root}/nvme/$SLURMKIT_RUN_ID",
                      lustre_uri=f"{root}/lustre/$SLURMKIT_RUN_ID", write_threads=1)
    return CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0",
                                       env={"SLURMKIT_RUN_DIR": run_dir, "SLURM_JOB_ID": job})


def test_a_resubmitted_run_resumes_its_own_checkpoint(tmp_path: Any) -> None:
    run_dir = str(tmp_path / "runs" / "llm" / "20261201-0900-ab12")
    first = _store(str(tmp_path), run_dir, job="101")
    state = {"model": {"w": torch.arange(8.0)}, "step": 3}
    first.save(3, state)
    first.wait()
    first.close()
    resubmitted = _store(str(tmp_path), run_dir, job="202")  # a new job id
    tmpl = {"model": {"w": torch.zeros(8)}, "step": None}
    res = resubmitted.restore(tmpl)
    resubmitted.close()
    assert res is not None and res.step == 3 and torch.equal(tmpl["model"]["w"],
                                                             state["model"]["w"])
    stranger = _store(str(tmp_path), str(tmp_path / "runs" / "llm" / "other"), job="101")
    assert stranger.restore({"model": {"w": torch.zeros(8)}, "step": None}) is None
    stranger.close()
