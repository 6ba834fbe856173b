"""A run directory someone else could change runs nothing (slurmkit/rundir.py, issue 12).

Real directories, real bash running the rendered batch script (srun faked), the real agent
entry point. The tests run as root in CI; another owner is made with chown to nobody (65534).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from typing import Any

import pytest

from slurmkit.cli.submit import freeze, frozen_text
from slurmkit.config import compose
from slurmkit.contract import CONFIG_SHA256, EXIT_NO_REQUEUE
from slurmkit.layout import config_digest
from slurmkit.render import build_jobspec, render_standalone, render_submitit_script
from slurmkit.rundir import RunDirError, check_config_digest, check_run_dir
from slurmkit.submit_checks import make_run_dir

NOBODY = 65534


def frozen_run(tmp_path: Any) -> tuple[str, Any]:
    cfg = compose(["+exp=tiny", "cluster=local_slurm"])
    run_dir = str(tmp_path / "root" / "tiny" / "run")
    make_run_dir(run_dir, str(tmp_path / "root"))
    freeze(cfg, run_dir)
    return run_dir, cfg


def test_submit_makes_the_run_directory_private_whatever_the_umask(tmp_path: Any) -> None:
    old = os.umask(0)
    try:
        run_dir, _ = frozen_run(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    check_run_dir(run_dir)  # config.yaml and layout.json pass as written


@pytest.mark.parametrize("damage, found", [
    (lambda d: os.chmod(d, 0o770), "writable by group or others (mode 0770)"),
    (lambda d: os.chmod(os.path.join(d, "config.yaml"), 0o666), "config.yaml is writable"),
    (lambda d: os.chown(os.path.join(d, "layout.json"), NOBODY, NOBODY), "owned by uid 65534"),
    (lambda d: os.chown(d, NOBODY, NOBODY), "owned by uid 65534"),
])
def test_a_run_directory_others_could_change_is_refused(tmp_path: Any, damage: Any,
                                                        found: str) -> None:
    run_dir, _ = frozen_run(tmp_path)
    damage(run_dir)
    with pytest.raises(RunDirError, match="Detected:.*Fix:") as exc:
        check_run_dir(run_dir)
    assert found in str(exc.value)


def test_a_linked_run_directory_or_config_is_refused(tmp_path: Any) -> None:
    run_dir, _ = frozen_run(tmp_path)
    link = str(tmp_path / "link")
    os.symlink(run_dir, link)
    with pytest.raises(RunDirError, match="symbolic link"):
        check_run_dir(link)
    cfg = os.path.join(run_dir, "config.yaml")
    os.rename(cfg, cfg + ".real")
    os.symlink(cfg + ".real", cfg)
    with pytest.raises(RunDirError, match="config.yaml is a symbolic link"):
        check_run_dir(run_dir)


def test_a_config_changed_after_submission_is_refused(tmp_path: Any) -> None:
    run_dir, cfg = frozen_run(tmp_path)
    digest = config_digest(frozen_text(cfg))
    check_config_digest(run_dir, digest)  # as frozen
    with open(os.path.join(run_dir, "config.yaml"), "ab") as f:
        f.write(b"\n# job.command: [touch, /tmp/pwned]\n")
    with pytest.raises(RunDirError, match="submitted with") as exc:
        check_config_digest(run_dir, digest)
    assert digest[:16] in str(exc.value)


def test_the_agent_runs_nothing_from_a_changed_config(tmp_path: Any) -> None:
    from slurmkit.launch.agent import agent_main

    run_dir, cfg = frozen_run(tmp_path)
    digest = config_digest(frozen_text(cfg))
    with open(os.path.join(run_dir, "config.yaml"), "ab") as f:
        f.write(b"\n")
    # returns before it reads the node context (which this environment lacks) or the config
    assert agent_main(run_dir, env={CONFIG_SHA256: digest}) == EXIT_NO_REQUEUE
    os.chmod(run_dir, 0o777)
    assert agent_main(run_dir, env={}) == EXIT_NO_REQUEUE


def _run(script: str, tmp_path: Any) -> subprocess.CompletedProcess[str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in (("srun", 'echo fake-srun "$@"'), ("scontrol", "echo node1")):
        (bindir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bindir / name).chmod(0o755)
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    return subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)


def test_the_batch_script_checks_the_run_directory_before_any_srun(tmp_path: Any) -> None:
    run_dir, cfg = frozen_run(tmp_path)
    spec = build_jobspec(cfg, run_dir, [])
    for script in (render_submitit_script(spec, python="python3"),
                   render_standalone(spec, str(tmp_path / "x.sbatch"), python="python3")):
        os.chmod(run_dir, 0o700)
        ok = _run(script, tmp_path)
        assert ok.returncode == 0 and "fake-srun" in ok.stdout, ok.stderr
        os.chmod(run_dir, 0o775)
        refused = _run(script, tmp_path)
        assert refused.returncode == EXIT_NO_REQUEUE and "fake-srun" not in refused.stdout
        assert "Detected:" in refused.stderr and run_dir in refused.stderr


def test_the_submitted_script_carries_the_config_digest(tmp_path: Any) -> None:
    """submit's dry run prints the script it would submit: the digest of config.yaml in it."""
    res = subprocess.run([sys.executable, "-m", "slurmkit.submit", "+exp=tiny",
                          "cluster=local_slurm", "submit.dry_run=true",
                          f"submit.run_root={tmp_path}"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(f"export {CONFIG_SHA256}=")]
    assert len(lines) == 1 and len(lines[0].split("=", 1)[1]) == 64, lines
