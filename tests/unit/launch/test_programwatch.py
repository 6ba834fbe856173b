"""ProgramWatch: a third-party program's lines and checkpoint folder, as rank 0's agent reads them."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurmkit.errors import ConfigError
from slurmkit.launch.programwatch import CKPT_SCAN_S, ProgramWatch

TITAN = ["torchrun", "--nproc-per-node=2", "-m", "torchtitan.train", "--module", "llama3",
         "--training.steps", "40", "--checkpoint.enable", "--dump-folder", "out"]
# torchtitan 0.3.0's metric line as rank 0 logs it, colour codes included
TITAN_LINE = ("[titan] 2026-12-01 10:00:00,123 - root - INFO - \x1b[31mstep:  5  \x1b[32mloss:  5.19840  "
              "\x1b[38;2;180;60;0mgrad_norm:  2.4822  \x1b[33mmemory:  1.23GiB(3.10%)  \x1b[34mtps: 12,345  "
              "\x1b[36mtflops: 0.01  \x1b[35mmfu: 2.50%\x1b[39m")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def job(command: list[str], program: str = "auto", pattern: str = "", glob: str = "") -> SimpleNamespace:
    return SimpleNamespace(command=command, program=program, progress_pattern=pattern, checkpoint_glob=glob)


def test_the_reference_trainer_and_an_unreadable_program_get_no_watch(tmp_path: Path) -> None:
    assert ProgramWatch.for_job(job(["python", "-m", "slurmkit.train"]), str(tmp_path)) is None
    assert ProgramWatch.for_job(job(["python", "/x/train.py"]), str(tmp_path)) is None
    with pytest.raises(ConfigError, match="job.program"):
        ProgramWatch.for_job(job(["python", "/x/train.py"], program="megatron"), str(tmp_path))


def test_torchtitans_lines_give_rank0s_step_figures_and_its_commands_total(tmp_path: Path) -> None:
    watch = ProgramWatch.for_job(job(TITAN), str(tmp_path))
    assert watch is not None and watch.adapter == "torchtitan" and watch.reads_lines
    assert watch.sample() == {"total_steps": 40}  # nothing printed yet: no step, no figures
    assert watch.on_line(1, TITAN_LINE.replace("step:  5", "step:  9")) is None  # only rank 0's lines count
    saving = watch.on_line(0, "[titan] 2026-12-01 10:00:00,001 - root - INFO - Saving the checkpoint.")
    assert saving is not None and (saving.step, saving.saving) == (None, True)  # the monitor's clock stops
    assert watch.sample() == {"total_steps": 40}
    heard = watch.on_line(0, TITAN_LINE)
    assert heard is not None and (heard.step, heard.saving) == (5, None)
    got = watch.sample()
    assert got["step"] == 5 and got["total_steps"] == 40
    assert got["metrics"]["loss"] == pytest.approx(5.1984) and got["metrics"]["tokens_per_s"] == 12345
    assert got["metrics"]["mfu"] == pytest.approx(0.025)  # a fraction, never the printed percent


def test_a_torchrun_scripts_pattern_reads_its_own_words(tmp_path: Path) -> None:
    watch = ProgramWatch.for_job(job(["torchrun", "--nproc-per-node=2", "/x/train.py"],
                                     pattern=r"epoch \d+ it (?P<step>\d+) loss=(?P<loss>[0-9.]+)"), str(tmp_path))
    assert watch is not None and watch.reads_lines
    for hostile in ("epoch 1 it -3 loss=1.0", "x" * 100_000, "epoch 1 it 99999999999999999999 loss=1", "\x00\xff"):
        watch.on_line(0, hostile)
    assert "step" not in watch.sample()
    watch.on_line(0, "epoch 1 it 12 loss=0.75")
    assert watch.sample() == {"step": 12, "metrics": {"loss": 0.75}}


def _titan_save(folder: Path, step: int, done: bool = True) -> None:
    d = folder / f"step-{step}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * 64)
    if done:
        (d / ".metadata").write_bytes(b"meta")


def test_finished_saves_are_found_once_each_after_those_of_an_earlier_allocation(tmp_path: Path) -> None:
    clock = Clock()
    folder = tmp_path / "out" / "checkpoint"
    _titan_save(folder, 10)  # an earlier allocation's: recorded then, not again
    watch = ProgramWatch("torchtitan", command=TITAN, run_dir=str(tmp_path), clock=clock)
    assert watch.folders == [str(folder)]
    assert watch.new_checkpoints() == [] and watch.saved == 10
    _titan_save(folder, 15)
    assert watch.new_checkpoints() == []  # listed at most every CKPT_SCAN_S
    clock.t += CKPT_SCAN_S
    _titan_save(folder, 20, done=False)  # being written: no .metadata yet
    assert watch.new_checkpoints() == [(15, str(folder / "step-15"))]
    clock.t += CKPT_SCAN_S
    (folder / "step-20" / ".metadata").write_bytes(b"meta")
    _titan_save(folder, 25)
    assert watch.new_checkpoints() == [(20, str(folder / "step-20")), (25, str(folder / "step-25"))]
    clock.t += CKPT_SCAN_S
    assert watch.new_checkpoints() == []


def test_a_glob_names_the_folder_absolute_or_in_the_run_directory(tmp_path: Path) -> None:
    clock = Clock()
    run_dir = tmp_path / "run"
    (run_dir / "ckpt").mkdir(parents=True)
    watch = ProgramWatch("none", command=["python", "/x/t.py"], run_dir=str(run_dir), glob="ckpt/snap-{step}.bin",
                         clock=clock)
    assert watch.folders == [str(run_dir / "ckpt")] and not watch.reads_lines
    assert watch.new_checkpoints() == []
    (run_dir / "ckpt" / "snap-7.bin").write_bytes(b"7")
    os.symlink("/etc/passwd", run_dir / "ckpt" / "snap-9.bin")  # a link in the folder is never taken
    clock.t += CKPT_SCAN_S
    assert watch.new_checkpoints() == [(7, str(run_dir / "ckpt" / "snap-7.bin"))]
    absolute = ProgramWatch("none", command=["python", "/x/t.py"], run_dir="/elsewhere",
                            glob=f"{run_dir}/ckpt/snap-{{step}}.bin")
    assert absolute.folders == [str(run_dir / "ckpt")]


def test_each_generation_starts_from_the_programs_newest_save_once_its_first_step_line_comes(tmp_path: Path) -> None:
    clock = Clock()
    folder = tmp_path / "out" / "checkpoint"
    watch = ProgramWatch("torchtitan", command=TITAN, run_dir=str(tmp_path), clock=clock)
    watch.begin_generation()
    assert watch.new_checkpoints() == [] and watch.generation_start() is None  # no step line yet
    watch.on_line(0, TITAN_LINE.replace("step:  5", "step:  1"))
    assert watch.generation_start() == 0  # a fresh start: no save
    assert watch.generation_start() is None  # once per generation
    _titan_save(folder, 10)
    watch.on_line(0, TITAN_LINE.replace("step:  5", "step: 12"))
    # generation 1: the save finished just before the failure is listed at once (not 10 s later)
    watch.begin_generation()
    assert watch.sample() == {"total_steps": 40}  # the last generation's step and figures are not its own
    assert watch.new_checkpoints() == [(10, str(folder / "step-10"))]
    watch.on_line(0, TITAN_LINE.replace("step:  5", "step: 11"))
    assert watch.generation_start() == 10


def test_a_program_whose_saves_cannot_be_seen_starts_from_the_step_before_its_first_line(tmp_path: Path) -> None:
    watch = ProgramWatch("none", command=["python", "train.py"], run_dir=str(tmp_path),
                         pattern=r"^it (?P<step>\d+)$")
    watch.begin_generation()
    watch.on_line(0, "it 31")
    assert watch.generation_start() == 30
