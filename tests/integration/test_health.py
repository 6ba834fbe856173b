"""Pre-flight on the real local cluster: nodes that fail their checks are replaced by spares
before any rank starts on them, and training runs on a healthy node.

One job (CI time is short) asks for one train node and two spares and excludes the fourth node,
so the test knows the order of its nodes (Slurm orders an allocation by name) and can spoil two
of them before the job starts: node rank 0's NVMe tier is a real, full tmpfs; node rank 1's
kernel-log source (health.kernel_log, one emulated log file per node through $SLURMKIT_NODE)
holds an Xid 79 line. Generation 0 fails on node rank 0's pre-flight, the first spare (node rank
1) takes its place and fails its own in generation 1, and the second spare trains.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.integration.faults import diagnose, events, final, finish, submit
from tests.integration.helpers import slurm_env

pytestmark = pytest.mark.integration
STEPS = 6
XID_LINE = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus.\n"


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


def cluster_nodes(env: dict[str, str]) -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    nodes = sorted(set(out.split()))
    assert len(nodes) >= 3, nodes
    return nodes


def fill(path: str) -> None:
    """Write until the file system is full (ENOSPC)."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def test_nodes_failing_preflight_are_replaced_before_training(env, tmp_path) -> None:
    full_nvme, xid, healthy, *others = cluster_nodes(env)
    nvme = tmp_path / "nvme"
    mount = nvme / full_nvme  # that node's NVMe directory: {store.nvme_uri}/{node}
    mount.mkdir(parents=True)
    klog = tmp_path / "kernel-log"
    klog.mkdir()
    for node in (full_nvme, xid, healthy):
        (klog / f"{node}.log").write_text("[    1.000000] Linux version (emulated)\n")
    with open(klog / f"{xid}.log", "a") as f:
        f.write(XID_LINE)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        fill(str(mount / "filler"))
        job, run_dir = submit(["+exp=tiny", "model=micro", "job.name=h-preflight", "job.nodes=1", f"train.steps={STEPS}",
                               "train.ckpt_interval_steps=3", "supervisor.spare_nodes=2",
                               f"store.nvme_uri={nvme}", f"health.kernel_log={klog}/$SLURMKIT_NODE.log",
                               f"job.exclude=[{','.join(others)}]" if others else "job.exclude=[]"],
                              env, str(tmp_path))
        try:
            state = finish(job, env, timeout_s=900, run_dir=run_dir)  # it may queue behind other jobs for its three nodes
        finally:  # never leave it queued behind this test (scancel of an ended job only complains)
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=60, check=False)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
    assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    assert final(run_dir)["step"] == STEPS

    pre = {(e["generation"], e["node"]): e for e in events(run_dir, "preflight")}
    checks = {key: {c["name"]: c for c in e["checks"]} for key, e in pre.items()}
    assert pre[(0, full_nvme)]["verdict"] == "bad_node", pre
    nvme_check = checks[(0, full_nvme)]["nvme"]
    assert nvme_check["verdict"] == "bad_node" and nvme_check["figures"]["free_gb"] == 0.0, nvme_check
    assert nvme_check["message"].startswith("Detected: 0.00 GiB free on the NVMe tier"), nvme_check
    assert checks[(0, full_nvme)]["kernel_log"]["verdict"] == "ok"
    assert pre[(1, xid)]["verdict"] == "bad_node", pre
    xid_check = checks[(1, xid)]["kernel_log"]
    assert xid_check["verdict"] == "bad_node" and "Xid 79" in xid_check["message"], xid_check
    assert checks[(1, xid)]["nvme"]["verdict"] == "ok"
    assert pre[(2, healthy)]["verdict"] == "ok" and all(
        c["verdict"] in ("ok", "skipped") for c in checks[(2, healthy)].values()), pre[(2, healthy)]
    for e in pre.values():
        assert e["duration_s"] < 30, e  # a few seconds on an idle node; the bound only catches a hang

    failures = events(run_dir, "failure")
    assert [(f["generation"], f["cls"], f["node"]) for f in failures] == [
        (0, "preflight", full_nvme), (1, "preflight", xid)], failures
    decisions = events(run_dir, "decision")
    assert [(d["action"], d["exclude"]) for d in decisions] == [
        ("replace_node", [full_nvme]), ("replace_node", [xid])], decisions
    # No rank ever started on a node that failed its pre-flight: no training time was spent there.
    started = events(run_dir, "ranks_started")
    assert started and {(e["generation"], e["node"]) for e in started} == {(2, healthy)}, started
    assert not events(run_dir, "requeue")


def test_a_node_whose_clock_is_off_is_replaced_and_the_links_are_measured(env, tmp_path) -> None:
    """Two train nodes and a spare: node rank 1's clock is 5 s off through the clock check's test
    hook (SLURMKIT_TEST_CLOCK_OFFSET_S, read by the agents only), so it fails generation 0's
    pre-flight and the spare takes its slot. Both generations' link tests run between the two
    train nodes (two nodes: measured, never judged) and their figures are in the ledger."""
    first, skewed, spare, *others = cluster_nodes(env)
    job, run_dir = submit(["+exp=tiny", "model=micro", "job.name=h-clock", "job.nodes=2", "job.ranks_per_node=1",
                           f"train.steps={STEPS}", "train.ckpt_interval_steps=3", "supervisor.spare_nodes=1",
                           "health.kernel_log=", f'+job.env.SLURMKIT_TEST_CLOCK_OFFSET_S="{skewed}:5"',
                           f"job.exclude=[{','.join(others)}]" if others else "job.exclude=[]"],
                          env, str(tmp_path))
    try:
        state = finish(job, env, timeout_s=900, run_dir=run_dir)
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=60, check=False)
    assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    pre = {(e["generation"], e["node"]): {c["name"]: c for c in e["checks"]} for e in events(run_dir, "preflight")}
    clock = pre[(0, skewed)]["clock"]
    assert clock["verdict"] == "bad_node" and abs(clock["figures"]["offset_s"] + 5.0) < 0.5, clock
    assert clock["message"].startswith("Detected: this node's clock is ") and "s ahead of node 0's" in clock["message"]
    assert clock["figures"]["uncertainty_s"] < 0.5, clock
    for key in ((0, first), (1, first), (1, spare)):
        assert pre[key]["clock"]["verdict"] == "ok", pre[key]
        links = pre[key]["links"]
        assert links["verdict"] == "ok" and links["figures"]["best_mib_s"] > 0, links
    assert pre[(0, skewed)]["links"]["figures"]["best_mib_s"] > 0  # measured although its clock is off
    assert [(f["generation"], f["cls"], f["node"]) for f in events(run_dir, "failure")] == [(0, "preflight", skewed)]
    started = {(e["generation"], e["node"]) for e in events(run_dir, "ranks_started")}
    assert {(1, first), (1, spare)} <= started and all(node != skewed for _, node in started), started
