"""Pre-flight on the real local cluster: nodes that fail their checks are replaced by spares
before any rank starts on them, and training runs on a healthy node.

The first job (CI time is short) asks for one train node and two spares and excludes the fourth node,
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


def test_a_node_whose_clock_is_off_then_an_xid_while_training_each_move_a_node_onto_a_spare(env, tmp_path) -> None:
    """Two train nodes (two ranks each) and two spares, so every node of the cluster (Slurm orders
    an allocation by name). Node rank 1's clock is 5 s off through the clock check's test hook
    (SLURMKIT_TEST_CLOCK_OFFSET_S, read by the agents only), so it fails generation 0's pre-flight
    and the first spare takes its slot. Both generations' link tests run between the two train
    nodes (two nodes: measured, never judged) and their figures are in the ledger. Then, while
    generation 1 trains past a checkpoint, an Xid 79 line is appended to the kernel log of the
    node in slot 1: no rank prints it, that node's agent finds it in the kernel log itself
    (every 5 s), the generation ends as a gpu_fault of that node, the second spare takes the slot
    at once (no crash counted), and the run completes from the checkpoint."""
    from tests.integration.faults import COMMON, INTERVAL, STEPS as RUN_STEPS, wait_for_step

    nodes = cluster_nodes(env)
    assert len(nodes) >= 4, f"two train nodes and two spares: the cluster has {nodes}"
    first, skewed, spare1, spare2, *others = nodes
    klog = tmp_path / "kernel-log"
    klog.mkdir()
    for node in (first, skewed, spare1, spare2):
        (klog / f"{node}.log").write_text("[    1.000000] Linux version (emulated)\n")
    job, run_dir = submit([*COMMON, "job.name=h-clock-xid", "job.nodes=2", "supervisor.spare_nodes=2",
                           f"health.kernel_log={klog}/$SLURMKIT_NODE.log",
                           f'+job.env.SLURMKIT_TEST_CLOCK_OFFSET_S="{skewed}:5"',
                           f"job.exclude=[{','.join(others)}]" if others else "job.exclude=[]"],
                          env, str(tmp_path))
    try:
        # Ranks 2 and 3 run on slot 1: generation 1's node there (the skewed node trains never).
        wait_for_step(run_dir, 2, INTERVAL + 2, timeout_s=600)  # past the first checkpoint
        (slot1,) = {e["node"] for e in events(run_dir, "ranks_started") if e["generation"] == 1 and 2 in e["ranks"]}
        with open(klog / f"{slot1}.log", "a") as f:
            f.write(XID_LINE)
        state = finish(job, env, timeout_s=900, run_dir=run_dir)
    finally:  # never leave it queued behind this test (scancel of an ended job only complains)
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=60, check=False)
    assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    assert final(run_dir)["step"] == RUN_STEPS

    pre = {(e["generation"], e["node"]): {c["name"]: c for c in e["checks"]} for e in events(run_dir, "preflight")}
    clock = pre[(0, skewed)]["clock"]
    assert clock["verdict"] == "bad_node" and abs(clock["figures"]["offset_s"] + 5.0) < 0.5, clock
    assert clock["message"].startswith("Detected: this node's clock is ") and "s ahead of node 0's" in clock["message"]
    assert clock["figures"]["uncertainty_s"] < 0.5, clock
    for key in ((0, first), (1, first), (1, slot1)):
        assert pre[key]["clock"]["verdict"] == "ok", pre[key]
        links = pre[key]["links"]
        assert links["verdict"] == "ok" and links["figures"]["best_mib_s"] > 0, links
    assert pre[(0, skewed)]["links"]["figures"]["best_mib_s"] > 0  # measured although its clock is off
    assert pre[(1, slot1)]["kernel_log"]["verdict"] == "ok", pre  # clean at its start: the Xid came while training

    failures = events(run_dir, "failure")
    assert [(f["generation"], f["cls"], f["node"]) for f in failures] == [
        (0, "preflight", skewed), (1, "gpu_fault", slot1)], failures
    assert "Xid 79" in failures[1]["evidence"] and "GPU has fallen off the bus" in failures[1]["evidence"]
    decisions = events(run_dir, "decision")
    assert [(d["action"], d["exclude"]) for d in decisions] == [
        ("replace_node", [skewed]), ("replace_node", [slot1])], decisions
    started = {(e["generation"], e["node"]) for e in events(run_dir, "ranks_started")}
    assert all(node != skewed for _, node in started), started  # no training time on the skewed node
    assert {(1, first), (1, slot1), (2, first)} <= started and (2, slot1) not in started, started
    (slot1_gen2,) = {node for gen, node in started if gen == 2 and node != first}
    assert slot1 in (spare1, spare2) and slot1_gen2 in (spare1, spare2) and slot1_gen2 != slot1, started
    assert not events(run_dir, "requeue")
