"""What a job's command says (issue 36): the adapter for ``job.program=auto``, the total steps and
the checkpoint folders and the flight recorder's dump stems, with the flag spellings of torchtitan 0.3.0 (PyPI, ``--dump-folder``
and ``--dump_folder`` alike through tyro) and 0.1.0-0.2.2 (``--job.dump_folder``)."""

from __future__ import annotations

import sys

import pytest

from slurmkit.adapters import NAMES, checkpoint_dirs, detect, resolve, total_steps, trace_stems
from slurmkit.errors import ConfigError
from slurmkit.failures.programs import is_reference_trainer

DETECT = [
    # the reference trainer: whatever else the command holds, as failures.programs decides it
    (["python", "-m", "slurmkit.train"], "reference"),
    (["nsys", "profile", "python", "-u", "-m", "slurmkit.train", "train.steps=5"], "reference"),
    # torchtitan
    (["python", "-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel"], "torchtitan"),
    (["torchrun", "--nproc-per-node=2", "-m", "torchtitan.train", "--training.steps", "60"], "torchtitan"),
    ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "8", "-m", "torchtitan.train"],
     "torchtitan"),
    (["torchrun", "--nproc_per_node=8", "torchtitan/train.py", "--job.config_file", "debug_model.toml"],
     "torchtitan"),
    (["python", "/src/torchtitan/torchtitan/train.py"], "torchtitan"),
    (["torchrun", "train.py", "--job.config_file=./train_configs/llama3_8b.toml"], "torchtitan"),  # 2024
    (["python", "-m", "torchtitan.experiments.flux.train"], "torchtitan"),
    # Lightning, only where the command says so
    (["python", "main.py", "fit", "--trainer.max_epochs=3"], "lightning"),
    (["python", "main.py", "fit", "--config", "config.yaml"], "lightning"),
    (["python", "cli.py", "--trainer.devices=2", "--model.lr", "0.1"], "lightning"),
    (["python", "-m", "lightning.pytorch.cli"], "lightning"),
    (["python", "-m", "pytorch_lightning"], "lightning"),
    (["torchrun", "--nproc-per-node=2", "main.py", "fit"], "lightning"),
    (["python", "train_lightning.py"], "none"),  # a Trainer built inside: nothing says so
    (["python", "main.py", "test", "fit"], "none"),
    # torchrun with a script or a module
    (["torchrun", "--nproc_per_node=8", "train.py"], "torchrun"),
    (["/opt/venv/bin/torchrun", "--nnodes=2", "ddp.py", "--epochs", "5"], "torchrun"),
    (["python", "-m", "torch.distributed.run", "--standalone", "train.py"], "torchrun"),
    (["python", "-m", "torch.distributed.launch", "--use-env", "train.py"], "torchrun"),
    (["torchrun", "-m", "mypkg.train"], "torchrun"),
    (["torchrun", "--no-python", "./train.sh"], "torchrun"),
    (["torchrun"], "none"),
    (["torchrun", "--help"], "none"),
    # anything else
    (["python", "train.py"], "none"),
    (["python", "-m", "slurmkit.train.planner"], "none"),
    (["python", "compare.py", "--baseline", "torchtitan.train"], "none"),
    (["bash", "run_train.sh"], "none"),
    ([], "none"),
]


@pytest.mark.parametrize(("command", "expected"), DETECT)
def test_detect(command: list[str], expected: str) -> None:
    assert detect(command, reference_trainer=is_reference_trainer(command)) == expected
    assert expected in NAMES and expected != "auto"


def test_the_reference_answer_is_the_callers() -> None:
    assert detect(["python", "-m", "torchtitan.train"], reference_trainer=True) == "reference"
    assert detect(["python", "-m", "slurmkit.train"], reference_trainer=False) == "none"


def test_resolve() -> None:
    command = ["torchrun", "-m", "torchtitan.train"]
    assert resolve("auto", command, reference_trainer=False) == "torchtitan"
    for name in NAMES[1:]:
        assert resolve(name, command, reference_trainer=False) == name
    with pytest.raises(ConfigError) as info:
        resolve("titan", command, reference_trainer=False)
    assert "job.program='titan'" in str(info.value) and "Fix: set job.program=auto" in str(info.value)


TITAN = ["torchrun", "--nproc-per-node=2", "-m", "torchtitan.train"]

STEPS = [
    (TITAN + ["--training.steps", "60"], 60),
    (TITAN + ["--training.steps=60"], 60),
    (TITAN + ["--training.steps=60", "--training.steps", "80"], 80),  # the last, as its CLI takes it
    (TITAN + ["--training.steps", "9007199254740991"], 2 ** 53 - 1),
    (TITAN, None),  # the config's own value (or the default, 10,000): unknown here
    (TITAN + ["--training.steps"], None),
    (TITAN + ["--training.steps", "--checkpoint.enable"], None),
    (TITAN + ["--training.steps=0"], None),
    (TITAN + ["--training.steps=-5"], None),
    (TITAN + ["--training.steps=1e3"], None),
    (TITAN + ["--training.steps=６０"], None),
    (TITAN + ["--training.steps=" + "9" * 17], None),
    (TITAN + ["--training.steps_x=5"], None),
    (TITAN + ["--lr_scheduler.warmup_steps=5"], None),
]


@pytest.mark.parametrize(("command", "expected"), STEPS)
def test_total_steps_of_torchtitan(command: list[str], expected: int | None) -> None:
    assert total_steps("torchtitan", command) == expected


def test_total_steps_of_others_are_unknown() -> None:
    for adapter in ("lightning", "torchrun", "none", "reference"):
        assert total_steps(adapter, TITAN + ["--training.steps", "60", "--trainer.max_steps=100"]) is None


DIRS = [
    # 0.3.0: the dump folder flag in both of tyro's spellings, relative to the ranks' directory
    (["--dump-folder", "out"], ["/run/out/checkpoint"]),
    (["--dump_folder=out/"], ["/run/out/checkpoint"]),
    (["--dump-folder", "/scratch/x", "--checkpoint.folder", "ckpt"], ["/scratch/x/ckpt"]),
    (["--dump-folder", "/scratch/x", "--checkpoint.folder=/nvme/ckpt"], ["/nvme/ckpt"]),  # os.path.join
    (["--dump-folder=a", "--dump-folder=b"], ["/run/b/checkpoint"]),
    # 0.1.0-0.2.2
    (["--job.dump_folder", "./outputs"], ["/run/outputs/checkpoint"]),
    (["--job.dump-folder=../shared"], ["/shared/checkpoint"]),
    # no flag: each version's default
    ([], ["/run/outputs/checkpoint", "/run/torchtitan/outputs/checkpoint"]),
    (["--checkpoint.folder", "ck"], ["/run/outputs/ck", "/run/torchtitan/outputs/ck"]),
    # remote folders are not scanned here
    (["--dump-folder", "s3://bucket/run"], []),
    (["--dump-folder", "/x", "--checkpoint.folder", "gs://b/ck"], []),
]


@pytest.mark.parametrize(("flags", "expected"), DIRS)
def test_checkpoint_dirs_of_torchtitan(flags: list[str], expected: list[str]) -> None:
    assert checkpoint_dirs("torchtitan", TITAN + flags, "/run") == expected


def test_checkpoint_dirs_of_lightning_and_others() -> None:
    assert checkpoint_dirs("lightning", ["python", "main.py", "fit"], "/run") == \
        ["/run/checkpoints", "/run/lightning_logs"]
    assert checkpoint_dirs("lightning", ["python", "main.py", "fit", "--trainer.default_root_dir=/scratch/r"],
                           "/run") == ["/scratch/r/checkpoints", "/scratch/r/lightning_logs"]
    for adapter in ("torchrun", "none", "reference"):
        assert checkpoint_dirs(adapter, TITAN + ["--dump-folder", "out"], "/run") == []


TRACES = [
    # torchtitan's own TORCH_FR_DUMP_TEMP_FILE: <dump folder>/<save_traces_folder>/<prefix>
    (["--dump-folder", "out"], ["/run/out/comm_traces/rank_", "/run/out/comm_trace/rank_"]),
    (["--dump-folder", "/scratch/x", "--comm.save-traces-folder", "fr"], ["/scratch/x/fr/rank_"]),
    (["--dump_folder=o", "--comm.save_traces_folder=/nvme/fr", "--comm.save_traces_file_prefix", "r"],
     ["/nvme/fr/r"]),  # os.path.join: an absolute folder stands alone
    (["--job.dump_folder", "./outputs", "--comm.save-traces-folder", "t"], ["/run/outputs/t/rank_"]),
    # no flag: every version's default dump and trace folders
    ([], ["/run/outputs/comm_traces/rank_", "/run/outputs/comm_trace/rank_",
          "/run/torchtitan/outputs/comm_traces/rank_", "/run/torchtitan/outputs/comm_trace/rank_"]),
    # the recorder off: torchtitan leaves the agent's variable alone
    (["--comm.trace_buf_size", "0"], []),
    (["--comm.trace-buf-size=0", "--dump-folder", "out"], []),
    (["--comm.trace-buf-size=5", "--dump-folder", "out", "--comm.save-traces-folder", "t"], ["/run/out/t/rank_"]),
    # remote or path-like prefixes: nothing the agent could wait on
    (["--dump-folder", "s3://b/run"], []),
    (["--dump-folder", "o", "--comm.save-traces-folder", "t", "--comm.save-traces-file-prefix", "../x"], []),
]


@pytest.mark.parametrize(("flags", "expected"), TRACES)
def test_trace_stems_of_torchtitan(flags: list[str], expected: list[str]) -> None:
    assert trace_stems("torchtitan", TITAN + flags, "/run") == expected


def test_other_programs_leave_the_agents_flight_recorder_file_alone() -> None:
    for adapter in ("lightning", "torchrun", "none", "reference"):
        assert trace_stems(adapter, TITAN + ["--dump-folder", "out"], "/run") == []
