"""The MTTR benchmark still runs end to end on the local cluster: one real SIGKILL, measured under
slurmkit and under torchrun's elastic agent (the ft_launcher baseline, pointed at a path that does
not exist, must be reported unavailable with its reason, never measured).

No timing thresholds: the figures only have to exist and be positive, and the jobs it used must
be gone afterwards. The torchrun run adds about a minute (start, 13 steps, restart, resume). Both on the micro model:
what is measured is the restart, not the step's compute.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from types import ModuleType

import pytest

from tests.integration.helpers import slurm_env, wait_terminal

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "tools", "bench", "mttr.py")


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mttr_bench_smoke", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mttr_bench_smoke"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(720)
def test_mttr_bench_measures_a_rank_crash(cluster_env, tmp_path) -> None:
    env_path = tmp_path / "env.json"
    env_path.write_text(json.dumps(cluster_env))
    env = {**slurm_env(cluster_env), "TMPDIR": str(tmp_path)}
    no_ft = tmp_path / "no-such-dir" / "ft_launcher"
    res = subprocess.run([sys.executable, BENCH, "--classes", "crash", "--baselines", "torchrun,ft",
                          "--ft-launcher", str(no_ft), "--skip-goodput", "--model", "micro", "--cluster-env", str(env_path)],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=660)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("RESULT "), res.stdout + res.stderr
    assert sum(ln.startswith("RESULT") for ln in lines) == 1, res.stdout
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert set(fields) == {"crash_detect_s", "crash_resume_s", "crash_baseline_resume_s",
                           "crash_torchrun_detect_s", "crash_torchrun_resume_s", "mttr_vs_torchrun_crash",
                           "crash_ft_detect_s", "crash_ft_resume_s", "mttr_vs_ft_crash", "ft_available",
                           "goodput", "warm_standby"}, fields
    assert fields["warm_standby"] == "yes" and "slurmkit ranks from warm standbys" in res.stdout, fields
    detect, resume = float(fields["crash_detect_s"]), float(fields["crash_resume_s"])
    assert detect > 0 and resume > detect, (detect, resume, res.stdout)
    assert fields["crash_baseline_resume_s"] == "na" and fields["goodput"] == "na", fields
    # The supervisor classified the SIGKILL as a rank crash and restarted in the allocation.
    run = re.search(r"^crash\s+slurmkit\s+#1 .* job (\d+) rank_crash/restart\s", res.stdout, re.M)
    assert run, res.stdout
    # torchrun noticed the killed worker and restarted every rank inside the same allocation.
    t_detect, t_resume = float(fields["crash_torchrun_detect_s"]), float(fields["crash_torchrun_resume_s"])
    assert 0 <= t_detect < t_resume, (t_detect, t_resume, res.stdout)
    assert float(fields["mttr_vs_torchrun_crash"]) == pytest.approx(t_resume / resume, rel=0.02), fields
    tr = re.search(r"^crash\s+torchrun\s+#1 .* job (\d+) torchrun restart in the allocation\s",
                   res.stdout, re.M)
    assert tr, res.stdout
    # ft_launcher: reported unavailable, with why, and not measured.
    assert fields["ft_available"] == "no", fields
    ft_keys = ("crash_ft_detect_s", "crash_ft_resume_s", "mttr_vs_ft_crash")
    assert {fields[k] for k in ft_keys} == {"na"}, fields
    assert f"baseline ft: unavailable: ft_launcher not found ({no_ft})" in res.stdout, res.stdout
    assert not re.search(r"^crash\s+ft\s+#", res.stdout, re.M), res.stdout
    for job in (run.group(1), tr.group(1)):
        assert wait_terminal(job, env, timeout_s=120) in ("CANCELLED", "COMPLETED")
    # The run directories were removed (no --keep).
    assert not [p for p in os.listdir(tmp_path) if p.startswith("mttr-")], os.listdir(tmp_path)


def test_launcher_failure_lines_are_read_from_both_log_formats(tmp_path) -> None:
    """torch's elastic agent (glog-style stamp, no year) and ft_launcher's ``[date time,ms]``, as
    the two launchers printed them on the local cluster; lines before the fault do not count."""
    m = bench()
    at = time.mktime((2026, 12, 3, 6, 45, 33, 0, 0, -1))
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "torchrun_2_node0.log").write_text(
        "W1203 06:45:26.488000 21336 torch/distributed/run.py:874] *****\n"
        "[rank2]: RuntimeError: ... Connection closed by peer [127.0.0.1]:20901.\n"
        "W1203 06:45:33.263000 21336 torch/distributed/elastic/multiprocessing/api.py:1028] "
        "Sending process 21371 closing signal SIGTERM\n"
        "E1203 06:45:33.312000 21336 torch/distributed/elastic/multiprocessing/api.py:1002] "
        "failed (exitcode: -9) local_rank: 1 (pid: 21372) of binary: /venv/bin/python\n")
    (logs / "ft_16_node1.log").write_text(
        "[2026-12-03 06:45:34,280] [ERROR] [ft_launcher19705@vm] failed (exitcode: -9) local_rank: 1 "
        "(pid: 19713) of binary: /venv/bin/python3\n"
        "[2026-12-03 06:45:34,280] [INFO] [ft_launcher19705@vm] [default] Worker group UNHEALTHY. "
        "1/1 attempts left; will restart worker group\n")
    assert m.launcher_failure_after(str(tmp_path), "torchrun", at) == pytest.approx(at + 0.263)
    assert m.launcher_failure_after(str(tmp_path), "ft", at) == pytest.approx(at + 1.280)
    assert m.launcher_failure_after(str(tmp_path), "torchrun", at + 1.0) is None
    assert m.launcher_time("2026-12-03 06:45:34,280 rank2 slurmkit.train INFO resumed", 2026) is None
