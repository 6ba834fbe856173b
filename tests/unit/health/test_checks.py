"""Each pre-flight check against real files, real directories and real processes.

The GPU query runs a real executable that prints captured nvidia-smi output (no GPU here); the
kernel log is a real text file (the emulated source) and this machine's /dev/kmsg where it is
readable; the NVMe check writes real bytes, with a fake free-space source only where a full disk
is needed; site commands are real processes.
"""

from __future__ import annotations

import os
import stat
import sys
import textwrap

import pytest

from slurmkit.health.extra import run_site_command
from slurmkit.health.gpus import SmiParseError, check_gpus, parse_query, visible_indices
from slurmkit.health.kernel_log import KernelLogCheck, KmsgSource, Message, TextLogSource, open_source, scan
from slurmkit.health.result import Verdict, overall, printable, skipped
from slurmkit.store.manifest import step_dir
from slurmkit.health.storage import GIB, MIB, check_nvme, check_shared_path, newest_step_bytes

# nvidia-smi --query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits
SMI_8 = "".join(f"{i}, 00000000:{0x18 + i:02X}:00.0, 0\n" for i in range(8))
SMI_NO_ECC = "0, 00000000:01:00.0, [N/A]\n1, 00000000:02:00.0, [N/A]\n"
XID_79 = "[ 5123.402211] NVRM: Xid (PCI:0000:3b:00): 79, pid=2811, GPU has fallen off the bus."
XID_13 = "[ 5100.000001] NVRM: Xid (PCI:0000:3b:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1)"


def fake_smi(tmp_path, stdout: str, code: int = 0, stderr: str = "") -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        sys.stdout.write({stdout!r}); sys.stderr.write({stderr!r}); sys.exit({code})
        """))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# ------------------------------------------------------------------ GPUs
def test_parse_query_reads_indices_bus_ids_and_ecc() -> None:
    gpus = parse_query(SMI_8)
    assert [g.index for g in gpus] == list(range(8)) and gpus[3].bus_id == "00000000:1B:00.0"
    assert all(g.ecc_uncorrected == 0 for g in gpus)
    assert [g.ecc_uncorrected for g in parse_query(SMI_NO_ECC)] == [None, None]
    with pytest.raises(SmiParseError):
        parse_query("Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error\n")


def test_visible_indices() -> None:
    assert visible_indices({"CUDA_VISIBLE_DEVICES": "0,2"}) == [0, 2]
    assert visible_indices({"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d"}) is None
    assert visible_indices({}) is None


def test_gpus_counted_as_planned_pass(tmp_path) -> None:
    r = check_gpus(8, fake_smi(tmp_path, SMI_8), {"PATH": os.environ["PATH"]}, timeout_s=30)
    assert r.verdict == Verdict.OK and r.figures["gpus_found"] == 8, r


def test_a_missing_gpu_fails_the_node(tmp_path) -> None:
    seven = "".join(SMI_8.splitlines(keepends=True)[:7])
    r = check_gpus(8, fake_smi(tmp_path, seven), {"PATH": os.environ["PATH"]}, timeout_s=30)
    assert r.verdict == Verdict.BAD_NODE and r.figures["gpus_found"] == 7
    assert r.message.startswith("Detected: 7 GPU(s) found, 8 planned") and "Fix: drain the node" in r.message
    # One of Slurm's devices gone, even with enough others listed.
    r = check_gpus(2, fake_smi(tmp_path, SMI_8), {"CUDA_VISIBLE_DEVICES": "3,9"}, timeout_s=30)
    assert r.verdict == Verdict.BAD_NODE and "[9]" in r.detected


def test_uncorrected_ecc_and_a_failing_query_fail_the_node(tmp_path) -> None:
    ecc = SMI_8.replace("1C:00.0, 0", "1C:00.0, 2")
    r = check_gpus(8, fake_smi(tmp_path, ecc), {}, timeout_s=30)
    assert r.verdict == Verdict.BAD_NODE and r.figures["ecc_uncorrected"] == 2 and "GPU 4: 2" in r.detected
    r = check_gpus(8, fake_smi(tmp_path, "", 15, "Unable to determine the device handle for GPU0000:3B:00.0"), {},
                   timeout_s=30)
    assert r.verdict == Verdict.BAD_NODE and "exited 15" in r.detected and "device handle" in r.detected


def test_cpu_layout_and_no_nvidia_smi_are_skipped_with_a_reason(tmp_path) -> None:
    r = check_gpus(0, "nvidia-smi", {}, timeout_s=1)
    assert r.verdict == Verdict.SKIPPED and "CPU layout" in r.detected
    r = check_gpus(4, "nvidia-smi-not-here", {"PATH": str(tmp_path)}, timeout_s=1)
    assert r.verdict == Verdict.SKIPPED and "not found" in r.detected


# ------------------------------------------------------------------ kernel log
def test_scan_fails_on_bad_xids_and_hardware_errors_only() -> None:
    msgs = [Message(5123.4, XID_79), Message(5100.0, XID_13), Message(None, "usb 1-1: new device"),
            Message(10.0, "EDAC MC0: 1 UE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"),
            Message(11.0, "mce: [Hardware Error]: Machine check events logged"),  # corrected: not a fault
            Message(12.0, "EDAC MC0: 3 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0")]
    found, other = scan(msgs, [79], since_uptime_s=None)
    assert [(f.kind, f.xid) for f in found] == [("xid", 79), ("hardware", None)] and other == 1
    found, _ = scan(msgs, [79], since_uptime_s=5000.0)  # the old memory error is past the lookback
    assert [f.xid for f in found] == [79]


def test_text_log_source_reads_only_what_is_new(tmp_path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("boot\n" + XID_13 + "\n")
    src = TextLogSource(str(log))
    assert [m.text for m in src.read_new()] == ["boot", XID_13]
    assert src.read_new() == []
    with open(log, "a") as f:
        f.write(XID_79 + "\npartial line without its newline")
    (m,) = src.read_new()
    assert m.text == XID_79 and m.uptime_s == pytest.approx(5123.402211)
    log.write_text("rotated\n")  # shorter than the offset: read from the start
    assert [m.text for m in src.read_new()] == ["rotated"]


def test_kernel_log_check_fails_on_an_emulated_xid_since_the_last_check(tmp_path) -> None:
    log = tmp_path / "node2.kmsg"
    log.write_text("[ 4000.0] eth0: link up\n")
    check = KernelLogCheck(open_source(str(log)), [79], lookback_s=3600, uptime=lambda: 6000.0)
    assert check().verdict == Verdict.OK
    with open(log, "a") as f:
        f.write(XID_79 + "\n")
    r = check()
    assert r.verdict == Verdict.BAD_NODE and "Xid 79" in r.detected and "fallen off the bus" in r.detected
    assert check().verdict == Verdict.OK  # reported once: since the last check, nothing new


def test_kernel_log_first_check_looks_back_only_lookback_s(tmp_path) -> None:
    log = tmp_path / "k.log"
    log.write_text(XID_79 + "\n")  # 5123 s after boot
    assert KernelLogCheck(TextLogSource(str(log)), [79], 600, uptime=lambda: 9000.0)().verdict == Verdict.OK
    assert KernelLogCheck(TextLogSource(str(log)), [79], 600, uptime=lambda: 5200.0)().verdict == Verdict.BAD_NODE


def test_unreadable_kernel_log_is_skipped_with_a_reason(tmp_path) -> None:
    r = KernelLogCheck(open_source(str(tmp_path / "missing")), [79], 60)()
    assert r.verdict == Verdict.SKIPPED and "not readable" in r.detected


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable on this machine")
def test_dev_kmsg_reads_records_and_then_only_new_ones() -> None:
    src = KmsgSource()
    first = src.read_new()
    assert first and src.last_seq is not None and all(m.uptime_s is not None for m in first)
    with open("/proc/uptime") as f:
        assert first[-1].uptime_s <= float(f.read().split()[0])  # type: ignore[operator]
    seq = src.last_seq
    assert all(True for _ in src.read_new()) and src.last_seq >= seq


# ------------------------------------------------------------------ NVMe and shared tiers
def test_nvme_ok_writes_and_measures(tmp_path) -> None:
    d = tmp_path / "nvme" / "node1"
    r = check_nvme(str(d), min_free_bytes=1 * MIB, probe_bytes=4 * MIB, min_write_mb_s=0)
    assert r.verdict == Verdict.OK and r.figures["write_mb_s"] > 0 and d.is_dir()
    assert os.listdir(d) == []  # the probe file is gone


def test_nvme_without_the_space_a_save_needs_fails_the_node(tmp_path) -> None:
    d = tmp_path / "nvme"
    step = d / step_dir(20)
    step.mkdir(parents=True)
    (step / "shard0.distcp").write_bytes(b"x" * 300_000)
    (d / step_dir(10)).mkdir()
    assert newest_step_bytes(str(d)) == 300_000
    # 200 kB free: enough for the configured floor (100 kB), not for another save like the last.
    r = check_nvme(str(d), min_free_bytes=100_000, probe_bytes=0, min_write_mb_s=0, free=lambda p: 200_000)
    assert r.verdict == Verdict.BAD_NODE and r.figures["need_gb"] == round(300_000 / GIB, 3)
    assert "free on the NVMe tier" in r.detected and "Fix: free space under" in r.message


def test_nvme_that_cannot_be_written_fails_the_node(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = check_nvme(str(blocker / "node1"), min_free_bytes=0, probe_bytes=MIB, min_write_mb_s=0)
    assert r.verdict == Verdict.BAD_NODE and "cannot create" in r.detected


def test_nvme_below_the_write_speed_floor_fails_the_node(tmp_path) -> None:
    ticks = iter([0.0, 10.0, 20.0, 30.0])  # 4 MiB in 10 s, twice: 0.4 MiB/s
    r = check_nvme(str(tmp_path), min_free_bytes=0, probe_bytes=4 * MIB, min_write_mb_s=50,
                   clock=lambda: next(ticks))
    assert r.verdict == Verdict.BAD_NODE and r.figures["write_mb_s"] == 0.4 and "0.4 MiB/s" in r.detected
    ticks = iter([0.0, 10.0, 20.0, 20.01])  # one slow write, then a fast one: a burst, not a bad disk
    r = check_nvme(str(tmp_path), min_free_bytes=0, probe_bytes=4 * MIB, min_write_mb_s=50,
                   clock=lambda: next(ticks))
    assert r.verdict == Verdict.OK and r.figures["write_mb_s"] == 400.0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_nvme_on_a_full_tmpfs_fails_the_node(tmp_path) -> None:
    import subprocess

    d = tmp_path / "tmpfs"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], check=True)
    try:
        (d / "fill").write_bytes(b"x" * (2 * MIB - 8192))
        r = check_nvme(str(d / "node1"), min_free_bytes=MIB, probe_bytes=MIB, min_write_mb_s=0)
        assert r.verdict == Verdict.BAD_NODE and r.figures["free_gb"] < 0.001, r
        # Enough free to pass the floor, too little for the probe: the write itself fails.
        r = check_nvme(str(d / "node1"), min_free_bytes=0, probe_bytes=MIB, min_write_mb_s=0)
        assert r.verdict == Verdict.BAD_NODE and "failed" in r.detected, r
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_shared_tier_answers_or_waits(tmp_path) -> None:
    r = check_shared_path("shared:lustre", str(tmp_path / "ckpt" / "run"))
    assert r.verdict == Verdict.OK and "not made yet" in r.detected and not (tmp_path / "ckpt").exists()
    (tmp_path / "ckpt" / "run").mkdir(parents=True)
    assert check_shared_path("shared:lustre", str(tmp_path / "ckpt" / "run")).verdict == Verdict.OK
    blocker = tmp_path / "f"
    blocker.write_text("")
    r = check_shared_path("shared:lustre", str(blocker) + "/x")  # its parent is a file: ENOTDIR
    assert r.verdict == Verdict.WAIT and "not the cause" in r.message


# ------------------------------------------------------------------ site commands
def test_site_command_exit_codes_timeouts_and_bounded_output(tmp_path) -> None:
    env = {"PATH": os.environ["PATH"]}
    assert run_site_command([sys.executable, "-c", "print('fine')"], env, 30, 100).verdict == Verdict.OK
    r = run_site_command([sys.executable, "-c", "import sys; print('ib0 down'); sys.exit(3)"], env, 30, 100)
    assert r.verdict == Verdict.BAD_NODE and r.figures["exit_code"] == 3 and "ib0 down" in r.detected
    flood = "import sys; sys.stdout.write('x' * 5_000_000 + '\\x1b[2Jthe end')"
    r = run_site_command([sys.executable, "-c", flood], env, 30, 64)
    assert r.verdict == Verdict.OK and len(str(r.figures["output"])) <= 64
    assert str(r.figures["output"]).endswith("?[2Jthe end")  # the escape character is neutralised
    r = run_site_command([sys.executable, "-c", "import time; print('stuck', flush=True); time.sleep(600)"],
                         env, 0.5, 100)
    assert r.verdict == Verdict.WAIT and r.figures["exit_code"] == -1 and "killed" in r.detected  # slow, not bad
    r = run_site_command([str(tmp_path / "no-such-check")], env, 5, 100)
    assert r.verdict == Verdict.BAD_NODE and "cannot run" in r.detected


def test_overall_and_printable() -> None:
    ok_ = skipped("a", "x")
    assert overall([]) == Verdict.OK and overall([ok_]) == Verdict.OK
    assert printable("a\x00b\nc", 10) == "a?b\nc" and printable("abcdef", 3) == "def"
