"""submit's front door: bad input fails before anything is created or submitted."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
from rich.console import Console

from slurmkit.cli import submit
from slurmkit.config import compose


def _run(argv: list[str], tmp_path) -> tuple[int, str]:
    out = Console(file=open(os.devnull, "w"))
    err_path = tmp_path / "err.txt"
    with open(err_path, "w") as f:
        err = Console(file=f, width=400)
        try:
            code = submit.run([*argv, f"submit.run_root={tmp_path / 'runs'}"], os.environ, out, err)
        except Exception as exc:  # main() maps these to exit codes; keep the message for asserts
            code, text = -1, str(exc)
            return code, text
    return code, err_path.read_text()


@pytest.mark.parametrize("argv,fragments", [
    (["+exp=nope"], ["exp='nope'", "tiny", "llama70b", "llama405b"]),
    (["+exp=tiny", "cluster=nowhere"], ["cluster='nowhere'", "dgx_h100", "local_slurm"]),
    (["+exp=tiny", "job.nodes=0"], ["job.nodes=0", "at least 1 node"]),
    (["+exp=llama70b", "cluster=dgx_h100", "job.gpus_per_node=16"], ["16", "at most 8 GPUs per node"]),
    (["+exp=tiny", "job.time=25:99:99x"], ["25:99:99x"]),
    (["+exp=tiny", "job.nodez=3"], ["nodez"]),
    (["+exp=tiny", "cluster=local_slurm", "job.nodes=9"], ["9 nodes", "at most 4 nodes"]),
    (["+exp=tiny", "supervisor.heartbeat_timeout_s=900"], ["heartbeat_timeout_s=900", "pg_timeout_s=600"]),
])
def test_bad_input_fails_clearly_and_creates_nothing(argv, fragments, tmp_path) -> None:
    # Slurm, and a partition as a site profile names one (else cluster=auto refuses a 2-node job first)
    code, text = _run([*argv, "cluster.kind=slurm", "cluster.partition=debug"] if "cluster=nowhere" not in argv
                      else argv, tmp_path)
    assert code == -1, "bad input must not be submitted"
    for frag in fragments:
        assert frag in text, (frag, text)
    assert "Fix" in text or "Available" in text or "one of" in text
    assert not (tmp_path / "runs").exists(), "nothing may be written for a refused submission"


def test_main_exits_2_with_message_on_config_error(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "slurmkit.submit", "+exp=tiny", "job.nodes=-1",
                          f"submit.run_root={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "Detected: job.nodes=-1" in res.stderr and "Fix:" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_auto_picks_local_without_a_controller_and_slurm_with_one() -> None:
    cfg = compose(["+exp=tiny"])
    assert cfg.cluster.kind == "auto"
    assert submit.resolve_cluster(cfg, {}, probe=lambda env: False).cluster.kind == "local"
    assert submit.resolve_cluster(cfg, {}, probe=lambda env: True).cluster.kind == "slurm"
    assert submit.slurm_reachable({"PATH": "/nonexistent"}) is False


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path, capsys) -> None:
    code, _ = _run(["+exp=llama70b", "cluster=dgx_h100", "submit.dry_run=true"], tmp_path)
    assert code == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=8" in out and "-m submitit.core._submit" in out
    assert not (tmp_path / "runs").exists()


def test_emit_sbatch_writes_a_standalone_script_and_frozen_config(tmp_path) -> None:
    code, _ = _run(["+exp=tiny", "cluster=local_slurm", "submit.emit=sbatch"], tmp_path)
    assert code == 0
    (run_dir,) = list((tmp_path / "runs" / "tiny").iterdir())
    script = (run_dir / "job.sbatch").read_text()
    assert "-m slurmkit.launch" in script and "#SBATCH --nodes=2" in script
    assert subprocess.run(["bash", "-n", str(run_dir / "job.sbatch")]).returncode == 0
    frozen = compose(["+exp=tiny", "cluster=local_slurm"])
    from slurmkit.config import load_frozen

    assert load_frozen(str(run_dir / "config.yaml")).job == frozen.job


def test_git_commit_names_the_code_submit_runs_from(tmp_path) -> None:
    from slurmkit.cli.submit import git_commit

    assert git_commit(str(tmp_path)) == ""  # no repository
    run = functools.partial(subprocess.run, cwd=str(tmp_path), check=True, capture_output=True)
    run(["git", "init", "-q"])
    (tmp_path / "train.py").write_text("print(1)\n")
    run(["git", "add", "train.py"])
    run(["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"])
    sha = run(["git", "rev-parse", "--short=12", "HEAD"], text=True).stdout.strip()
    assert git_commit(str(tmp_path)) == sha
    (tmp_path / "train.py").write_text("print(2)\n")
    assert git_commit(str(tmp_path)) == f"{sha}-dirty"


@pytest.mark.parametrize("extra, refused", [
    ([], True),  # a login node, no site profile: no partition, no account, 2 nodes
    (["job.nodes=1"], False),  # one node may try
    (["cluster.partition=gpu"], False), (["cluster.account=proj"], False),
    (["cluster=local_slurm"], False),  # a site profile
])
def test_auto_without_a_site_profile_refuses_a_multi_node_job(extra, refused, tmp_path) -> None:
    argv = ["+exp=tiny", "cluster.kind=slurm", *extra, "submit.dry_run=true"]
    code, text = _run(argv, tmp_path)
    if refused:
        assert code == -1 and "no site profile" in text and "SLURMKIT_CONF_DIR" in text, text
    else:
        assert code == 0, text
