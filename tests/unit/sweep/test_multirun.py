"""Sweeps: Hydra's multirun syntax -> variants -> one job array, with nothing submitted half-way."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from rich.console import Console

from slurmkit.cli import submit
from slurmkit.config import load_frozen
from slurmkit.errors import ConfigError, SlurmkitError
from slurmkit.launch.context import node_context, task_run_dir
from slurmkit.render import render_standalone
from slurmkit.supervise.exits.requeue import job_ref
from slurmkit.sweep import expand, load_sweep, split_multirun
from slurmkit.sweep.plan import plan_sweep

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "golden")
SWEEP = ["+exp=tiny", "cluster=local_slurm", "train.lr=1e-3,3e-3", "train.steps=20,40"]


def _fake_bin(tmp_path, name: str, body: str) -> str:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    path = d / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(d)


def _run(argv: list[str], tmp_path, env: dict[str, str] | None = None) -> tuple[int, str]:
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as f:
        console = Console(file=f, width=400)
        code = submit.run([*argv, f"submit.run_root={tmp_path / 'runs'}"], env or dict(os.environ),
                          console, console)
    return code, out_path.read_text()


# --- expansion: Hydra's basic sweeper semantics ---------------------------------------------

def test_cartesian_product_in_command_line_order() -> None:
    variants = expand(["+exp=tiny", "train.lr=1e-3,3e-3", "train.steps=20,40"])
    assert variants == [
        ["+exp=tiny", "train.lr=0.001", "train.steps=20"], ["+exp=tiny", "train.lr=0.001", "train.steps=40"],
        ["+exp=tiny", "train.lr=0.003", "train.steps=20"], ["+exp=tiny", "train.lr=0.003", "train.steps=40"]]


def test_range_choice_and_a_later_override_of_the_same_key() -> None:
    variants = expand(["train.steps=range(10,40,10)", "model=choice(tiny,llama8b)", "train.steps=5,6"])
    # As in Hydra's BasicSweeper (an OrderedDict by key): the later value list replaces the
    # earlier one but keeps the key's first position, so steps still varies slowest.
    assert variants == [["train.steps=5", "model=tiny"], ["train.steps=5", "model=llama8b"],
                        ["train.steps=6", "model=tiny"], ["train.steps=6", "model=llama8b"]]
    assert expand(["train.steps=range(10,40,10)"]) == [["train.steps=10"], ["train.steps=20"],
                                                       ["train.steps=30"]]
    assert expand(["+exp=tiny", "job.exclude=[a,b]"]) == [["+exp=tiny", "job.exclude=[a,b]"]]


def test_unsupported_and_oversized_sweeps_are_refused() -> None:
    with pytest.raises(ConfigError, match="interval"):
        expand(["train.lr=interval(0,1)"])
    with pytest.raises(ConfigError, match="1001 variants"):
        expand(["a=range(0,7)", "b=range(0,11)", "c=range(0,13)"])  # 1001 > MaxArraySize - 1
    with pytest.raises(ConfigError, match="Fix:"):
        expand(["train.lr=1e-3,,"])


def test_multirun_flag_anywhere() -> None:
    assert split_multirun(["+exp=tiny", "-m", "a=1,2"]) == (True, ["+exp=tiny", "a=1,2"])
    assert split_multirun(["--multirun", "+exp=tiny"]) == (True, ["+exp=tiny"])
    assert split_multirun(["+exp=tiny"]) == (False, ["+exp=tiny"])


# --- validation before anything exists ------------------------------------------------------

def test_a_bad_variant_refuses_the_whole_sweep_and_submits_nothing(tmp_path) -> None:
    calls = tmp_path / "sbatch_calls"
    path = _fake_bin(tmp_path, "sbatch", f'echo "$@" >> {calls}\necho 1\n')
    env = dict(os.environ, PATH=f"{path}:{os.environ['PATH']}")
    with pytest.raises(ConfigError) as exc:
        _run(["-m", *SWEEP, "cluster.kind=slurm", "supervisor.heartbeat_timeout_s=30,900"], tmp_path, env)
    text = str(exc.value)
    assert "variant 1" in text and "heartbeat_timeout_s=900" in text and "Fix:" in text
    assert not calls.exists(), "sbatch must not run when one variant is invalid"
    assert not (tmp_path / "runs").exists(), "no sweep directory for a refused sweep"


def test_variants_that_need_other_resources_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError) as exc:
        _run(["-m", "+exp=tiny", "cluster=local_slurm", "cluster.kind=slurm", "job.nodes=1,2"], tmp_path)
    assert "nodes" in str(exc.value) and "one resource request" in str(exc.value)
    assert not (tmp_path / "runs").exists()


def test_sweep_syntax_without_m_says_to_add_m(tmp_path) -> None:
    with pytest.raises(ConfigError) as exc:
        _run(["+exp=tiny", "train.lr=1e-3,3e-3"], tmp_path)
    assert "without -m" in str(exc.value) and "python -m slurmkit.submit -m +exp=tiny" in str(exc.value)


def test_m_is_accepted_by_main_and_dry_run_writes_nothing(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "slurmkit.submit", "-m", *SWEEP, "cluster.kind=slurm", "submit.dry_run=true",
         "submit.array_parallelism=3", f"submit.run_root={tmp_path}"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --array=0-3%3" in res.stdout and "-m slurmkit.launch /SWEEP_DIR" in res.stdout
    assert "3: train.lr=0.003 train.steps=40" in res.stdout
    assert list(tmp_path.iterdir()) == []


# --- the sweep directory --------------------------------------------------------------------

def test_emit_sbatch_writes_the_layout_status_reads(tmp_path) -> None:
    code, out = _run(["--multirun", *SWEEP, "submit.emit=sbatch"], tmp_path)
    assert code == 0, out
    (sweep_dir,) = list((tmp_path / "runs" / "tiny").iterdir())
    assert sweep_dir.name.endswith("-sweep")
    doc = json.loads((sweep_dir / "sweep.json").read_text())
    assert {"kind", "name", "job_id", "array", "variants"} <= set(doc)
    assert (doc["kind"], doc["name"], doc["job_id"], doc["array"]) == ("sweep", "tiny", None, "0-3")
    assert [v["overrides"] for v in doc["variants"]] == [
        ["train.lr=0.001", "train.steps=20"], ["train.lr=0.001", "train.steps=40"],
        ["train.lr=0.003", "train.steps=20"], ["train.lr=0.003", "train.steps=40"]]
    for i, v in enumerate(doc["variants"]):
        assert v["index"] == i and v["run_dir"] == str(sweep_dir / str(i))
        cfg = load_frozen(os.path.join(v["run_dir"], "config.yaml"))
        assert (cfg.train.lr, cfg.train.steps) == ([1e-3, 1e-3, 3e-3, 3e-3][i], [20, 40, 20, 40][i])
        assert os.path.isdir(os.path.join(v["run_dir"], "logs"))
    script = sweep_dir / "job.sbatch"
    assert "#SBATCH --array=0-3\n" in script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert [v.run_dir for v in load_sweep(str(sweep_dir)).variants] == [v["run_dir"] for v in doc["variants"]]


def test_array_task_finds_its_variant_and_refuses_a_tampered_sweep(tmp_path) -> None:
    _run(["-m", *SWEEP, "submit.emit=sbatch"], tmp_path)
    (sweep_dir,) = list((tmp_path / "runs" / "tiny").iterdir())
    assert task_run_dir(str(sweep_dir), {"SLURM_ARRAY_TASK_ID": "2"}) == str(sweep_dir / "2")
    assert task_run_dir(str(sweep_dir / "1"), {"SLURM_ARRAY_TASK_ID": "2"}) == str(sweep_dir / "1")
    with pytest.raises(SlurmkitError, match="SLURM_ARRAY_TASK_ID is not set"):
        task_run_dir(str(sweep_dir), {})
    with pytest.raises(SlurmkitError, match="array task 4 of a sweep with 4 variants"):
        task_run_dir(str(sweep_dir), {"SLURM_ARRAY_TASK_ID": "4"})
    doc = json.loads((sweep_dir / "sweep.json").read_text())
    doc["variants"][2]["run_dir"] = "/etc"
    (sweep_dir / "sweep.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="variant 2 names run directory '/etc'"):
        task_run_dir(str(sweep_dir), {"SLURM_ARRAY_TASK_ID": "2"})
    (sweep_dir / "sweep.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read"):
        task_run_dir(str(sweep_dir), {"SLURM_ARRAY_TASK_ID": "0"})


def _plan(overrides: list[str]):
    return plan_sweep(overrides, {}, submit.resolve_cluster, submit.validate, lambda cfg: ["--cpu-bind=none"])


def test_array_script_matches_golden() -> None:
    plan = _plan([*SWEEP, "cluster.kind=slurm", "submit.array_parallelism=2"])
    sweep_dir = "/shared/runs/tiny/20260101-000000-sweep"
    text = render_standalone(plan.placed(sweep_dir), f"{sweep_dir}/job.sbatch", python="python3")
    path = os.path.join(GOLDEN, "tiny_sweep.standalone.sbatch")
    if os.environ.get("SLURMKIT_UPDATE_GOLDEN") == "1":
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        assert text == f.read(), f"rendered script differs from {path} (SLURMKIT_UPDATE_GOLDEN=1 to accept)"


def test_each_array_task_logs_into_its_own_variant(tmp_path) -> None:
    """Run the array script under bash with a fake srun: task 2's agents log into variant 2."""
    plan = _plan([*SWEEP, "cluster.kind=slurm"])
    sweep_dir = tmp_path / "sw eep's"
    script = tmp_path / "job.sh"
    script.write_text(render_standalone(plan.placed(str(sweep_dir)), str(script), python="python3"))
    path = _fake_bin(tmp_path, "srun", 'echo "SRUN $SLURMKIT_RUN_DIR|$SLURMKIT_CONFIG|$*"\n')
    _fake_bin(tmp_path, "scontrol", "printf 'node1\\nnode2\\n'\n")
    env = dict(os.environ, PATH=f"{path}:{os.environ['PATH']}", SLURM_ARRAY_TASK_ID="2")
    (sweep_dir / "2").mkdir(parents=True)  # the script runs nothing from a missing variant
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("SRUN ")]
    assert len(lines) == 2, res.stdout
    outputs = set()
    for line in lines:  # the steps run in the background: in any order
        run_dir, config, args = line[5:].split("|", 2)
        assert run_dir == str(sweep_dir / "2") and config == str(sweep_dir / "2" / "config.yaml")
        assert args.endswith(f"-m slurmkit.launch {sweep_dir}")
        outputs |= {a.split(" python3 ")[0] for a in args.split(" --") if a.startswith("output=")}
    logs = sweep_dir / "2" / "logs"
    assert outputs == {f"output={logs}/%j_node0_log.out", f"output={logs}/%j_node1_log.out"}


# --- per-task Slurm addressing ---------------------------------------------------------------

def test_an_array_task_is_addressed_as_array_underscore_task() -> None:
    env = {"SLURM_JOB_ID": "2", "SLURM_ARRAY_JOB_ID": "2", "SLURM_ARRAY_TASK_ID": "1", "SLURM_NODEID": "0",
           "SLURM_JOB_NODELIST": "node1"}
    assert job_ref("2", env) == "2_1", "job id 2 alone would requeue every task of array 2"
    assert node_context(env).job_ref == "2_1"
    assert job_ref("7", {"SLURM_JOB_ID": "7"}) == "7"
    assert node_context({"SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1"}).job_ref == "7"


def test_submit_says_why_a_singleton_job_would_pend(tmp_path) -> None:
    path = _fake_bin(tmp_path, "squeue", "echo '41|tiny|RUNNING|5:00|2|node[1-2]'\n"
                                         "echo '42|other|PENDING|0:00|1|(Priority)'\n")
    plan = _plan([*SWEEP, "cluster.kind=slurm"])
    out = tmp_path / "o.txt"
    with open(out, "w") as f:
        submit.warn_singleton(plan.spec, {"PATH": f"{path}:{os.environ['PATH']}", "USER": "me"},
                              Console(file=f, width=400))
    text = out.read_text()
    assert "41 (RUNNING)" in text and "PENDING" in text and "job.singleton=false" in text
    assert "42" not in text



@pytest.mark.parametrize("field,change", [
    ("run directory", {"run_dir": "/runs/a\nb"}),
    ("environment variable X", {"env": (("X", "a\nrm -rf /"),)}),
    ("cluster.partition", {"partition": "de\rbug"}),
    ("cluster.setup", {"setup": ("module load x\x1b[2J",)}),
])
def test_control_characters_never_reach_a_script(field, change) -> None:
    import dataclasses

    from slurmkit.config import compose
    from slurmkit.render.jobspec import build_jobspec

    cfg = compose(["+exp=tiny", "cluster=local_slurm"])
    c, j = cfg.cluster, cfg.job
    if "partition" in change:
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(c, partition=change["partition"]))
    if "setup" in change:
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(c, setup=list(change["setup"])))
    if "env" in change:
        cfg = dataclasses.replace(cfg, job=dataclasses.replace(j, env=dict(change["env"])))
    with pytest.raises(ConfigError) as exc:
        build_jobspec(cfg, change.get("run_dir", "/runs/ok"), [])
    assert field in str(exc.value) and "control character" in str(exc.value)
    assert build_jobspec(compose(["+exp=tiny", "cluster=local_slurm"]), "/runs/ok", []).run_dir == "/runs/ok"


def test_local_runner_reports_a_variant_it_cannot_start_and_goes_on(tmp_path, caplog) -> None:
    from slurmkit.sweepdir import Sweep, Variant, variant_dir, write_sweep
    from slurmkit.sweep.local import run_local_sweep

    sweep_dir = str(tmp_path / "x-sweep")
    variants = [Variant(i, [f"train.steps={i}"], variant_dir(sweep_dir, i)) for i in range(2)]
    for v in variants:
        os.makedirs(v.run_dir)  # no frozen config.yaml: neither variant can start
    write_sweep(Sweep(sweep_dir, "x", "0-1", "local", [], variants))
    with caplog.at_level("INFO", logger="slurmkit.sweep.local"):
        assert run_local_sweep(sweep_dir, 1) == 1
    assert "variant 0 (train.steps=0) could not run" in caplog.text
    assert "variant 1 (train.steps=1) could not run" in caplog.text, "the runner stopped at the first"
    assert "0 of 2 variants completed" in caplog.text
