"""The pre-flight of one node: deadlines, the wait loop, the ledger record, the evidence and what
the supervisor's policy does with it."""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading

import pytest

from slurmkit.config import compose
from slurmkit.config.health import HealthConfig
from slurmkit.errors import ConfigError
from slurmkit.health.cli import main as health_cli
from slurmkit.health.preflight import Preflight, build_checks
from slurmkit.health.result import Verdict, bad, ok, wait
from slurmkit.health.runner import Check, Timeout, run_checks
from slurmkit.ledger.ledger import Ledger, read_ledger
from slurmkit.failures.classes import CLASS_INFO, FailureClass
from slurmkit.failures.classify import Evidence, root_cause
from slurmkit.supervise.policy import Action, History, Limits, decide

# Deadline tests of a few tenths of a second on real subprocesses: CI runs them in its
# foreground stream, not beside the cluster's jobs at a low priority.
pytestmark = pytest.mark.realtime

# No "[seconds since boot]" stamp: the emulated line counts whatever this machine's uptime.
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2811, GPU has fallen off the bus.\n"
WAIT_T = Timeout(Verdict.WAIT, "answers", "wait")


# ------------------------------------------------------------------ the runner
def test_a_hung_check_gets_its_timeout_verdict_and_is_not_started_twice() -> None:
    release = threading.Event()
    calls = []

    def hung(_deadline_s):
        calls.append(1)
        release.wait(60)
        return ok("fs", "late")

    fs = Check("fs", hung, 0.2, WAIT_T)
    quick = Check("gpus", lambda _d: ok("gpus", "fine"), 5.0, WAIT_T)
    first = run_checks([fs, quick])
    assert [r.verdict for r in first] == [Verdict.WAIT, Verdict.OK] and first[0].figures["timed_out"] is True
    again = run_checks([fs])  # the first probe is still stuck: no second thread piles up on it
    assert again[0].verdict == Verdict.WAIT and "still blocked" in again[0].detected and len(calls) == 1
    release.set()
    fs._thread.join(5)  # type: ignore[union-attr]
    assert run_checks([fs])[0].verdict == Verdict.OK and len(calls) == 2


def test_a_check_that_raises_is_skipped_not_a_bad_node() -> None:
    def broken(_deadline_s):
        raise KeyError("unexpected")

    (r,) = run_checks([Check("x", broken, 5.0, WAIT_T)])
    assert r.verdict == Verdict.SKIPPED and "KeyError" in r.detected


# ------------------------------------------------------------------ Preflight
def ledger_events(path: str) -> list[dict]:
    return list(read_ledger(path))


def test_bad_node_is_recorded_and_becomes_preflight_evidence(tmp_path) -> None:
    path = str(tmp_path / "ledger.jsonl")
    led = Ledger(path, source="agent:node2")  # validates every event against the schema
    checks = [Check("gpus", lambda _d: ok("gpus", "8 GPUs", gpus_found=8), 5, WAIT_T),
              Check("nvme", lambda _d: bad("nvme", "0.00 GiB free", "1 GiB free", "free space", free_gb=0.0), 5,
                    WAIT_T)]
    ev = Preflight(checks, "node2", led, wait_max_s=60, wait_retry_s=1).run(gen=3)
    led.close()
    assert isinstance(ev, Evidence) and ev.cls == FailureClass.PREFLIGHT and ev.node == "node2" and ev.rank == -1
    assert "pre-flight nvme: Detected: 0.00 GiB free" in ev.detail and "gpus" not in ev.detail
    (rec,) = [e for e in ledger_events(path) if e["event"] == "preflight"]
    assert rec["verdict"] == "bad_node" and rec["generation"] == 3 and rec["node"] == "node2"
    assert [(c["name"], c["verdict"]) for c in rec["checks"]] == [("gpus", "ok"), ("nvme", "bad_node")]
    assert rec["checks"][1]["figures"] == {"free_gb": 0.0}


def test_wait_is_rechecked_then_the_ranks_start() -> None:
    now = [0.0]
    answers = iter([wait("shared:lustre", "hung", "answers", "wait")] * 2 + [ok("shared:lustre", "back")])
    calls = {"gpus": 0}

    def gpus(_deadline_s):
        calls["gpus"] += 1
        return ok("gpus", "fine")

    events: list[tuple[str, dict]] = []

    class L:
        def append(self, event, **fields):
            events.append((event, fields))

    pf = Preflight([Check("gpus", gpus, 5, WAIT_T), Check("shared:lustre", lambda _d: next(answers), 5, WAIT_T)],
                   "node1", L(), wait_max_s=100, wait_retry_s=10, clock=lambda: now[0],
                   sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert pf.run(0) is None
    assert [f["verdict"] for _, f in events] == ["wait", "wait", "ok"] and calls["gpus"] == 1  # only waits rerun
    assert [f["waited_s"] for _, f in events] == [0.0, 10.0, 20.0]

    events.clear()
    stuck = Preflight([Check("shared:lustre", lambda _d: wait("shared:lustre", "hung", "a", "b"), 5, WAIT_T)],
                      "node1", L(), wait_max_s=30, wait_retry_s=10, clock=lambda: now[0],
                      sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert stuck.run(1) is None  # a shared tier that stays down is no reason to drop this node
    assert [f["verdict"] for _, f in events] == ["wait"] * 4


def test_a_node_check_that_misses_its_deadline_is_rechecked_longer_never_bad(tmp_path) -> None:
    """A loaded node misses deadlines: the GPU query that outlives its deadline is "wait", and the
    re-check gives it twice as long (the real deadline reaches the real subprocess)."""
    smi = tmp_path / "nvidia-smi"
    marker = tmp_path / "second-call"
    # Slow the first time (past its 0.3 s deadline), quick the second: a burst of load.
    # A shell script, not Python: its start is a millisecond however loaded the machine is, so
    # only the first call outlives a deadline.
    smi.write_text(f"""#!/bin/sh
if [ ! -e {shlex.quote(str(marker))} ]; then : > {shlex.quote(str(marker))}; exec sleep 30; fi
echo "0, 00000000:01:00.0, 0"
""")
    smi.chmod(0o755)
    health = HealthConfig(timeout_s=0.3, kernel_log="", nvidia_smi=str(smi))
    cfg = compose(["+exp=tiny", "cluster=local"])
    checks = [c for c in build_checks(health, cfg.store, gpus_planned=1, node="n1",
                                      env={"SLURMKIT_RUN_DIR": str(tmp_path / "run"), "PATH": os.environ["PATH"]})
              if c.name == "gpus"]
    deadlines: list[float] = []
    inner = checks[0].run
    checks[0].run = lambda d: (deadlines.append(d), inner(d))[1]
    seen: list[dict] = []

    class L:
        def append(self, event, **fields):
            seen.append(fields)

    assert Preflight(checks, "n1", L(), wait_max_s=600, wait_retry_s=0.01).run(0) is None
    verdicts = [f["checks"][0]["verdict"] for f in seen]
    assert verdicts[0] == "wait" and "within 0.3 s" in seen[0]["checks"][0]["message"], seen[0]
    assert verdicts[-1] == "ok" and set(verdicts[:-1]) == {"wait"}, verdicts
    assert deadlines[0] == pytest.approx(0.3) and deadlines == sorted(deadlines) and deadlines[-1] > 0.3, deadlines


def test_build_checks_from_a_config_and_an_emulated_kernel_log(tmp_path) -> None:
    run_dir = tmp_path / "run"
    (tmp_path / "klog").mkdir()
    (tmp_path / "klog" / "node2.log").write_text(XID_79)
    (tmp_path / "klog" / "node1.log").write_text("")
    cfg = compose(["+exp=tiny", "cluster=local", f"health.kernel_log={tmp_path}/klog/$SLURMKIT_NODE.log",
                   f"health.extra_commands=[[{sys.executable},-c,pass]]"])
    env = {"SLURMKIT_RUN_DIR": str(run_dir), "PATH": os.environ["PATH"]}
    names = [c.name for c in build_checks(cfg.health, cfg.store, gpus_planned=0, node="node1", env=env)]
    assert names == ["gpus", "kernel_log", "nvme", "shared:lustre", "site:" + os.path.basename(sys.executable)]
    by_node = {}
    for node in ("node1", "node2"):
        results = run_checks(build_checks(cfg.health, cfg.store, gpus_planned=0, node=node, env=env))
        by_node[node] = {r.name: r for r in results}
    assert by_node["node1"]["kernel_log"].verdict == Verdict.OK
    assert by_node["node2"]["kernel_log"].verdict == Verdict.BAD_NODE
    assert by_node["node1"]["nvme"].verdict == Verdict.OK and (run_dir / "ckpt" / "nvme" / "node1").is_dir()
    assert by_node["node1"]["gpus"].verdict == Verdict.SKIPPED


def test_the_kernel_log_is_read_again_while_ranks_run_seeing_only_what_is_new(tmp_path) -> None:
    # The agent reads it every few seconds during a generation (NodeAgent._watch_kernel_log):
    # the pre-flight's cursor means an Xid already judged at the start is not judged again, and
    # one logged under the running ranks is found.
    (tmp_path / "klog").mkdir()
    log_file = tmp_path / "klog" / "node1.log"
    log_file.write_text("[    1.000000] Linux version (emulated)\n")
    cfg = compose(["+exp=tiny", "cluster=local", f"health.kernel_log={tmp_path}/klog/$SLURMKIT_NODE.log"])
    env = {"SLURMKIT_RUN_DIR": str(tmp_path / "run"), "PATH": os.environ["PATH"]}

    class L:
        def append(self, *a: object, **k: object) -> None:
            pass

    pf = Preflight(build_checks(cfg.health, cfg.store, gpus_planned=0, node="node1", env=env), "node1", L(),
                   wait_max_s=60, wait_retry_s=1)
    assert pf.run(0) is None  # the pre-flight passes
    now = pf.kernel_log_now()
    assert now is not None and now.verdict == Verdict.OK
    with open(log_file, "a") as f:
        f.write(XID_79)
    found = pf.kernel_log_now()
    assert found is not None and found.verdict == Verdict.BAD_NODE and "Xid 79" in found.message
    again = pf.kernel_log_now()
    assert again is not None and again.verdict == Verdict.OK  # read once, not again
    assert Preflight([], "node1", L(), wait_max_s=60, wait_retry_s=1).kernel_log_now() is None


def test_health_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="health.timeout_s"):
        HealthConfig(timeout_s=0)
    with pytest.raises(ConfigError, match="argv list"):
        HealthConfig(extra_commands=[[]])
    with pytest.raises(ConfigError, match="control character"):
        HealthConfig(extra_commands=[["/bin/check", "a\nb"]])
    with pytest.raises(ConfigError):
        compose(["+exp=tiny", "cluster=local", "health.no_such_key=1"])
    assert compose(["+exp=tiny", "cluster=local", "health=off"]).health.enabled is False
    strict = compose(["+exp=tiny", "cluster=local", "health=datacenter"]).health
    assert strict.enabled and strict.nvme_min_write_mb_s == 200.0 and strict.nvme_probe_mb == 64.0


# ------------------------------------------------------------------ the supervisor's side
def test_a_failed_preflight_is_the_root_cause_and_the_node_is_replaced_at_once() -> None:
    pre = Evidence(100.0, "node2", -1, "agent", FailureClass.PREFLIGHT, "pre-flight nvme: Detected: full")
    # The other node's ranks were started and then killed by the stop: later, and only symptoms.
    crash = Evidence(101.0, "node1", 0, "exit", FailureClass.RANK_CRASH, "returncode -9")
    failure = root_cause([crash, pre])
    assert failure is not None and failure.cls == FailureClass.PREFLIGHT and failure.node == "node2"
    assert CLASS_INFO[FailureClass.PREFLIGHT].bad_node
    limits = Limits(5, 3)
    d, h = decide(failure, History(), None, limits, spare_nodes=["node3"], lost_nodes=[])
    assert d.action == Action.REPLACE_NODE and d.exclude == ("node2",)  # the first time, no repeat needed
    d, _ = decide(failure, History(), None, limits, spare_nodes=[], lost_nodes=[])
    assert d.action == Action.REQUEUE and d.exclude == ("node2",)


def test_cli_prints_the_checks_and_exits_with_the_verdict(tmp_path, capsys) -> None:
    (tmp_path / "k.log").write_text(XID_79)
    env = {"SLURMKIT_RUN_DIR": str(tmp_path / "run"), "PATH": os.environ["PATH"]}
    args = ["--json", "--node", "nodeX", "+exp=tiny", "cluster=local", "health.nvme_probe_mb=1"]
    assert health_cli(args, env=dict(env)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["node"] == "nodeX" and out["verdict"] == "ok"
    assert {c["name"] for c in out["checks"]} >= {"gpus", "kernel_log", "nvme", "shared:lustre"}
    assert health_cli([*args, f"health.kernel_log={tmp_path}/k.log"], env=dict(env)) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "bad_node"
    assert health_cli(["+exp=tiny", "cluster=local", "health.timeout_s=-1"], env=dict(env)) == 3


def test_node0_leaves_only_after_spares_and_retired_nodes_saw_the_end(tmp_path) -> None:
    """A run whose train slot moved to a spare (as after a failed pre-flight) ends with agents that
    are not train nodes: node 0 keeps the store until they too have seen the end. Leaving after the
    train nodes alone made a retired node take the closed store for node 0's loss and requeue the
    finished job (seen on the local cluster)."""
    from tests.unit.supervise.test_loop import Cluster, Script

    c = Cluster(tmp_path, [Script(), Script(), Script()], train_nodes=1)  # node 0 trains, two spares
    for sup in c.sups[1:]:  # agents that are slow to look (a loaded node)
        sup.sleep = lambda s: threading.Event().wait(max(s, 0.2))
    seen_by_node0: list[int] = []
    leave = c.sups[0].finish

    def finish(code: int) -> int:
        out = leave(code)
        seen_by_node0.append(c.sups[0].channel.exited())  # arrivals when node 0 closes the store
        return out

    c.sups[0].finish = finish  # type: ignore[method-assign]
    assert c.run() == {0: 0, 1: 0, 2: 0}
    assert seen_by_node0 == [3]
