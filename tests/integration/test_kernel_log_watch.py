"""An Xid logged by the kernel while the ranks run, on the real local cluster: the node leaves on
the first one, while training goes on on a spare.

Every node's kernel-log source is an emulated log file (health.kernel_log through
$SLURMKIT_NODE). All are clean when the job starts, so every pre-flight passes; once training is
past a checkpoint the test appends an Xid 79 line to node rank 1's log. No rank prints it: the
agent of that node finds it in the kernel log itself (slurmkit.launch.agent, every 5 s), the
generation ends as a gpu_fault of that node, the spare takes its slot at once (no crash
counted), and the run completes from the checkpoint.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.integration.faults import COMMON, INTERVAL, STEPS, diagnose, events, final, finish, submit, wait_for_step
from tests.integration.helpers import slurm_env
from tests.integration.test_health import XID_LINE, cluster_nodes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


def test_an_xid_in_the_kernel_log_while_ranks_run_moves_the_node_out(env, tmp_path) -> None:
    first, faulty, spare, *others = cluster_nodes(env)
    klog = tmp_path / "kernel-log"
    klog.mkdir()
    for node in (first, faulty, spare):
        (klog / f"{node}.log").write_text("[    1.000000] Linux version (emulated)\n")
    job, run_dir = submit([*COMMON, "job.name=h-xid-live", "job.nodes=2", "supervisor.spare_nodes=1",
                           f"health.kernel_log={klog}/$SLURMKIT_NODE.log",
                           f"job.exclude=[{','.join(others)}]" if others else "job.exclude=[]"],
                          env, str(tmp_path))
    try:
        # Ranks per node of +exp=tiny: 2, so node rank 1 holds ranks 2 and 3.
        wait_for_step(run_dir, 2, INTERVAL + 2, timeout_s=600)  # past the first checkpoint
        with open(klog / f"{faulty}.log", "a") as f:
            f.write(XID_LINE)
        state = finish(job, env, timeout_s=600, run_dir=run_dir)
    finally:  # never leave it queued behind this test (scancel of an ended job only complains)
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=60, check=False)
    assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    assert final(run_dir)["step"] == STEPS

    pre = {(e["generation"], e["node"]): e["verdict"] for e in events(run_dir, "preflight")}
    assert pre[(0, faulty)] == "ok", pre  # clean at the start: the Xid came while training
    failures = events(run_dir, "failure")
    assert [(f["generation"], f["cls"], f["node"]) for f in failures] == [(0, "gpu_fault", faulty)], failures
    assert "Xid 79" in failures[0]["evidence"] and "GPU has fallen off the bus" in failures[0]["evidence"]
    decisions = events(run_dir, "decision")
    assert [(d["action"], d["exclude"]) for d in decisions] == [("replace_node", [faulty])], decisions
    started = {(e["generation"], e["node"]) for e in events(run_dir, "ranks_started")}
    assert (1, faulty) not in started and (1, spare) in started and (1, first) in started, started
    assert not events(run_dir, "requeue")
