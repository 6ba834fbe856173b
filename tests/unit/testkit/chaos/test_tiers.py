"""The campaign's tier faults without a cluster: a real size-limited tmpfs over an NVMe
directory (root only: skipped otherwise), and the run's own S3 server's stop and start."""

from __future__ import annotations

import os
import subprocess

import pytest

from testkit.chaos import nvme
from testkit.chaos.s3 import CampaignS3
from testkit.s3server import S3Server

MIB = 1 << 20


def mounted(path: str) -> bool:
    return subprocess.run(["findmnt", "-n", path], capture_output=True).returncode == 0


def test_the_nvme_directory_is_found_as_the_store_builds_it(tmp_path) -> None:
    (tmp_path / "config.yaml").write_text("store:\n  nvme_uri: file://$SLURMKIT_RUN_DIR/ckpt/nvme/\n")
    assert nvme.node_nvme_dir(str(tmp_path), "node3") == f"{tmp_path}/ckpt/nvme/node3"
    (tmp_path / "config.yaml").write_text("store:\n  nvme_uri: ''\n")
    with pytest.raises(ValueError, match="no NVMe tier"):
        nvme.node_nvme_dir(str(tmp_path), "node3")


def test_the_tmpfs_holds_what_is_there_and_two_more_saves(tmp_path) -> None:
    step = tmp_path / "step_0000000004"
    step.mkdir()
    (step / "a").write_bytes(b"x" * 3 * MIB)
    (tmp_path / "latest.json").write_text("4")
    used, largest = nvme.tree_bytes(str(tmp_path))
    assert largest == 3 * MIB and used == 3 * MIB + 1
    assert nvme.tmpfs_size(used, largest) == 3 * MIB + 64 * MIB + 16 * MIB + MIB  # rounded up
    assert nvme.tmpfs_size(0, 100 * MIB) == 216 * MIB
    # once the filler is gone the pre-flight finds the free space it demands
    assert nvme.tmpfs_size(0, 100 * MIB, 1 << 30) == 216 * MIB + (1 << 30)
    (tmp_path / "config.yaml").write_text("health:\n  nvme_min_free_gb: 0.5\n")
    assert nvme.preflight_min_free(str(tmp_path)) == 1 << 29
    (tmp_path / "config.yaml").write_text("train:\n  steps: 4\n")
    assert nvme.preflight_min_free(str(tmp_path)) == 1 << 30


@pytest.fixture()
def as_root() -> None:
    """These tests mount a tmpfs. Without root they fail saying so (CI runs as root): a skip
    would check nothing."""
    if os.geteuid() != 0:
        pytest.fail(f"Detected: running as uid {os.geteuid()}. Requirement: root, to mount a tmpfs over a "
                    "node's NVMe directory. Fix: run the test suite as root, as CI does.")


needs_root = pytest.mark.usefixtures("as_root")


@needs_root
def test_a_filled_tier_is_really_full_keeps_its_checkpoints_and_is_taken_away(tmp_path) -> None:
    tier = tmp_path / "nvme" / "node1"
    (tier / "step_0000000004").mkdir(parents=True)
    (tier / "step_0000000004" / "__0_0.distcp").write_bytes(os.urandom(MIB))
    (tier / "latest.json").write_text("4")
    full = nvme.fill_tier(str(tier))
    try:
        assert mounted(str(tier)) and full.filler_bytes > 60 * MIB
        assert nvme.free_bytes(str(tier)) < 4096
        assert (tier / "step_0000000004" / "__0_0.distcp").stat().st_size == MIB  # still there
        with pytest.raises(OSError) as exc:
            with open(tier / "save", "wb", buffering=0) as f:
                f.write(b"\0" * 65536)
        assert exc.value.errno == 28  # ENOSPC
        nvme.release(full)
        assert nvme.free_bytes(str(tier)) > 60 * MIB  # room for the next saves again
        (tier / "step_0000000008").mkdir()
    finally:
        nvme.unmount(full)
    assert not mounted(str(tier)) and not full.mounted
    # the directory underneath was never written: the machine's disk did not fill
    assert sorted(os.listdir(tier)) == ["latest.json", "step_0000000004"]
    assert [n for n in os.listdir(tier.parent) if n.startswith(".chaos-nvme-")] == []  # staging gone


@needs_root
def test_a_failed_fill_leaves_no_mount(tmp_path) -> None:
    tier = tmp_path / "node1"
    tier.mkdir()
    calls: list[list[str]] = []

    def run(argv: list[str]) -> None:
        calls.append(argv)
        if argv[:2] == ["mount", "--bind"]:
            raise subprocess.CalledProcessError(32, argv)
        nvme.run_checked(argv)

    with pytest.raises(subprocess.CalledProcessError):
        nvme.fill_tier(str(tier), run=run)
    assert [c[0] for c in calls] == ["mount", "mount", "umount"]
    assert not mounted(str(tier)) and os.listdir(tmp_path) == ["node1"]


def test_the_run_s_own_s3_server_comes_back_on_its_port_keys_and_data() -> None:
    started: list[dict] = []
    stopped: list[int] = []

    def start(state_dir: str, **kw) -> S3Server:
        started.append({"dir": state_dir, **kw})
        return S3Server(f"http://127.0.0.1:{kw['s3_port']}", kw["access_key"], kw["secret_key"],
                        "checkpoints", 100 + len(started), state_dir)

    s3 = CampaignS3("/x/s3-seed5", start=start, stop=stopped.append, outage=stopped.append)
    first = s3.start()
    assert s3.object_uri("chaos") == "s3://checkpoints/chaos/$SLURMKIT_RUN_ID"
    s3.stop()
    assert not s3.up and stopped == [first.pid] and s3.outages == 1
    with pytest.raises(RuntimeError, match="not running"):
        s3.env()
    second = s3.start()
    assert second.endpoint == first.endpoint and s3.env()["AWS_ACCESS_KEY_ID"] == s3.access_key
    assert started[0] == started[1]  # the same directory, port and keys
    s3.close(remove=False)
    assert stopped == [first.pid, second.pid] and not s3.up
