"""slurmkit installs like any tool: a wheel built from the checkout, installed into a fresh virtual
environment outside it, runs a dry run and a local job from another directory, with the configs
and templates it carries as package data; then a newcomer's walk through the README's daily loop
with that install (status, runs, logs with the trainer's step lines, report, a site profile in
SLURMKIT_CONF_DIR and the #SBATCH lines it renders, clean), and on the local cluster with a site
profile of its own: a job submitted, cancelled with a checkpoint and resumed to its end.

The environment borrows the dependencies already installed for the test run (a read-only view of
this interpreter's site-packages, minus slurmkit itself, on its path), so pip resolves the
wheel's declared requirements against real installs without downloading torch again; `pip check`
then proves every declared requirement is met there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from slurmkit.runview import last_json_line
from tests.integration.helpers import parse_submitted, run_as_submitter, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
IGNORE = (".git", ".venv", "build", "dist", "runs", "outputs", "multirun", "tests", "__pycache__",
          "*.egg-info", ".pytest_cache", ".mypy_cache", ".hypothesis", ".whl", ".gl")


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd} exited {res.returncode}:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return res


def _source_copy(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked, plus new files not ignored), so the build
    writes nothing into the checkout and no stale build/ output can leak into the wheel."""
    if (REPO / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, check=True, timeout=120).stdout
        for rel in filter(None, out.decode().split("\0")):
            src = REPO / rel
            if rel.startswith("tests/") or not src.is_file():
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    else:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(*IGNORE), dirs_exist_ok=True)
    return dest


def _dependency_view(dest: Path) -> Path:
    """Links to everything this interpreter has installed except slurmkit (and .pth hooks)."""
    dest.mkdir()
    for site in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        for entry in Path(site).iterdir():
            name = entry.name.lower()
            if "slurmkit" in name or name.endswith(".pth") or (dest / entry.name).exists():
                continue
            (dest / entry.name).symlink_to(entry)
    return dest


def test_wheel_installs_and_runs_outside_the_checkout(cluster_env, tmp_path: Path) -> None:
    py = sys.executable
    src = _source_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    _run([py, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
         cwd=tmp_path)
    (wheel,) = wheels.glob("slurmkit-*.whl")

    venv = tmp_path / "venv"
    _run([py, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)  # this pip installs into it
    vpy = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "--python", vpy]
    site = _run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
    deps = _dependency_view(tmp_path / "deps")
    Path(site.stdout.strip(), "borrowed_deps.pth").write_text(f"{deps}\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "SLURM", "SLURMKIT_"))}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    _run([*pip, "install", "-q", str(wheel)], cwd=tmp_path, env=env)
    _run([*pip, "check"], cwd=tmp_path, env=env)

    work = tmp_path / "elsewhere"  # neither the checkout nor the source copy
    work.mkdir()
    where = _run([vpy, "-c", "import json, slurmkit, slurmkit.resources as r; print(json.dumps("
                  "[slurmkit.__file__, str(r.packaged('conf')), str(r.packaged('sbatch_templates'))]))"],
                 cwd=work, env=env)
    for path in json.loads(where.stdout):
        assert Path(path).resolve().is_relative_to(venv.resolve()), (path, venv)

    slurmkit = str(venv / "bin" / "slurmkit")
    assert "supervise" in _run([slurmkit, "--help"], cwd=work, env=env).stdout
    dry = _run([slurmkit, "submit", "+exp=tiny", "submit.dry_run=true"], cwd=work, env=env)
    assert "#SBATCH" in dry.stdout and "--job-name=tiny" in dry.stdout
    assert f"{vpy} -u -m submitit.core._submit" in dry.stdout  # jobs run the environment's Python
    assert not (work / "runs").exists()

    job = _run([slurmkit, "submit", "+exp=tiny", "cluster=local", "submit.wait=true",
                "train.steps=6", "train.ckpt_interval_steps=3", f"submit.run_root={work / 'runs'}"],
               cwd=work, env=env, timeout=900)
    assert re.search(r"job \S+ completed", job.stdout + job.stderr), job.stdout + job.stderr
    (run_dir,) = (work / "runs" / "tiny").iterdir()
    events = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert any(e["event"] == "train_finished" and e["step"] == 6 for e in events), events
    assert any(e["event"] == "end" and e.get("status") == "completed" for e in events), events
    assert any(e["event"] == "ckpt_saved" for e in events), events  # the store runs (numpy) too
    assert all((run_dir / "logs" / f"rank{r}.log").is_file() for r in range(4))

    # The newcomer's walk on from there, as the README's "daily loop" has it, with this wheel:
    # status (exit 0 for a completed run), runs, logs (the trainer's step lines), report, clean.
    status = _run([slurmkit, "status", str(run_dir)], cwd=work, env=env)
    assert "completed" in status.stdout and "elapsed" in status.stdout, status.stdout
    listed = _run([slurmkit, "runs", "--root", str(work / "runs")], cwd=work, env=env)
    assert str(run_dir) in listed.stdout.replace("\n", ""), listed.stdout
    logs = _run([slurmkit, "logs", str(run_dir), "--rank", "0"], cwd=work, env=env)
    assert re.search(r"step 6/6 loss \d+\.\d+", logs.stdout), logs.stdout[-2000:]
    _run([slurmkit, "report", str(run_dir)], cwd=work, env=env)
    assert (run_dir / "report.html").is_file()
    # A site profile in SLURMKIT_CONF_DIR, outside the installed package, and what it renders
    site = work / "site-conf"
    (site / "cluster").mkdir(parents=True)
    (site / "cluster" / "mysite.yaml").write_text(
        "name: mysite\nkind: slurm\npartition: gpu\naccount: my-project\ngpus_per_node: 8\n"
        "cpus_per_node: 112\nmem_gb_per_node: 1000\n")
    site_env = {**env, "SLURMKIT_CONF_DIR": str(site)}
    rendered = _run([slurmkit, "submit", "+exp=tiny", "cluster=mysite", "submit.dry_run=true"], cwd=work,
                    env=site_env)
    assert "#SBATCH --partition=gpu" in rendered.stdout and "#SBATCH --account=my-project" in rendered.stdout
    info = _run([slurmkit, "submit", "--info"], cwd=work, env=site_env)
    assert str(site) in info.stdout and "mysite" in info.stdout, info.stdout
    # and the run is removed when done with
    gone = _run([slurmkit, "clean", "--root", str(work / "runs"), "--yes"], cwd=work, env=env)
    assert "removed 1 run(s)" in gone.stdout and not run_dir.exists(), gone.stdout

    # The site: a profile for the local cluster in the user's SLURMKIT_CONF_DIR, a job submitted
    # with it from the wheel's install (by the cluster's ordinary user in CI), stopped with a
    # checkpoint, then resumed to its end: the README's way back in after a cancel.
    (site / "cluster" / "localsite.yaml").write_text(
        "name: localsite\nkind: slurm\npartition: debug\ncpus_per_node: 2\nmem_gb_per_node: 3.9\n"
        "kill_wait_s: 10\nmax_nodes: 4\n")
    cenv = {**env, "SLURM_CONF": cluster_env["SLURM_CONF"], "SLURMKIT_CONF_DIR": str(site)}
    sub = run_as_submitter([slurmkit, "submit", "+exp=tiny", "model=micro", "cluster=localsite", "job.name=walk",
                            "train.steps=40", "+job.env.SLURMKIT_STEP_DELAY_S=0.3", "supervisor.node_timeout_s=20",
                            f"submit.run_root={work / 'siteruns'}"], cenv, str(work))
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id, site_run = parse_submitted(sub.stdout)
    metrics = Path(site_run, "metrics.jsonl")
    wait_for(lambda: (last_json_line(str(metrics)) or {}).get("step", 0) >= 5, 600, "the site job's step 5")
    stop = run_as_submitter([slurmkit, "cancel", site_run, "--checkpoint", "--timeout-s", "240"], cenv, str(work),
                            timeout_s=400)
    assert stop.returncode == 0 and "final checkpoint at step" in stop.stdout, stop.stdout + stop.stderr
    back = run_as_submitter([slurmkit, "resume", site_run, "--wait", "--timeout-s", "600"], cenv, str(work),
                            timeout_s=700)
    assert back.returncode == 0 and "completed" in back.stdout, back.stdout + back.stderr
    ledger = [json.loads(line) for line in Path(site_run, "ledger.jsonl").read_text().splitlines()]
    (resumed,) = [e for e in ledger if e["event"] == "submitted" and e["source"] == "resume"]
    stopped = next(e for e in ledger if e["event"] == "train_stopped")
    assert resumed["resumes"] == job_id and [e["step"] for e in ledger if e["event"] == "ckpt_restored"][:1] == \
        [stopped["step"]], ledger[-10:]
    assert json.loads(Path(site_run, "final.json").read_text())["step"] == 40
    assert run_as_submitter([slurmkit, "status", site_run], cenv, str(work)).returncode == 0
