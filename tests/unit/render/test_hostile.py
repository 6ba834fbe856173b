"""Hostile values at submit: each is refused by `python -m slurmkit.submit` with exit code 2 and
Detected/Requirement/Fix, and nothing is written (no run directory, no script) or submitted.

Most cases call slurmkit.submit.main in this process (the CLI's own entry point, same exit code
and stderr); a few run the real `python -m slurmkit.submit` in a subprocess.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from slurmkit.cli import submit
from slurmkit.render import build_jobspec, render_standalone, render_submitit_script
from slurmkit.config import compose

BASE = ["+exp=tiny", "cluster=local_slurm", "cluster.kind=slurm"]
AWS_KEY_ID = "AKIA" + "IOSFODNN7EXAMPLE"  # AWS's documented example key id, split so scanners pass
GH_TOKEN = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
SLACK = "xoxb-" + "123456789012-abcdefghij"
PEM = "-----BEGIN OPENSSH PRIVATE KEY-----"


def _main(argv: list[str], tmp_path, capsys) -> tuple[int, str]:
    code = submit.main([*BASE, *argv, f"submit.run_root={tmp_path / 'runs'}"])
    return code, capsys.readouterr().err


def _assert_refused(code: int, err: str, tmp_path, *fragments: str) -> None:
    assert code == 2, err
    assert "configuration error" in err and "Detected:" in err and "Requirement:" in err and "Fix:" in err
    for frag in fragments:
        assert frag in err, (frag, err)
    assert not (tmp_path / "runs").exists(), "a refused submission wrote something"


@pytest.mark.parametrize("key", ["cluster.partition", "cluster.account", "cluster.qos",
                                 "cluster.gpu_type", "cluster.constraint", "cluster.container_image",
                                 "cluster.reservation", "cluster.wckey", "+job.env.NCCL_DEBUG"])
def test_control_character_in_a_rendered_value_is_refused(key, tmp_path, capsys) -> None:
    code, err = _main([f"{key}='ok\n#SBATCH --qos=high'"], tmp_path, capsys)
    _assert_refused(code, err, tmp_path, key.replace("+job.env.", "environment variable "),
                    "control character")


@pytest.mark.parametrize("argv,fragment", [
    (["cluster.container_mounts=['/a:/a\n/b:/b']"], "cluster.container_mounts"),
    (["cluster.setup=['module load x\necho hi']"], "cluster.setup line"),
    (["job.name='tiny\n'"], "job.name"),  # a trailing newline once passed the name's regex
])
def test_control_character_in_lists_and_the_job_name_is_refused(argv, fragment, tmp_path, capsys) -> None:
    code, err = _main(argv, tmp_path, capsys)
    _assert_refused(code, err, tmp_path, fragment)


@pytest.mark.parametrize("key,value", [
    ("cluster.partition", "debug --qos=high"), ("cluster.partition", "a#b"),
    ("cluster.partition", "a;b"), ("cluster.account", "a'b"), ("cluster.account", "$(id)"),
    ("cluster.qos", "normal=1"), ("cluster.qos", 'a"b'), ("cluster.gpu_type", "h100:8"),
    ("cluster.gpu_type", "h 100"), ("cluster.reservation", "maint window"),
    ("cluster.wckey", "*default"), ("cluster.switches", "two"), ("cluster.switches", "1@soon"),
    ("cluster.constraint", "h100 && ib"), ("cluster.constraint", "a;b"),
    ("job.exclude", "[node1,'bad;node']"),
])
def test_value_that_is_not_a_slurm_name_is_refused(key, value, tmp_path, capsys) -> None:
    arg = f"{key}={value}" if value.startswith("[") else f"{key}='{value}'" if "'" not in value else f'{key}="{value}"'
    code, err = _main([arg], tmp_path, capsys)
    _assert_refused(code, err, tmp_path, key, "Slurm" if key != "job.exclude" else "not a node name")


@pytest.mark.parametrize("override,why", [
    ("+job.env.HF_TOKEN=abc", "TOKEN"), ("+job.env.MY_SECRET=abc", "SECRET"),
    ("+job.env.DB_PASSWORD=abc", "PASSWORD"), ("+cluster.env.AWS_ACCESS_KEY_ID=abc", "AWS key name"),
    ("+job.env.WANDB_API_KEY=abc", "API or private key"),
    (f"+job.env.CREDS={AWS_KEY_ID}", "AWS access key id"),
    (f"+cluster.env.GITHUB={GH_TOKEN}", "GitHub token"), (f"+job.env.SLACK={SLACK}", "Slack token"),
    (f"+job.env.KEY_FILE='{PEM}'", "private key"),
    ("+job.env.PROXY='http://bob:hunter2@proxy:3128'", "password inside a URL"),
])
def test_secret_in_env_is_refused_without_echoing_it(override, why, tmp_path, capsys) -> None:
    code, err = _main([override], tmp_path, capsys)
    _assert_refused(code, err, tmp_path, why, "value not shown", "no secrets in the config")
    value = override.split("=", 1)[1].strip("'")
    assert value not in err or value == "abc", "the secret itself was printed"


def test_secret_shape_in_setup_or_command_is_refused(tmp_path, capsys) -> None:
    code, err = _main([f"cluster.setup=['export HF_HOME=/x','git clone https://{GH_TOKEN}@github.com/a/b']"],
                      tmp_path, capsys)
    _assert_refused(code, err, tmp_path, "cluster.setup", "GitHub token")
    assert GH_TOKEN not in err
    code, err = _main([f"job.command=[python,train.py,'--key={AWS_KEY_ID}']"], tmp_path, capsys)
    _assert_refused(code, err, tmp_path, "job.command", "AWS access key id")


def test_ordinary_env_names_are_not_secrets() -> None:
    spec = build_jobspec(compose([*BASE, "+job.env.TOKENIZERS_PARALLELISM=x",
                                  "+job.env.NCCL_DEBUG=INFO", "+job.env.HF_HOME=/lustre/hf"]), "/r/x")
    assert ("TOKENIZERS_PARALLELISM", "x") in spec.env


def test_store_protocol_without_backend_is_refused(tmp_path, capsys) -> None:
    from fsspec.registry import known_implementations

    missing = next(p for p, impl in sorted(known_implementations.items())
                   if importlib.util.find_spec(str(impl["class"]).split(".")[0]) is None)
    code, err = _main([f"store.object_uri={missing}://bucket/ckpt"], tmp_path, capsys)
    _assert_refused(code, err, tmp_path, "store.object_uri", f"protocol {missing!r}", "not installed",
                    "install the backend")
    code, err = _main(["store.lustre_uri=nosuchfs://x/y"], tmp_path, capsys)
    _assert_refused(code, err, tmp_path, "store.lustre_uri", "knows no protocol 'nosuchfs'")
    code, err = _main([f"store.object_uri=simplecache::{missing}://bucket/ckpt"], tmp_path, capsys)
    _assert_refused(code, err, tmp_path, f"protocol {missing!r}")


def test_installed_store_backends_pass() -> None:
    from slurmkit.submit_checks import check_store_backends

    check_store_backends(compose([*BASE, "store=tiered"]).store)  # local paths + s3:// (s3fs installed)


def test_run_root_that_cannot_hold_run_dirs_is_refused_and_left_alone(tmp_path, capsys) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    for root in (blocker, blocker / "below"):
        code = submit.main([*BASE, f"submit.run_root={root}"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert "submit.run_root" in err and "not a directory" in err and "Fix:" in err
        assert blocker.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def _refusing_sbatch(tmp_path):
    """A directory holding an ``sbatch`` that refuses the partition as Slurm does (exit 1)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid partition "
                    "name specified' >&2\nexit 1\n")
    fake.chmod(0o755)
    return bindir


def test_refused_sbatch_leaves_no_parent_directory_behind(tmp_path) -> None:
    """The real CLI with an sbatch that refuses the partition as Slurm does: exit 1, and neither
    the run directory nor submit.run_root/<job.name> (nor run_root itself) is left."""
    bindir = _refusing_sbatch(tmp_path)
    other = tmp_path / "shared" / "tiny" / "someone-elses-run"
    other.mkdir(parents=True)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    for root, left in ((tmp_path / "fresh" / "runs", []), (tmp_path / "shared", ["tiny"])):
        res = subprocess.run([sys.executable, "-m", "slurmkit.submit", *BASE, "cluster.partition=nosuch",
                              f"submit.run_root={root}"], env=env, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 1, res.stderr
        assert "Invalid partition" in res.stderr and "Fix:" in res.stderr
        assert not (tmp_path / "fresh").exists()
        assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["tiny"]
        assert [p.name for p in (tmp_path / "shared" / "tiny").iterdir()] == ["someone-elses-run"]


def test_real_cli_exits_2_and_writes_nothing(tmp_path) -> None:
    for override, frag in (("cluster.partition='debug\n#SBATCH --qos=high'", "cluster.partition"),
                           (f"+job.env.GH={GH_TOKEN}", "GitHub token")):
        res = subprocess.run([sys.executable, "-m", "slurmkit.submit", *BASE, override,
                              f"submit.run_root={tmp_path / 'runs'}"], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 2, res.stderr
        assert frag in res.stderr and "Detected:" in res.stderr and "Fix:" in res.stderr
        assert GH_TOKEN not in res.stderr + res.stdout
        assert not (tmp_path / "runs").exists()


def test_admin_options_render_only_when_set() -> None:
    plain = build_jobspec(compose(BASE), "/r/x")
    for text in (render_submitit_script(plain, python="python3"), render_standalone(plain, "/r/x/job.sbatch")):
        for flag in ("--wckey", "--reservation", "--switches", "--segment"):
            assert flag not in text, flag
    spec = build_jobspec(compose([*BASE, "cluster.reservation='maint,gpu-test'", "cluster.wckey=proj42",
                                  "cluster.switches=1@01:00:00", "cluster.segment=2", "cluster.gpu_type=h100",
                                  "job.gpus_per_node=2"]), "/r/x")
    for text in (render_submitit_script(spec, python="python3"), render_standalone(spec, "/r/x/job.sbatch")):
        for line in ("#SBATCH --reservation=maint,gpu-test", "#SBATCH --wckey=proj42",
                     "#SBATCH --switches=1@01:00:00", "#SBATCH --segment=2", "#SBATCH --gpus-per-node=h100:2"):
            assert line in text, (line, text)


def test_refused_sweep_leaves_no_parent_directory_behind(tmp_path) -> None:
    """A sweep (-m) whose array sbatch refuses: the sweep directory and the parents it created go."""
    bindir = _refusing_sbatch(tmp_path)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    root = tmp_path / "fresh" / "runs"
    res = subprocess.run([sys.executable, "-m", "slurmkit.submit", "-m", *BASE, "cluster.partition=nosuch",
                          "train.lr=1e-3,3e-3", f"submit.run_root={root}"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr + res.stdout
    assert "Invalid partition" in res.stderr
    assert not (tmp_path / "fresh").exists()
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    res = subprocess.run([sys.executable, "-m", "slurmkit.submit", "-m", *BASE, "train.lr=1e-3,3e-3",
                          f"submit.run_root={blocker}/runs"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "submit.run_root" in res.stderr and "not a directory" in res.stderr


def test_segment_below_one_is_refused(tmp_path, capsys) -> None:
    code, err = _main(["cluster.segment=0"], tmp_path, capsys)
    _assert_refused(code, err, tmp_path, "cluster.segment=0", "at least 1 node per segment")
