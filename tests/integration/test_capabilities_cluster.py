"""The site capability probe against the real local Slurm cluster (tools/local-cluster up: 22.05,
or 24.11 with --slurm 24.11; SLURMKIT_SLURM_VERSION says which):
every value checked against the cluster's own slurm.conf, the per-user cache, the plan's site
table and the run directory's capabilities.json of a real submission."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Mapping

import pytest

from slurmkit.slurm import SlurmClient, SubprocessRunner
from slurmkit.slurm.capabilities import (
    CAPABILITIES_NAME,
    cache_path,
    probe,
    read_capabilities,
    read_run_dir_copy,
    site_capabilities,
)
from slurmkit.slurm.runner import CommandResult
from tests.integration.helpers import parse_submitted, slurm_env, submit_cli, submitter_uid, wait_terminal

pytestmark = [pytest.mark.integration, pytest.mark.slurm_version]  # CI: on 22.05 and 24.11


def slurm_conf_values(path: str) -> dict[str, str]:
    """Key=Value of the cluster's slurm.conf, first occurrence, comments dropped."""
    out: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            for word in line.split("#", 1)[0].split():
                key, eq, value = word.partition("=")
                if eq:
                    out.setdefault(key, value)
    return out


@pytest.fixture
def env(cluster_env: dict[str, str], tmp_path) -> dict[str, str]:
    return {**slurm_env(cluster_env), "SLURMKIT_CACHE_DIR": str(tmp_path / "cache")}


class Recording:
    """The real runner, with every argument list it ran."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.inner = SubprocessRunner(env=env)
        self.calls: list[list[str]] = []

    def run(self, args: list[str], *, timeout_s: float = 30, input: str | None = None,
            env: Mapping[str, str] | None = None) -> CommandResult:
        self.calls.append(list(args))
        return self.inner.run(args, timeout_s=timeout_s, input=input, env=env)


def test_the_probe_reads_what_the_clusters_slurm_conf_says(env) -> None:
    conf = slurm_conf_values(env["SLURM_CONF"])
    caps = probe(SubprocessRunner(env=env), slurm_conf=env["SLURM_CONF"])
    assert caps.problems == (), caps.problems
    version = env.get("SLURMKIT_SLURM_VERSION", "22.05")
    assert caps.version is not None and caps.version.startswith(version), (caps.version, version)
    assert caps.cluster_name == conf["ClusterName"]
    # tools/local-cluster: cgroup where cgroup v1's freezer is writable, else linuxproc
    assert caps.proctrack == conf["ProctrackType"].removeprefix("proctrack/") in ("cgroup", "linuxproc")
    assert caps.kill_wait_s == int(conf["KillWait"])
    assert caps.job_requeue is (conf["JobRequeue"] == "1")
    assert caps.task_plugins == (conf["TaskPlugin"].removeprefix("task/"),)
    assert caps.preempt_mode == conf["PreemptMode"]
    # FailedNode since 23.02 (22.05: none); no expedited requeue (25.11) on either; stepmgr
    # (24.05) is not enabled in the cluster's slurm.conf
    assert caps.failed_node_field is (version != "22.05")
    assert caps.expedited_requeue is False
    assert caps.requeue_arg == "--requeue" and caps.stepmgr is False and caps.requeue_delay_s is None
    assert caps.json_output is True  # 22.05: Debian's openapi/v0.0.38; 24.11: data_parser built in
    node_gres = {conf["Gres"]}
    assert node_gres == {"gpu:4"} and caps.gres == ("gpu",) and caps.typed_gres is False
    plugstack = os.path.join(os.path.dirname(env["SLURM_CONF"]), "plugstack.conf")
    assert not os.path.exists(plugstack) and caps.pyxis == "absent"
    # the probe agrees with the client's own view of the same controller
    client = SlurmClient(SubprocessRunner(env=env))
    assert client.config()["SLURM_VERSION"] == caps.version
    assert {n.gres for n in client.nodes()} == node_gres


def test_the_cache_answers_the_second_time_and_plan_prints_the_site(env) -> None:
    first = site_capabilities(env)
    path = cache_path(env)
    assert path is not None and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    recording = Recording(env)
    assert site_capabilities(env, runner=recording) == first and recording.calls == []
    res = subprocess.run([sys.executable, "-m", "slurmkit.plan", "+exp=tiny", "cluster=local_slurm"],
                         env={**env, "COLUMNS": "160"}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in res.stdout.splitlines() if line.count("│") == 4}
    assert rows["Slurm"] == first.version and rows["proctrack"] == first.proctrack
    assert rows["expedited requeue"] == "no" and rows["GRES"] == "gpu (untyped)"
    assert "no Slurm here" not in res.stdout


def test_a_submitted_job_carries_the_sites_capabilities(env, tmp_path) -> None:
    res = submit_cli(["+exp=tiny", "cluster=local_slurm", "job.nodes=1", "job.name=caps",
                      f"submit.run_root={tmp_path / 'runs'}"], env, str(tmp_path))
    assert res.returncode == 0, res.stderr + res.stdout
    assert "site probe" not in res.stderr, res.stderr  # it learned something: no warning
    job_id, run_dir = parse_submitted(res.stdout)
    subprocess.run(["scancel", job_id], env=env, check=True, timeout=60)
    wait_terminal(job_id, env)
    path = os.path.join(run_dir, CAPABILITIES_NAME)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    caps = read_run_dir_copy(run_dir, uid=submitter_uid(env))
    assert caps is not None and caps.version is not None \
        and caps.version.startswith(env.get("SLURMKIT_SLURM_VERSION", "22.05")), caps
    # The copy is the submitting user's cached probe (read as that user's file).
    cached = read_capabilities(cache_path(env), now=time.time(), max_age_s=None, uid=submitter_uid(env))
    assert cached is not None and caps == cached
