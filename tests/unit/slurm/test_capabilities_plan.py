"""What `python -m slurmkit.plan` prints about the site, and what submit freezes into the run
directory (capabilities.json), without a Slurm controller."""

from __future__ import annotations

import dataclasses
import io
import json
import os

from rich.console import Console

from slurmkit.cli import plan, submit
from slurmkit.slurm.capabilities import CAPABILITIES_NAME, probe
from tests.unit.slurm.test_capabilities import CONFIG_2205, CONFIG_2511, NODES_TYPED, site


def run_plan(site_fn) -> tuple[int, str]:
    out = io.StringIO()
    code = plan.main(["+exp=tiny", "cluster=local_slurm"], console=Console(file=out, width=200),
                     env={}, site=site_fn)
    return code, out.getvalue()


def test_no_slurm_is_one_line_after_the_memory_plan() -> None:
    code, out = run_plan(lambda env: None)
    assert code == 0 and "slurmkit plan: tiny on local_slurm" in out and "fits" in out
    assert out.rstrip().endswith("no Slurm here: local executor") and "capability" not in out


def test_the_site_table_of_a_2205_site() -> None:
    caps = probe(site(CONFIG_2205))
    code, out = run_plan(lambda env: caps)
    assert code == 0 and "slurmkit plan: tiny on local_slurm" in out
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in out.splitlines() if line.count("│") == 4}
    assert rows["Slurm"] == "22.05.8" and rows["--json output"] == "yes"
    assert rows["sacct FailedNode"] == "no" and rows["JobRequeue"] == "0"
    assert rows["expedited requeue"] == "no" and rows["requeue hold"].startswith("~121 s")
    assert rows["KillWait"] == "10 s" and rows["proctrack"] == "linuxproc"
    assert rows["GRES"] == "gpu (untyped)" and rows["pyxis"] == "absent"


def test_the_site_table_of_a_2511_site_names_the_sbatch_argument() -> None:
    caps = probe(site(CONFIG_2511, nodes=NODES_TYPED))
    code, out = run_plan(lambda env: caps)
    assert code == 0
    assert "enabled" in out and "--requeue=expedite" in out and "gpu:h100, nic:mlx5 (typed)" in out
    assert "cgroup" in out and "every process of the job ends with it" in out


def test_slurm_text_is_printed_literally_and_a_failed_probe_does_not_fail_the_plan() -> None:
    caps = dataclasses.replace(probe(site(CONFIG_2205)), cluster_name="[bold red]x[/]",
                               problems=("scontrol: [/] broken\nsecond line",))
    code, out = run_plan(lambda env: caps)
    assert code == 0 and "cluster [bold red]x[/]" in out and "scontrol: [/] broken" in out
    assert "second line" not in out

    def broken(env):
        raise OSError("no such thing [red]")

    code, out = run_plan(broken)
    assert code == 0 and "site: the probe failed: no such thing [red]" in out


def test_submit_freezes_unknown_capabilities_with_a_warning_when_slurm_is_absent(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    empty = tmp_path / "bin"
    empty.mkdir()
    err = io.StringIO()
    env = {"PATH": str(empty), "SLURMKIT_CACHE_DIR": str(tmp_path / "cache")}
    submit.freeze_site(str(run_dir), env, Console(file=err, width=400))
    text = err.getvalue()
    assert "warning" in text and "Detected:" in text and "Requirement:" in text and "Fix:" in text
    assert "not found on PATH" in text
    with open(run_dir / CAPABILITIES_NAME) as f:
        data = json.load(f)
    assert data["version"] is None and data["pyxis"] == "unknown"
    assert oct(os.stat(run_dir / CAPABILITIES_NAME).st_mode & 0o777) == "0o644"
    assert not (tmp_path / "cache").exists()  # nothing learned, nothing cached
