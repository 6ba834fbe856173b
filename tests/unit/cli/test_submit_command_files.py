"""submit resolves job.command's script against the directory it runs in, for a single run, a
dry run, every variant of a sweep and the plan; a missing one is refused before anything exists."""

from __future__ import annotations

import os

import pytest
from rich.console import Console

from slurmkit.cli import plan, submit
from slurmkit.config import load_frozen
from slurmkit.errors import ConfigError

BASE = ["+exp=tiny", "cluster=local_slurm"]


def _run(argv: list[str], tmp_path, cwd) -> tuple[int, str]:
    path = tmp_path / "out.txt"
    with open(path, "w") as f:
        console = Console(file=f, width=400)
        try:
            code = submit.run([*argv, f"submit.run_root={tmp_path / 'runs'}"], dict(os.environ), console,
                              console, cwd=str(cwd))
        except ConfigError as exc:
            return -1, str(exc)
    return code, path.read_text()


@pytest.fixture
def project(tmp_path):
    """The user's project directory, with its script; submit runs from here."""
    d = tmp_path / "project"
    d.mkdir()
    (d / "train.py").write_text("print('training')\n")
    return d


def test_the_frozen_config_carries_the_absolute_script(tmp_path, project) -> None:
    code, _ = _run([*BASE, "job.command=[torchrun,'--nproc-per-node=2',train.py,'--steps=3']",
                    "submit.emit=sbatch"], tmp_path, project)
    assert code == 0
    (run_dir,) = list((tmp_path / "runs" / "tiny").iterdir())
    cfg = load_frozen(str(run_dir / "config.yaml"))  # its digest in layout.json is checked on load
    assert cfg.job.command == ["torchrun", "--nproc-per-node=2", f"{project}/train.py", "--steps=3"]


@pytest.mark.parametrize("extra", [["cluster.kind=slurm"], ["submit.emit=sbatch"], ["submit.dry_run=true"]])
def test_a_missing_script_is_refused_and_nothing_is_written(tmp_path, project, extra) -> None:
    code, text = _run([*BASE, "job.command=[python,-u,trian.py]", *extra], tmp_path, project)
    assert code == -1
    assert f"{project}/trian.py does not exist" in text and f"submit ran in, {project}" in text
    assert "Requirement: " in text and "Fix: " in text
    assert not (tmp_path / "runs").exists(), "a refused submission writes nothing"


def test_a_dry_run_with_the_script_there_passes(tmp_path, project, capsys) -> None:
    code, _ = _run([*BASE, "job.command=[python,train.py]", "submit.dry_run=true"], tmp_path, project)
    assert code == 0 and "#SBATCH" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()


def test_a_secret_is_still_refused_as_a_secret_first(tmp_path, project) -> None:
    """The path check quotes the argument it refuses: the secret checks, which never echo, come first."""
    code, text = _run([*BASE, "job.command=[python,'AKIAIOSFODNN7EXAMPLE']", "cluster.kind=slurm"],
                      tmp_path, project)
    assert code == -1 and "AKIAIOSFODNN7EXAMPLE" not in text and "does not exist" not in text


def test_every_variant_of_a_sweep_carries_the_absolute_script(tmp_path, project) -> None:
    code, _ = _run(["-m", *BASE, "train.lr=1e-3,3e-3", "job.command=[python,train.py]", "submit.emit=sbatch"],
                   tmp_path, project)
    assert code == 0
    (sweep_dir,) = list((tmp_path / "runs" / "tiny").iterdir())
    for index in ("0", "1"):
        cfg = load_frozen(str(sweep_dir / index / "config.yaml"))
        assert cfg.job.command == ["python", f"{project}/train.py"]


def test_a_sweep_with_a_missing_script_is_refused_whole(tmp_path, project) -> None:
    code, text = _run(["-m", *BASE, "train.lr=1e-3,3e-3", "job.command=[python,gone.py]",
                       "submit.emit=sbatch"], tmp_path, project)
    assert code == -1 and "variant 0" in text and f"{project}/gone.py does not exist" in text
    assert not (tmp_path / "runs").exists()


def test_the_plan_refuses_a_missing_script_too(project) -> None:
    path = project / "plan.txt"
    with open(path, "w") as f:
        code = plan.main([*BASE, "job.command=[python,gone.py]"], console=Console(file=f, width=400),
                         env={}, site=lambda env: None, cwd=str(project))
    assert code == 2 and f"{project}/gone.py does not exist" in path.read_text()
    with open(path, "w") as f:
        code = plan.main([*BASE, "job.command=[python,train.py]"], console=Console(file=f, width=400),
                         env={}, site=lambda env: None, cwd=str(project))
    assert code == 0
