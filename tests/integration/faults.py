"""Driving real faults into real jobs on the local cluster: wait for a step, find a rank's pid."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from tests.integration.helpers import parse_submitted, read_ledger, submit_cli, submitter_uid, wait_terminal

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCAL_CLUSTER = os.path.join(REPO, "tools", "local-cluster")

# Small, deterministic and slow enough to hit mid-flight: 40 steps, a checkpoint every 10, the
# 0.25 s delay setting the pace. The 0.1 M-parameter model (conf/model/micro.yaml) and one
# sequence of 32 tokens per rank: what is tested is the control plane, and four ranks of tiny's
# 5 M parameters spent ~0.3 s of CPU a step each, most of CI's CPU (the machine has two cores).
STEPS, INTERVAL = 40, 10
COMMON = ["+exp=tiny", "model=micro", f"train.steps={STEPS}", f"train.ckpt_interval_steps={INTERVAL}",
          "train.micro_batch=1", "train.seq_len=32",
          "+job.env.SLURMKIT_STEP_DELAY_S=0.25", "supervisor.heartbeat_timeout_s=8"]


SESSION_START = time.time()


def heartbeat_step(run_dir: str, rank: int, uid: int | None = None) -> int:
    """The rank's step from its node-local heartbeat (the emulated nodes share this machine's
    /dev/shm; on a real cluster only the agent of the rank's node can read it)."""
    from slurmkit.train.heartbeat import local_heartbeat_path

    try:
        with open(local_heartbeat_path(run_dir, rank, uid=submitter_uid() if uid is None else uid)) as f:
            beat = json.load(f)
        # A beat from before this pytest session was left at the path by an earlier session
        # with the same base temp (/dev/shm outlives /tmp/pytest-of-*): not this run's rank.
        return int(beat["step"]) if float(beat["time"]) >= SESSION_START else -1
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def wait_for_step(run_dir: str, rank: int, step: int, timeout_s: float = 180, uid: int | None = None) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = heartbeat_step(run_dir, rank, uid)
        if s >= step:
            return s
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} never reached step {step} in {run_dir}")


def rank_pid(run_dir: str, rank: int) -> int:
    """The pid of ``rank`` in the newest generation (from the ledger's ranks_started events)."""
    pids = [e["pids"][e["ranks"].index(rank)] for e in read_ledger(run_dir)
            if e["event"] == "ranks_started" and rank in e["ranks"]]
    if not pids:
        raise AssertionError(f"no ranks_started event for rank {rank} in {run_dir}")
    return int(pids[-1])


def submit(args: list[str], env: Mapping[str, str], cwd: str) -> tuple[str, str]:
    res = submit_cli([*args, f"submit.run_root={cwd}"], env, cwd)
    if res.returncode != 0:
        raise AssertionError(res.stdout + res.stderr)
    return parse_submitted(res.stdout)


def completed_after_restarts(job: str, env: Mapping[str, str], run_dir: str, killed: Sequence[int],
                             timeout_s: float) -> str:
    """Wait for the run's end and check it: COMPLETED, one ``rank_crash`` per rank in ``killed``
    (in order), each answered by a restart in the allocation, and a completed ``end``. Returns
    the diagnosis, for the caller's later assertions."""
    state = finish(job, env, timeout_s=timeout_s, run_dir=run_dir)
    story = diagnose(run_dir, job, env)
    assert state == "COMPLETED", f"job {job} ended {state}\n{story}"
    failures = events(run_dir, "failure")
    assert [(f["cls"], f["rank"]) for f in failures] == [("rank_crash", r) for r in killed], story
    assert [d["action"] for d in events(run_dir, "decision")] == ["restart"] * len(killed), story
    end = events(run_dir, "end")[-1]
    assert end["status"] == "completed" and end["exit_code"] == 0, end
    return story


def mark_fault(run_dir: str, kind: str, **fields: object) -> None:
    from slurmkit.ledger.ledger import Ledger

    Ledger(os.path.join(run_dir, "ledger.jsonl"), source="test").append("fault_injected", kind=kind, **fields)


def final(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "final.json")) as f:
        return dict(json.load(f))


def events(run_dir: str, name: str) -> list[dict]:
    return [e for e in read_ledger(run_dir) if e["event"] == name]


def finish(job_id: str, env: Mapping[str, str], timeout_s: float = 400, run_dir: str | None = None) -> str:
    """The run's end: with ``run_dir``, that of the successor job the run was handed to, if any."""
    return wait_terminal(job_id, env, timeout_s, run_dir)


def diagnose(run_dir: str, job_id: str, env: Mapping[str, str]) -> str:
    """What a failed fault test prints: every step of the supervisor and the job's own end.

    A run that ends in the wrong state on a shared CI machine is hard to reproduce, so the
    assertion carries the ledger (without heartbeats), Slurm's accounting rows and the tail of
    every agent's log rather than rank 0's traceback alone.
    """
    import subprocess

    out = []
    for e in read_ledger(run_dir):
        if e["event"] in ("heartbeat",):
            continue
        keep = {k: v for k, v in e.items() if k in (
            "event", "source", "generation", "step", "cls", "rank", "node", "action", "reason",
            "old", "new", "why", "status", "exit_code", "tier", "evidence")}
        out.append(json.dumps(keep)[:400])
    from slurmkit.supervise.exits.successor import successor_chain

    jobs = successor_chain(run_dir, job_id)  # the run handed over to a successor job: its rows too
    res = subprocess.run(["sacct", "-j", ",".join(jobs), "-n", "-P", "--duplicates",
                          "--format=JobID,State,ExitCode,DerivedExitCode,NodeList,Elapsed"],
                         env=dict(env), capture_output=True, text=True, timeout=60)
    out.append("sacct:\n" + res.stdout + res.stderr)
    logs = os.path.join(run_dir, "submitit")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        if name.endswith(("_log.out", "_log.err")):
            with open(os.path.join(logs, name), errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if "heartbeat" not in ln]
            out.append(f"--- {name} (last 25 lines)\n" + "\n".join(lines[-25:]))
    return "\n".join(out)


def _client(env: Mapping[str, str]):
    from slurmkit.slurm.client import SlurmClient
    from slurmkit.slurm.runner import SubprocessRunner

    return SlurmClient(SubprocessRunner(env=dict(env)))


def kill_node(env: Mapping[str, str], node: str) -> None:
    """A node loss: ``tools/local-cluster kill-node`` (slurmd, the job's processes there, its NVMe)."""
    subprocess.run([LOCAL_CLUSTER, "kill-node", node], check=True, env=dict(env),
                   capture_output=True, timeout=60)


def restore_node(env: Mapping[str, str], node: str, timeout_s: float = 120) -> None:
    """Bring ``node`` back for the next tests: start its slurmd (a no-op while it runs), resume
    it from DOWN/DRAIN, and wait until Slurm may schedule on it again (responding, no drain)."""
    subprocess.run([LOCAL_CLUSTER, "start-node", node], check=True, env=dict(env),
                   capture_output=True, timeout=60)
    client = _client(env)
    deadline = time.monotonic() + timeout_s
    info = None
    while time.monotonic() < deadline:
        (info,) = client.nodes([node])
        if info.usable:
            return
        if info.state in ("DOWN", "FAIL") or {"DRAIN", "DRAINED", "DRAINING", "FAIL"} & set(info.flags):
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=dict(env),
                           capture_output=True, timeout=30)
        time.sleep(1)
    raise AssertionError(f"{node} did not come back within {timeout_s:.0f} s: {info}")


def _queued(env: Mapping[str, str]) -> dict[str, str]:
    """Every queued or running job (array tasks as their array): job id -> working directory."""
    res = subprocess.run(["squeue", "--noheader", "-o", "%i|%Z"], env=dict(env), capture_output=True,
                         text=True, timeout=60, check=True)
    jobs = {}
    for line in res.stdout.splitlines():
        job, _, workdir = line.strip().partition("|")
        if job:
            jobs[job.split("_")[0]] = workdir
    return jobs


def restore_cluster(env: Mapping[str, str], own_root: str, timeout_s: float = 180) -> list[str]:
    """Leave the cluster as the next test expects it, so that one failed test cannot hold nodes
    that every later test then waits for until its own timeout. Returns what had to be done
    (empty when the test cleaned up after itself).

    Jobs submitted from under ``own_root`` (this pytest session's base temporary directory:
    every test submits from its tmp_path) are cancelled and waited out. Only when no other
    job is on the cluster (CI: never; a developer's second session: maybe) are DOWN or
    draining nodes brought back and every node waited on until idle; another session's test
    may have killed a node on purpose.
    """
    done: list[str] = []
    root = os.path.realpath(own_root).rstrip("/") + "/"
    ours = sorted(j for j, d in _queued(env).items()
                  if (os.path.realpath(d).rstrip("/") + "/").startswith(root))
    for job in ours:
        subprocess.run(["scancel", job], env=dict(env), capture_output=True, timeout=30)
    if ours:
        done.append("cancelled " + ",".join(ours))
    deadline = time.monotonic() + timeout_s
    while set(ours) & set(_queued(env)):
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {ours} still queued {timeout_s:.0f} s after scancel")
        time.sleep(0.5)
    if _queued(env):
        return done
    client = _client(env)
    for info in client.nodes():
        if not info.usable:
            restore_node(env, info.name, timeout_s)
            done.append(f"restored {info.name} ({info.state} {','.join(info.flags)})")
    while any(i.state != "IDLE" or "COMPLETING" in i.flags for i in client.nodes()):
        if time.monotonic() > deadline:
            raise AssertionError(f"nodes not idle {timeout_s:.0f} s after the queue emptied: {client.nodes()}")
        time.sleep(0.5)
    return done


T = TypeVar("T")


def current_job(run_dir: str, job: str) -> str:
    """The job the run is in now: ``job``, or the newest successor it handed the run to."""
    from slurmkit.supervise.exits.successor import successor_chain

    return successor_chain(run_dir, job)[-1]


def wait_while_running(what: str, check: Callable[[], T | None], job: str, run_dir: str,
                       env: Mapping[str, str], timeout_s: float = 120) -> T:
    """``check()``'s first value that is not None; fails at once, with the diagnosis, when the
    run's newest job (``job`` or the successor it handed the run to) leaves the running states
    first (Slurm asked at most once a second)."""
    from slurmkit.slurm.client import SlurmClient
    from slurmkit.slurm.runner import SubprocessRunner

    client = SlurmClient(SubprocessRunner(env=dict(env)))
    deadline = time.monotonic() + timeout_s
    asked = 0.0
    while time.monotonic() < deadline:
        got = check()
        if got is not None:
            return got
        if time.monotonic() - asked > 1.0:
            asked = time.monotonic()
            newest = current_job(run_dir, job)
            state = client.job_state(newest)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED") \
                    and current_job(run_dir, job) == newest:  # not handed over meanwhile
                raise AssertionError(f"job {newest} is {state} while waiting for {what}\n"
                                     + diagnose(run_dir, job, env))
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s\n{diagnose(run_dir, job, env)}")
