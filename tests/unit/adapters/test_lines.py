"""Progress read from what a program prints (issue 36): a table of real lines, several versions
of each program where they differ, and hostile ones, which must never raise or be believed.

torchtitan's lines are spelled as its ``MetricsProcessor.log`` f-string spells them in each
version (pytorch/torchtitan: ``torchtitan/components/metrics.py`` in 0.3.0 from PyPI, v0.2.2,
v0.2.1, v0.2.0 and v0.1.0; ``train.py`` before 2025-02), with its ``Color`` codes and its logger's
``[titan] %(asctime)s - %(name)s - %(levelname)s - `` prefix; the 0.3.0 one is also the line
/work/shared/reference/trainers.md recorded from a real run. Lightning's states were captured
from a real ``Trainer.fit`` (lightning 2.6.6, TQDMProgressBar, CPU, accumulate_grad_batches=2:
its checkpoint was ``epoch=1-step=10.ckpt`` while the bar counted 10/10 batches per epoch).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from slurmkit.adapters import MAX_LINE_BYTES, Progress, compile_pattern, parse_line, save_phase

RED, GREEN, YELLOW, BLUE, MAGENTA, CYAN, RESET = (f"\x1b[{n}m" for n in (31, 32, 33, 34, 35, 36, 39))
ORANGE, TURQUOISE = "\x1b[38;2;180;60;0m", "\x1b[38;2;54;234;195m"
TITAN = "[titan] 2026-12-01 10:00:00,123 - root - INFO - "

TORCHTITAN_LINES = [
    # 0.3.0 (PyPI), as trainers.md recorded it (colour codes dropped)
    (TITAN + "step:  5  loss:  5.19840  grad_norm:  2.4822  memory:  1.23GiB(3.10%)  tps: 375  "
     "tflops: 0.01  mfu: 0.00%", Progress(5, 5.1984, 375.0, 0.0, 0.01)),
    # 0.3.0 / 0.2.2 with its colours: loss %8.5f, thousands separators in tps and tflops
    (TITAN + f"{RED}step: 120  {GREEN}loss:  2.71828  {ORANGE}grad_norm:  0.3141  {TURQUOISE}memory: "
     f"61.20GiB(77.28%)  {BLUE}tps: 12,345  {CYAN}tflops: 1,234.56  {MAGENTA}mfu: 41.25%{RESET}",
     Progress(120, 2.71828, 12345.0, 0.4125, 1234.56)),
    # 0.3.0 when it cannot tell the MFU (FP8/MX): N/A is unknown, not 0
    (TITAN + f"{RED}step: 40  {GREEN}loss:  3.00000  {ORANGE}grad_norm:  1.0000  {TURQUOISE}memory: "
     f"10.00GiB(12.00%)  {BLUE}tps: 9,001  {CYAN}tflops: 410.20  {MAGENTA}mfu: N/A{RESET}",
     Progress(40, 3.0, 9001.0, None, 410.2)),
    # 0.2.0 and 0.2.1: loss %7.4f
    (TITAN + f"{RED}step: 10  {GREEN}loss:  8.1234  {ORANGE}grad_norm:  5.5000  {TURQUOISE}memory:  "
     f"2.50GiB(3.15%)  {BLUE}tps: 1,024  {CYAN}tflops: 0.12  {MAGENTA}mfu: 0.01%{RESET}",
     Progress(10, 8.1234, 1024.0, 0.0001, 0.12)),
    # 0.1.0 (2025-06): no grad_norm, memory in yellow
    (TITAN + f"{RED}step:  1  {GREEN}loss: 10.8470  {YELLOW}memory:  0.38GiB(0.48%)  {BLUE}tps: 2,310  "
     f"{CYAN}tflops: 0.17  {MAGENTA}mfu: 0.02%{RESET}", Progress(1, 10.847, 2310.0, 0.0002, 0.17)),
    # 2024 (before tflops, and before tps was named so, train.py): wps, step in cyan
    (TITAN + f"{CYAN}step: 30  {GREEN}loss:  6.9900  {YELLOW}memory: 12.00GiB(15.00%)  {BLUE}wps: 5,120  "
     f"{MAGENTA}mfu: 3.21%{RESET}", Progress(30, 6.99, 5120.0, 0.0321, None)),
    # colour printing off, under torchrun's --tee / --local-ranks-filter prefixes
    ("[rank0]:" + TITAN + "step: 7  loss:  4.00000  grad_norm:  1.0000  memory:  1.00GiB(1.00%)  tps: 10  "
     "tflops: 0.00  mfu: 0.00%", Progress(7, 4.0, 10.0, 0.0, 0.0)),
    ("[default0]:" + TITAN + "step: 8  loss:  3.90000  grad_norm:  1.0000  memory:  1.00GiB(1.00%)  tps: 10  "
     "tflops: 0.00  mfu: 0.00%", Progress(8, 3.9, 10.0, 0.0, 0.0)),
    # a diverged run: the loss is unknown, the step stands
    (TITAN + "step: 50  loss:      nan  grad_norm:      nan  memory:  1.23GiB(3.10%)  tps: 375  "
     "tflops: 0.01  mfu: 0.00%", Progress(50, None, 375.0, 0.0, 0.01)),
    # lines of torchtitan that are no training progress
    (TITAN + f"{YELLOW}validate step: 50  {GREEN}loss:  4.1234  {TURQUOISE}memory:  1.23GiB(3.10%)  "
     f"{BLUE}tps: 1,200{RESET}", None),
    (TITAN + "Training starts at step 11", None),
    (TITAN + "Loading the checkpoint from ./outputs/checkpoint/step-10.", None),
    (TITAN + "Saving the checkpoint (or staging if async is enabled).", None),
    (TITAN + "Finished saving the checkpoint (or staging if async is enabled)in 0.26 seconds.", None),
    (TITAN + "No checkpoint was provided, this is a fresh start.", None),
]

# captured from lightning 2.6.6's TQDMProgressBar (each state follows a \r on one line)
LIGHTNING_STATES = [
    "Training: |          | 0/? [00:00<?, ?it/s]",
    "Epoch 0:   0%|          | 0/10 [00:00<?, ?it/s]",
    "Epoch 0:  10%|█         | 1/10 [00:04<00:36,  0.25it/s]",
    "Epoch 0:  10%|█         | 1/10 [00:04<00:36,  0.25it/s, v_num=0, train_loss=0.371]",
    "Epoch 0:  20%|██        | 2/10 [00:05<00:20,  0.38it/s, v_num=0, train_loss=0.496]",
    "Epoch 0:  30%|███       | 3/10 [00:05<00:13,  0.51it/s, v_num=0, train_loss=0.925]",
    "Epoch 0: 100%|██████████| 10/10 [00:07<00:00,  1.33it/s, v_num=0, train_loss=0.252]",
    "Epoch 1: 100%|██████████| 10/10 [00:00<00:00, 19.61it/s, v_num=0, train_loss=0.265]",
]

LIGHTNING_LINES = [
    (LIGHTNING_STATES[0], None),
    (LIGHTNING_STATES[2], None),  # no metric yet
    (LIGHTNING_STATES[3], Progress(loss=0.371)),  # 1/10 is a batch, not the step: unknown
    (LIGHTNING_STATES[7], Progress(loss=0.265)),  # 10/10 at step 10 of 2 epochs (accumulation 2)
    # Lightning 1.x: its own running loss in the postfix, the rate as s/it
    ("Epoch 3:  40%|████      | 4/10 [00:01<00:01,  1.21s/it, loss=2.31, v_num=12]", Progress(loss=2.31)),
    # on_step and on_epoch: the step's value
    ("Epoch 2:  50%|#####     | 5/10 [00:02<00:02,  2.00it/s, v_num=3, train_loss_step=1.230, "
     "train_loss_epoch=1.500]", Progress(loss=1.23)),
    ("Epoch 0:  50%|█████     | 5/10 [00:02<00:02,  2.00it/s, v_num=3, train/loss=0.125]", Progress(loss=0.125)),
    ("Epoch 0:  50%|█████     | 5/10 [00:02<00:02,  2.00it/s, v_num=3, val_acc=0.900]", None),  # no loss
    # an iterable dataset of unknown length
    ("Epoch 0: |          | 7/? [00:02<00:00,  3.01it/s, v_num=1, train_loss=1.10e+03]", Progress(loss=1100.0)),
    ("Validation DataLoader 0:  50%|█████     | 1/2 [00:00<00:00, 99.00it/s]", None),
    # the rich bar (the default since 2.6 when rich is installed) as it leaves a non-terminal: not read
    ("Epoch 1/1  ━━━━━━━━━━━━━━━━━ 10/10 0:00:07 • 0:00:00 1.55it/s v_num: 0.000      ", None),
    ("train_loss: 0.592 ", None),
]


@pytest.mark.parametrize(("line", "expected"), TORCHTITAN_LINES)
def test_torchtitan_lines(line: str, expected: Progress | None) -> None:
    assert parse_line("torchtitan", line) == expected
    assert parse_line("torchtitan", line.encode() + b"\n") == expected  # bytes as a rank wrote them


SAVE_LINES = [
    # torchtitan's CheckpointManager.save, 0.1.0 to 0.2.2, and 0.3.0 as recorded from a real run
    (TITAN + "Saving the checkpoint (or staging if async is enabled).", True),
    (TITAN + "Saving the checkpoint.", True),
    (TITAN + "Saving a full checkpoint at last step, step 60.", True),
    (TITAN + "Saving a model only checkpoint in torch.float32 at last step, step 60.", True),
    (TITAN + "Finished saving the checkpoint (or staging if async is enabled)in 0.26 seconds.", False),
    (TITAN + "Finished saving the checkpoint in 0.26 seconds", False),
    # 0.3.0 (components/checkpointer/dcp.py): async staging, and the last step's own end
    (TITAN + "Staging the checkpoint.", True),
    (TITAN + "Finished staging the checkpoint in 0.11 seconds.", False),
    (TITAN + "Last step checkpoint completed in 0.38s", False),
    ("[rank0]:" + TITAN + f"{GREEN}Saving the checkpoint.{RESET}", True),  # a launcher's prefix, colour
    # anything else is neither: a metric line, loading, a user's print, a WARNING
    (TITAN + "step:  5  loss:  5.19840  grad_norm:  2.4822", None),
    (TITAN + "Loading the checkpoint from ./outputs/checkpoint/step-10.", None),
    ("Saving the checkpoint.", None),  # not torchtitan's logger
    ("[titan] 2026-12-01 10:00:00,123 - root - WARNING - Saving the checkpoint.", None),
    (TITAN + "Savings account", None),
    ("\x00" * 10 + "Saving", None),
]


@pytest.mark.parametrize(("line", "expected"), SAVE_LINES)
def test_torchtitans_announced_saves(line: str, expected: bool | None) -> None:
    assert save_phase("torchtitan", line) is expected
    assert save_phase("torchtitan", line.encode()) is expected
    assert save_phase("lightning", line) is None and save_phase("none", line) is None


@pytest.mark.parametrize(("line", "expected"), LIGHTNING_LINES)
def test_lightning_lines(line: str, expected: Progress | None) -> None:
    assert parse_line("lightning", line) == expected
    assert parse_line("lightning", "\r" + line) == expected


def test_each_program_reads_only_its_own_lines() -> None:
    titan = TORCHTITAN_LINES[0][0]
    bar = LIGHTNING_STATES[3]
    assert parse_line("lightning", titan) is None
    assert parse_line("torchtitan", bar) is None
    for adapter in ("torchrun", "none", "reference", "auto", "no-such-adapter"):
        assert parse_line(adapter, titan) is None
        assert parse_line(adapter, bar) is None


def test_a_chunk_of_bar_states_gives_the_last_complete_one() -> None:
    chunk = "\r" + "\r".join(LIGHTNING_STATES[:6])
    assert parse_line("lightning", chunk) == Progress(loss=0.925)
    # a write cut short: the state without its closing bracket is not read
    cut = chunk + "\rEpoch 0:  40%|████      | 4/10 [00:06<00:09,  0.61it/s, v_num=0, train_lo"
    assert parse_line("lightning", cut) == Progress(loss=0.925)
    assert parse_line("lightning", chunk + "\rEpoch 0:  40%|████      | 4/10 [00:06<00:09,  0.6") == \
        Progress(loss=0.925)
    # the bar's epoch-long line, longer than a line is read whole: its last states count
    epoch = ("\r" + "\r".join(LIGHTNING_STATES[1:])) * 12 + "\n"
    assert len(epoch.encode()) > MAX_LINE_BYTES
    assert parse_line("lightning", epoch) == Progress(loss=0.265)
    assert parse_line("lightning", epoch.encode()) == Progress(loss=0.265)


def test_several_lines_give_the_last() -> None:
    lines = "\n".join(line for line, _ in TORCHTITAN_LINES[:3])
    assert parse_line("torchtitan", lines) == TORCHTITAN_LINES[2][1]
    assert parse_line("torchtitan", lines + "\n" + TORCHTITAN_LINES[-1][0] + "\n") == TORCHTITAN_LINES[2][1]


def _titan(step: str = "5", loss: str = "1.00000", tps: str = "375", tflops: str = "0.01",
           mfu: str = "0.00%") -> str:
    return (f"{TITAN}step: {step}  loss: {loss}  grad_norm:  2.4822  memory:  1.23GiB(3.10%)  tps: {tps}  "
            f"tflops: {tflops}  mfu: {mfu}")


HOSTILE = [
    # figures out of range are unknown; a step that is no count drops the line
    (_titan(step="9007199254740991"), Progress(2 ** 53 - 1, 1.0, 375.0, 0.0, 0.01)),
    (_titan(step="9007199254740992"), None),
    (_titan(step="9" * 30), None),
    (_titan(step="-1"), None),
    (_titan(step="٣"), None),  # a digit, but not an ASCII one
    (_titan(step="５"), None),
    (_titan(loss="1e999"), Progress(5, None, 375.0, 0.0, 0.01)),
    (_titan(loss="-inf"), Progress(5, None, 375.0, 0.0, 0.01)),
    (_titan(loss="1_000"), Progress(5, None, 375.0, 0.0, 0.01)),
    (_titan(loss="9" * 41), Progress(5, None, 375.0, 0.0, 0.01)),
    (_titan(tps="-375"), Progress(5, 1.0, None, 0.0, 0.01)),
    (_titan(tps="1,2,3"), Progress(5, 1.0, None, 0.0, 0.01)),
    (_titan(tps="NaN"), Progress(5, 1.0, None, 0.0, 0.01)),
    (_titan(mfu="150.00%"), Progress(5, 1.0, 375.0, None, 0.01)),
    (_titan(mfu="-3.00%"), Progress(5, 1.0, 375.0, None, 0.01)),
    (_titan(mfu="1e3%"), Progress(5, 1.0, 375.0, None, 0.01)),
    (_titan(tflops="inf"), Progress(5, 1.0, 375.0, 0.0, None)),
    (_titan(mfu="100.00%"), Progress(5, 1.0, 375.0, 1.0, 0.01)),
    # control characters and broken escapes around a real line
    ("\x00\x07\x1b[2J\x1b[999;999H" + _titan(), Progress(5, 1.0, 375.0, 0.0, 0.01)),
    ("\x1b[" + "9" * 100 + _titan(), Progress(5, 1.0, 375.0, 0.0, 0.01)),
    ("\u202e\ud800" + _titan(), Progress(5, 1.0, 375.0, 0.0, 0.01)),
    ("", None), ("\r\r\r\n\n", None), ("step:", None), ("step: 5 loss:", None),
]


@pytest.mark.parametrize(("line", "expected"), HOSTILE)
def test_hostile_lines_are_read_or_dropped_never_raised_on(line: str, expected: Progress | None) -> None:
    assert parse_line("torchtitan", line) == expected


def test_bytes_that_are_not_utf8_are_tolerated() -> None:
    line = b"\xff\xfe\xc3(" + _titan().encode() + b"\xed\xa0\x80\xf8\x88\x80\x80\x80"
    assert parse_line("torchtitan", line) == Progress(5, 1.0, 375.0, 0.0, 0.01)
    assert parse_line("lightning", b"\xff" * 100 + LIGHTNING_STATES[3].encode()) == Progress(loss=0.371)
    assert parse_line("torchtitan", bytes(range(256)) * 10) is None


def test_a_line_over_the_bound_is_dropped() -> None:
    real = _titan()
    assert parse_line("torchtitan", real + " " * (MAX_LINE_BYTES - len(real))) is not None
    assert parse_line("torchtitan", real + " " * (MAX_LINE_BYTES + 1 - len(real))) is None
    assert parse_line("torchtitan", real.encode() + b"x" * MAX_LINE_BYTES) is None
    assert parse_line("torchtitan", "x" * 10 ** 6) is None
    # what follows a line break in its last MAX_LINE_BYTES is whole: read
    assert parse_line("torchtitan", "x" * 10 ** 6 + "\n" + real) == Progress(5, 1.0, 375.0, 0.0, 0.01)


def test_hostile_lines_cost_little() -> None:
    """Lines of MAX_LINE_BYTES built to make the readers backtrack: each is read quickly."""
    n = MAX_LINE_BYTES
    lines = ["step: " * (n // 6), "step: 5  loss: " * (n // 15), "\x1b[" * (n // 2), "\x1b[" + ";" * (n - 3),
             "Epoch 0:" * (n // 8), "Epoch 0: |" + "|" * (n - 10), "Epoch 0: ||1/1 [" + "," * (n - 20),
             "\r" * n, "1" * n, "mfu: " + "1" * (n - 6), ("Epoch 0: 1%|█| 1/2 [" + "a=1, " * 800)[:n]]
    pattern = compile_pattern(r"step (?P<step>\d+).*loss (?P<loss>[0-9.]+)")
    start = time.perf_counter()
    for line in lines:
        assert len(line) <= n
        for adapter in ("torchtitan", "lightning"):
            parse_line(adapter, line)
            parse_line(adapter, line, pattern)
    assert time.perf_counter() - start < 5  # about 0.1 s on an idle core


def test_a_users_pattern_reads_any_program() -> None:
    pattern = compile_pattern(r"epoch \d+ it (?P<step>\d+) loss (?P<loss>[0-9.]+)(?: mfu (?P<mfu_pct>[0-9.]+)%)?")
    line = "[rank0]: epoch 3 it 120 loss 2.31 mfu 40.5%"
    for adapter in ("torchrun", "none"):
        assert parse_line(adapter, line, pattern) == Progress(120, 2.31, None, 0.405, None)
        assert parse_line(adapter, line) is None  # nothing without the pattern
        assert parse_line(adapter, "epoch 3 it 99999999999999999 loss 2.31", pattern) is None
    # tried first for torchtitan and Lightning too, their own format after it
    assert parse_line("torchtitan", line, pattern) == Progress(120, 2.31, None, 0.405, None)
    assert parse_line("torchtitan", _titan(), pattern) == Progress(5, 1.0, 375.0, 0.0, 0.01)
    # the last state that either reads wins
    assert parse_line("torchrun", "it 1\repoch 1 it 7 loss 0.5\rjunk\n", pattern) == Progress(7, 0.5)


def test_a_real_torchtitan_0_3_0_cpu_log_with_a_kill_and_a_resume() -> None:
    """Rank 0's lines as torchtitan 0.3.0 printed them on CPU (tests/data, captured through
    tests/integration/titan_launcher.py, ANSI colours kept): every metric line gives its step and
    loss, the saves are announced and ended, nothing else reads as progress."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "data", "torchtitan_0.3.0_cpu.log")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    got = [(p.step, p.loss) for p in (parse_line("torchtitan", ln) for ln in lines) if p is not None]
    printed = [(int(m.group(1)), float(m.group(2))) for m in
               (re.search(r"step:\s+(\d+)\s+\S*loss:\s+([0-9.]+)", re.sub(r"\x1b\[[0-9;]*m", "", ln)) for ln in lines) if m]
    assert got == printed and [s for s, _ in got] == [*range(1, 9), *range(9, 13)], got
    phases = [save_phase("torchtitan", ln) for ln in lines]
    # four starts (steps 4, 8 and 12, the last announced twice) and two ends: the kill cut step 8's
    assert phases.count(True) == 4 and phases.count(False) == 2, phases
