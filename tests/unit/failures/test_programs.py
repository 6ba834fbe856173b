"""One answer to "does job.command run slurmkit's reference trainer?" (issue 35).

slurmkit.failures.programs.is_reference_trainer decides it for every place that asks: the rank
monitor (heartbeats expected), the supervisor (exit 0 after a signal), the hang stacks
(SIGUSR2), the warm standby, submit's memory plan and the chaos tests' process finder.
"""

from __future__ import annotations

import sys

import pytest

from slurmkit.cli import submit
from slurmkit.config import compose
from slurmkit.errors import ConfigError
from slurmkit.failures.programs import (REFERENCE_TRAINER, exit0_is_completion, expects_heartbeats,
                                        is_reference_trainer, reference_trainer_args)
from slurmkit.launch import standby
from testkit.chaos.procs import Proc, rank_of

REFERENCE = [
    ["python", "-m", "slurmkit.train"],
    ["python", "-m", "slurmkit.train", "train.steps=5"],
    ["python3", "-u", "-m", "slurmkit.train"],
    [sys.executable, "-m", "slurmkit.train"],
    ["nsys", "profile", "python", "-m", "slurmkit.train"],
]
OTHER = [
    ["python", "train.py"],
    ["torchrun", "--nproc_per_node=8", "train.py"],
    ["python", "-m", "slurmkit.examples.allreduce"],
    ["python", "-m", "slurmkit.train.planner"],  # a module that only starts with the name
    ["python", "-m", "slurmkit.trainer"],
    ["python", "compare.py", "--baseline", "slurmkit.train"],  # the name as another program's argument
    ["python", "/src/slurmkit.train/run.py"],
    ["slurmkit.train"],
    [],
]


@pytest.mark.parametrize("command", REFERENCE)
def test_the_reference_trainer_is_known_however_started(command: list[str]) -> None:
    assert is_reference_trainer(command)
    assert is_reference_trainer(tuple(command))  # a process's cmdline
    assert expects_heartbeats("auto", command) and exit0_is_completion("auto", command)


@pytest.mark.parametrize("command", OTHER)
def test_any_other_program_is_not_it(command: list[str]) -> None:
    assert not is_reference_trainer(command)
    assert not expects_heartbeats("auto", command) and not exit0_is_completion("auto", command)
    assert reference_trainer_args(command) is None and standby.trainer_args(command) is None


def test_a_standby_runs_only_the_exact_form_in_this_interpreter() -> None:
    assert reference_trainer_args(["/any/python", "-m", REFERENCE_TRAINER, "a=1"]) == ["a=1"]
    assert standby.trainer_args([sys.executable, "-m", REFERENCE_TRAINER, "a=1"]) == ["a=1"]
    assert standby.trainer_args(["/other/python", "-m", REFERENCE_TRAINER]) is None
    # the reference trainer, but not a form a standby can run in its own process
    assert reference_trainer_args([sys.executable, "-u", "-m", REFERENCE_TRAINER]) is None
    assert reference_trainer_args(["nsys", "profile", sys.executable, "-m", REFERENCE_TRAINER]) is None


def test_the_chaos_process_finder_asks_the_same() -> None:
    def proc(*cmdline: str) -> Proc:
        return Proc(pid=1, cmdline=cmdline, env={"RANK": "3"}, state="S", start=0, comm="python")

    assert rank_of(proc(sys.executable, "-m", REFERENCE_TRAINER)) == 3
    assert rank_of(proc(sys.executable, "compare.py", "-m", "x", "--baseline", REFERENCE_TRAINER)) is None


def _llama70b_ddp(command: str) -> object:
    # DDP of 70B does not fit any GPU: the reference trainer's memory plan refuses it
    return compose(["+exp=llama70b", "cluster=dgx_h100", "parallel.strategy=ddp",
                    "parallel.activation_checkpointing=false", f"job.command={command}"])


def test_submit_plans_memory_for_the_reference_trainer_only() -> None:
    """submit used to ask ``"slurmkit.train" in part`` of every word of job.command: a user's
    program that merely named the trainer (an argument, a path, slurmkit.train.planner) was
    refused for the reference trainer's memory plan of a model it does not run."""
    with pytest.raises(ConfigError, match="needs about"):
        submit.validate(_llama70b_ddp("[python,-u,-m,slurmkit.train]"))  # type: ignore[arg-type]
    submit.validate(_llama70b_ddp("[python,compare.py,--baseline,slurmkit.train]"))  # type: ignore[arg-type]
    submit.validate(_llama70b_ddp("[python,/src/slurmkit.train/run.py]"))  # type: ignore[arg-type]
