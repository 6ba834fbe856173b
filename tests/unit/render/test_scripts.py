"""Rendering is pure: the scripts users submit are pinned by golden files.

Regenerate after an intended change with SLURMKIT_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest

from slurmkit.config import compose
from slurmkit.errors import ConfigError
from slurmkit.render import build_jobspec, render_standalone, render_submitit_script

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "golden")
RUN_DIR = "/shared/runs/golden/20260101-000000-abcd"


def _spec(overrides: list[str], run_dir: str = RUN_DIR, srun: list[str] | None = None):
    cfg = compose(overrides)
    return build_jobspec(cfg, run_dir, ["--cpu-bind=none"] if srun is None else srun)


def _check(name: str, text: str) -> None:
    path = os.path.join(GOLDEN, name)
    if os.environ.get("SLURMKIT_UPDATE_GOLDEN") == "1":
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        expected = f.read()
    assert text == expected, f"rendered script differs from {path} (SLURMKIT_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("name,overrides", [
    ("tiny_local_slurm", ["+exp=tiny", "cluster=local_slurm"]),
    ("llama70b_dgx_h100", ["+exp=llama70b", "cluster=dgx_h100"]),
    ("llama8b_container", ["+exp=llama8b", "cluster=dgx_h100_container"]),
])
def test_submitit_script_matches_golden(name: str, overrides: list[str]) -> None:
    _check(f"{name}.submitit.sbatch", render_submitit_script(_spec(overrides), python="python3"))


@pytest.mark.parametrize("name,overrides", [
    ("tiny_local_slurm", ["+exp=tiny", "cluster=local_slurm"]),
    ("llama70b_dgx_h100", ["+exp=llama70b", "cluster=dgx_h100"]),
])
def test_standalone_script_matches_golden(name: str, overrides: list[str]) -> None:
    spec = _spec(overrides)
    _check(f"{name}.standalone.sbatch",
           render_standalone(spec, os.path.join(RUN_DIR, "job.sbatch"), python="python3"))


def test_llama70b_script_has_every_multinode_option() -> None:
    text = render_submitit_script(_spec(["+exp=llama70b", "cluster=dgx_h100", "job.exclude=['gpu[001-003]',gpu010]",
                                         "supervisor.spare_nodes=1"]), python="python3")
    for flag in ("--nodes=9", "--ntasks-per-node=1", "--gpus-per-node=8",
                 "--time=2-00:00:00", "--signal=B:USR1@300", "--requeue", "--open-mode=append",
                 "--exclusive", "--exclude='gpu[001-003,010]'", "--dependency=singleton",
                 "--job-name=llama70b", "--partition=batch", "--account=llm-pretrain", "--qos=normal",
                 "--cpu-bind=none", "module load cuda/12.4 nccl/2.21"):
        assert flag in text, flag
    # exclusive: the job holds whole nodes; --cpus-per-task=224 would fail with CoreSpecCount
    assert "--cpus-per-task" not in text


def test_cpus_per_task_only_where_asked_or_sharing_nodes() -> None:
    given = render_submitit_script(_spec(["+exp=llama70b", "cluster=dgx_h100", "job.cpus_per_task=200"]),
                                   python="python3")
    assert "--cpus-per-task=200" in given
    shared = render_submitit_script(_spec(["+exp=llama70b", "cluster=dgx_h100", "cluster.exclusive=false"]),
                                    python="python3")
    assert "--cpus-per-task=224" in shared  # a shared node: ask for the CPUs the ranks need


def test_container_profile_passes_pyxis_flags() -> None:
    text = render_submitit_script(_spec(["+exp=llama8b", "cluster=dgx_h100_container"]), python="python3")
    assert "--container-image=nvcr.io/nvidia/pytorch:24.05-py3" in text
    assert "--container-mounts=/lustre/fsw:/lustre/fsw,/raid/scratch:/nvme" in text


def _run_script_with_fake_srun(tmp_path, script: str) -> subprocess.CompletedProcess[str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "srun"
    fake.write_text("#!/bin/bash\necho fake-srun \"$@\"\n")
    fake.chmod(0o755)
    scontrol = bindir / "scontrol"
    scontrol.write_text("#!/bin/bash\nprintf 'node1\\nnode2\\n'\n")
    scontrol.chmod(0o755)
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    return subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)


HOSTILE = 'x"; touch {p}; "$(touch {p})`touch {p}`'


def test_hostile_values_render_harmless(tmp_path) -> None:
    """Values from the config end up in a shell script: every one must be quoted."""
    pwned = tmp_path / "pwned"
    evil = HOSTILE.format(p=pwned)
    run_dir = str(tmp_path / f"runs/a b'{evil}")
    cfg = compose(["+exp=tiny", "cluster=local_slurm", f"+job.env.EVIL='{evil}'"])
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, container_image=evil, container_mounts=[evil]))
    # build_jobspec refuses these as Slurm names (test_hostile.py); past that check,
    # rendering must still quote them.
    spec = dataclasses.replace(build_jobspec(cfg, run_dir, []), name=evil, partition=evil,
                               account=evil, gpu_type=evil, reservation=evil, wckey=evil,
                               switches=evil)
    os.makedirs(run_dir, mode=0o700)  # the script refuses to run from a missing run directory
    for script in (render_submitit_script(spec, python="python3"),
                   render_standalone(spec, str(tmp_path / "job.sbatch"), python="python3")):
        d = tmp_path / f"s{abs(hash(script))}"
        d.mkdir()
        res = _run_script_with_fake_srun(d, script)
        assert res.returncode == 0, res.stderr
        assert res.stdout.count("fake-srun") == 2, res.stdout  # one step per node
        assert not pwned.exists(), "a config value was executed by the shell"


def test_hostile_job_name_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ConfigError) as exc:
        compose(["+exp=tiny", 'job.name=x"; touch /tmp/pwned; "'])
    assert "job.name" in str(exc.value) and "Fix:" in str(exc.value)


def test_a_dry_run_renders_on_a_machine_without_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit's executor refuses to exist without srun; a dry run only renders the script
    (a laptop, CI without Slurm), so it must not need one."""
    import shutil

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "srun" else real(name, *a, **k))
    text = render_submitit_script(_spec(["+exp=tiny"]), python="python3")
    assert "#SBATCH --nodes=" in text and "srun --unbuffered" in text
