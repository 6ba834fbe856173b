"""Applying a plan in a real child process and checking it from inside (this machine: CPUs 0-1)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from slurmkit.topology import (
    PinningError,
    TopologyConfig,
    apply_plan,
    discover,
    pin_command,
    plan_node,
    rank_env,
    verify_current,
    verify_from_env,
)

HERE_CPUS = sorted(os.sched_getaffinity(0))


def _status(text: str) -> dict[str, str]:
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def _real_plans(n: int):
    topo = discover("/")
    return plan_node(topo, n, TopologyConfig())


def test_pin_wrapper_sets_affinity_and_memory_policy_of_the_real_child():
    plans = _real_plans(len(HERE_CPUS))
    last = plans[-1]
    for method in ("syscall", "numactl"):
        cmd = pin_command(last, ["cat", "/proc/self/status"], verify="fail", method=method)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
        fields = _status(out.stdout)
        assert fields["Cpus_allowed_list"] == str(HERE_CPUS[-1]), method
        assert fields["Mems_allowed_list"] == "0"
        numa = subprocess.run(
            pin_command(last, ["numactl", "--show"]) if method == "numactl" else
            [*cmd[: cmd.index("--") + 1], "numactl", "--show"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        assert "policy: preferred" in numa and f"physcpubind: {HERE_CPUS[-1]} " in numa


def test_apply_plan_as_preexec_fn_and_verify_from_env_inside_the_rank():
    plans = _real_plans(len(HERE_CPUS))
    plan = plans[0]
    env = {**os.environ, **rank_env(plan, plans, os.environ, TopologyConfig())}
    child = (
        "import os, json, sys\n"
        "from slurmkit.topology import verify_from_env\n"
        "print(json.dumps({'aff': sorted(os.sched_getaffinity(0)),"
        " 'problems': verify_from_env(os.environ, 'fail')}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", child], env=env, preexec_fn=lambda: apply_plan(plan),
        capture_output=True, text=True, timeout=60, check=True,
    )
    result = json.loads(out.stdout)
    assert result == {"aff": list(plan.cpus), "problems": []}


def test_rank_that_is_not_pinned_fails_verification_in_fail_mode():
    plans = _real_plans(len(HERE_CPUS))
    env = {**os.environ, **rank_env(plans[0], plans, {}, TopologyConfig())}
    env["SLURMKIT_CPUS"] = "0-1023"  # a plan this process cannot match
    child = (
        "import os\nfrom slurmkit.topology import verify_from_env\n"
        "verify_from_env(os.environ, 'fail')\n"
    )
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "PinningError" in out.stderr


def test_verify_with_injected_readers():
    plans = _real_plans(1)
    plan = dataclasses.replace(plans[0], cpus=(0, 1), mem_nodes=(0,), mem_mode="bind")
    ok = verify_current(plan, lambda: {0, 1}, lambda: ("bind", (0,)))
    assert ok == []
    bad = verify_current(plan, lambda: {0}, lambda: ("preferred", (0,)))
    assert len(bad) == 2 and "affinity is 0" in bad[0] and "memory policy is preferred" in bad[1]
    env = {"SLURMKIT_CPUS": "0-1", "SLURMKIT_MEM_POLICY": "bind", "SLURMKIT_MEM_NODES": "0"}
    assert verify_from_env(env, "warn", lambda: {1}, lambda: ("bind", (0,))) != []
    with pytest.raises(PinningError):
        verify_from_env(env, "fail", lambda: {1}, lambda: ("bind", (0,)))
    assert verify_from_env({}, "fail") == []  # not started by slurmkit: nothing to check


def test_pin_wrapper_rejects_a_bad_plan_and_a_missing_command():
    bad = subprocess.run(
        [sys.executable, "-m", "slurmkit.topology.pin", "--plan-json", "{}", "--", "true"],
        capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode == 2 and "Detected:" in bad.stderr
    plan = _real_plans(1)[0]
    missing = subprocess.run(
        pin_command(plan, ["/nonexistent/prog"], method="syscall"), capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 127 and "/nonexistent/prog" in missing.stderr
