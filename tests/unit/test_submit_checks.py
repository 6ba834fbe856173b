"""submit_checks: which argument of job.command is the user's file, and its resolution at submit
(ranks start in the run directory: a relative script there names nothing)."""

from __future__ import annotations

import os
import stat

import pytest

from slurmkit.config import compose
from slurmkit.errors import ConfigError
from slurmkit.submit_checks import PROGRAM, SCRIPT, command_files, resolve_command, with_command_resolved

S, P = SCRIPT, PROGRAM


@pytest.mark.parametrize("command,files", [
    # a Python interpreter: its first argument that is not an interpreter option
    (["python", "train.py"], [(1, S)]),
    (["python3", "train.py", "--lr", "1e-3"], [(1, S)]),
    (["python3.11", "sub/train.py"], [(1, S)]),
    (["python", "-u", "-O", "-B", "train.py"], [(4, S)]),
    (["python", "-uB", "train.py"], [(2, S)]),
    (["python", "-X", "importtime", "-W", "ignore", "train.py"], [(5, S)]),
    (["python", "-Xdev", "-Wignore", "train.py"], [(3, S)]),
    (["python", "-uX", "dev", "train.py"], [(3, S)]),
    (["python", "--check-hash-based-pycs", "never", "train.py"], [(3, S)]),
    (["python", "-I", "--", "train.py"], [(3, S)]),
    (["python", "-u", "train.py", "-m", "x"], [(2, S)]),  # the script's own arguments after it
    # -m module, -c code, stdin: no script
    (["python", "-m", "slurmkit.train"], []),
    (["python", "-u", "-m", "pkg.train", "train.py"], []),
    (["python", "-mpkg.train"], []),
    (["python", "-c", "print(1)"], []),
    (["python", "-uc", "print(1)"], []),
    (["python", "-"], []),
    (["python"], []),
    (["python", "-u"], []),
    # a path to an interpreter is a program and an interpreter
    (["./venv/bin/python", "train.py"], [(0, P), (1, S)]),
    (["/opt/venv/bin/python3", "-u", "train.py"], [(0, P), (2, S)]),
    # torchrun: the first argument after its own options
    (["torchrun", "--nproc-per-node=2", "train.py"], [(2, S)]),
    (["torchrun", "--nproc-per-node", "2", "--nnodes=1", "train.py", "--steps", "5"], [(4, S)]),
    (["torchrun", "--standalone", "--nproc_per_node", "2", "train.py"], [(4, S)]),
    (["torchrun", "--rdzv-endpoint", "x:29500", "--rdzv-backend", "c10d", "--max-restarts=0",
      "dir/train.py"], [(6, S)]),
    (["torchrun", "-r", "3", "-t3", "train.py"], [(4, S)]),
    (["torchrun", "--run-path", "train.py"], [(2, S)]),
    (["torchrun", "--", "train.py"], [(2, S)]),
    (["torchrun", "-m", "pkg.train"], []),
    (["torchrun", "--nproc-per-node=2", "--module", "pkg.train"], []),
    (["torchrun", "--no-python", "./run.sh"], [(2, P)]),
    (["torchrun", "--no-python", "hostname"], []),  # a program on PATH
    (["torchrun", "--nproc-per-node=2"], []),
    (["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"], [(5, S)]),
    (["python", "-u", "-m", "torch.distributed.launch", "--use-env", "train.py"], [(5, S)]),
    (["/usr/bin/torchrun", "train.py"], [(0, P), (1, S)]),
    # argv[0] itself when it is a path
    (["./run.sh"], [(0, P)]),
    (["bin/train", "--x", "y.py"], [(0, P)]),
    (["/opt/site/train"], [(0, P)]),
    # anything else: left alone
    (["train"], []),
    (["bash", "run.sh"], []),
    (["nsys", "profile", "python", "train.py"], []),
    ([], []),
])
def test_which_argument_is_a_file(command: list[str], files: list[tuple[int, str]]) -> None:
    assert command_files(command) == files


def _script(path, body: str = "print(1)\n", executable: bool = False) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_relative_files_become_absolute_against_the_submit_directory(tmp_path) -> None:
    _script(tmp_path / "train.py")
    _script(tmp_path / "sub" / "run.sh", "#!/bin/sh\n", executable=True)
    cwd = str(tmp_path)
    assert resolve_command(["python", "-u", "train.py", "--data", "x.bin"], cwd) == [
        "python", "-u", f"{cwd}/train.py", "--data", "x.bin"]
    assert resolve_command(["torchrun", "--nproc-per-node=2", "./train.py"], cwd) == [
        "torchrun", "--nproc-per-node=2", f"{cwd}/train.py"]
    assert resolve_command(["./sub/run.sh", "a"], cwd) == [f"{cwd}/sub/run.sh", "a"]
    assert resolve_command(["python", "sub/../train.py"], cwd) == [
        "python", f"{cwd}/train.py"]
    # absolute ones are checked and kept; modules, code and commands on PATH are left alone
    assert resolve_command(["python", f"{cwd}/train.py"], cwd) == ["python", f"{cwd}/train.py"]
    for command in (["python", "-m", "slurmkit.train"], ["python", "-c", "x"], ["hostname"]):
        assert resolve_command(command, cwd) == command


def test_a_directory_with_main_is_a_python_script(tmp_path) -> None:
    _script(tmp_path / "app" / "__main__.py")
    assert resolve_command(["python", "app"], str(tmp_path)) == ["python", f"{tmp_path}/app"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="directory without __main__.py"):
        resolve_command(["python", "empty"], str(tmp_path))


@pytest.mark.parametrize("command,given", [
    (["python", "train.py"], "train.py"),
    (["python", "-u", "-X", "dev", "missing/train.py"], "missing/train.py"),
    (["torchrun", "--nproc-per-node", "2", "train.py"], "train.py"),
    (["python", "-m", "torch.distributed.run", "--nnodes=1", "train.py"], "train.py"),
    (["./run.sh"], "./run.sh"),
])
def test_a_missing_file_is_refused_with_the_path_and_the_directory(tmp_path, command, given) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_command(command, str(tmp_path))
    text = str(info.value)
    looked = os.path.normpath(os.path.join(tmp_path, given))
    assert text.startswith("Detected: ") and "Requirement: " in text and "Fix: " in text
    assert repr(given) in text and f"{looked} does not exist" in text
    assert f"the directory submit ran in, {tmp_path}" in text


def test_absolute_missing_paths_are_refused_too(tmp_path) -> None:
    with pytest.raises(ConfigError, match=f"{tmp_path}/gone.py does not exist"):
        resolve_command(["python", f"{tmp_path}/gone.py"], "/elsewhere")
    with pytest.raises(ConfigError, match="does not exist") as info:
        resolve_command(["/nonexistent/bin/python", "-m", "x"], str(tmp_path))
    assert "directory submit ran in" not in str(info.value)  # an absolute path was looked for as given


def test_a_program_must_be_an_executable_regular_file(tmp_path) -> None:
    _script(tmp_path / "run.sh", "#!/bin/sh\n")
    with pytest.raises(ConfigError, match="is not executable") as info:
        resolve_command(["./run.sh"], str(tmp_path))
    assert "chmod +x" in str(info.value)
    (tmp_path / "adir").mkdir()
    with pytest.raises(ConfigError, match="is not a regular file"):
        resolve_command(["./adir"], str(tmp_path))


def test_the_config_carries_the_absolute_path(tmp_path) -> None:
    _script(tmp_path / "train.py")
    cfg = compose(["job.command=[python,train.py,'--steps=3']"])
    resolved = with_command_resolved(cfg, str(tmp_path))
    assert resolved.job.command == ["python", f"{tmp_path}/train.py", "--steps=3"]
    assert cfg.job.command == ["python", "train.py", "--steps=3"]  # the composed one is not changed
    default = compose([])
    assert with_command_resolved(default, str(tmp_path)) is default  # python -m: nothing to do


def test_a_container_job_keeps_its_paths(tmp_path) -> None:
    """Its paths name files inside the image, which this machine cannot see."""
    cfg = compose(["job.command=[python,train.py]", "cluster.container_image='nvcr.io#nvidia/pytorch:24.01'"])
    assert with_command_resolved(cfg, str(tmp_path)).job.command == ["python", "train.py"]


@pytest.mark.parametrize("overrides,found", [
    (["store.lustre_uri=", "store.object_uri="], "neither store.lustre_uri nor store.object_uri"),
    (["job.command=[python,train.py]"], "a program read as 'none'"),
    (["job.command=[python,train.py]", "job.checkpoint_glob='snapshot-{step}.pt'"], "job.checkpoint_glob="),
])
def test_store_adopt_that_the_agents_could_not_act_on_is_refused_at_submit(overrides, found) -> None:
    from slurmkit.submit_checks import check_adopt

    cfg = compose(["store.adopt=true", "job.program=auto", *overrides])
    with pytest.raises(ConfigError) as err:
        check_adopt(cfg, reference_trainer=False)
    assert found in str(err.value), str(err.value)
    for good in (["job.command=[python,-m,torchtitan.train]"],
                 ["job.command=[python,train.py]", "job.checkpoint_glob='ckpt/step_{step}/.metadata'"]):
        check_adopt(compose(["store.adopt=true", *good]), reference_trainer=False)
    check_adopt(cfg, reference_trainer=True)  # the reference trainer saves through the store: nothing to adopt
