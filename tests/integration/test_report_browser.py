"""The report of a real run with three real faults, opened in a real browser.

One ``+exp=tiny`` job on the local Slurm cluster (2 nodes x 2 ranks and a spare, 20 steps, a
checkpoint every 5): SIGKILL of rank 3 after step 7, SIGSTOP of rank 1 after step 12, and the
node of ranks 2-3 killed after step 17 (the run goes on on the spare). The faults are driven
by tools/bench/mttr.py's helpers. Then ``python -m slurmkit.report`` writes report.html,
headless Chromium (Debian's package) renders it, and the test checks the screenshot is a
picture, the rendered timeline lists the three failures with their classes, and the goodput
figures are those of ``python -m slurmkit.supervise`` for the same ledger.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from types import ModuleType

import pytest

from tests.integration.helpers import slurm_env, wait_terminal

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["+exp=tiny", "model=micro", "train.steps=20", "train.ckpt_interval_steps=5", "train.micro_batch=1", "train.seq_len=32",
        "+job.env.SLURMKIT_STEP_DELAY_S=0.25", "parallel.pg_timeout_s=60",
        "supervisor.heartbeat_timeout_s=8", "supervisor.spare_nodes=1", "job.name=report-faults"]
FAULTS = [("crash", "rank_crash", 3), ("hang", "hang", 1), ("node_loss", "node_loss", -1)]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def mttr() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mttr_bench", os.path.join(REPO, "tools", "bench", "mttr.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mttr_bench"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_with_three_faults(env: dict[str, str], root: str) -> tuple[str, str]:
    """(job id, run dir) of a completed run that survived a crash, a hang and a node loss."""
    m = mttr()
    c = m.Cluster({**env, "PYTHONUNBUFFERED": "1"})
    job, run_dir = "", ""
    try:
        job, run_dir = m.submit_slurmkit(c, ARGS, root)
        since = float("-inf")
        for i, (kind, _, rank) in enumerate(FAULTS):
            (gen,) = m.wait_for("training again", lambda: m.fresh_generation(run_dir, since), 300.0,
                                c.clock, c.sleep, 0.5)
            m.wait_step(c, run_dir, 3 if rank < 0 else rank, 7 + 5 * i, gen, 240.0)  # past a save
            when, node = m.goodput_fault(c, run_dir, kind, since)
            since = float(m.first_event(c, run_dir, "failure", when - 1.0, 120.0)["t"])
            if node:
                c.restore_node(node)  # the run goes on on the spare; the cluster gets its node back
        state = wait_terminal(job, env, timeout_s=400)
        assert state == "COMPLETED", (state, run_dir)
        return job, run_dir
    except BaseException:
        c.cancel(job)
        raise
    finally:
        c.restore_all()


def chromium(args: list[str], profile: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium")
    assert exe, "no chromium: install Debian's package (tools/setup --cluster does: apt-get install chromium)"
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.timeout(1500)
def test_report_of_a_three_fault_run_in_chromium(cluster_env, tmp_path) -> None:
    env = {**slurm_env(cluster_env), "TMPDIR": str(tmp_path)}
    _, run_dir = run_with_three_faults(env, str(tmp_path))

    out = str(tmp_path / "report")
    rep = subprocess.run([sys.executable, "-m", "slurmkit.report", run_dir, "--out", out], env=env,
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    html_path = os.path.join(out, "report.html")
    sup = subprocess.run([sys.executable, "-m", "slurmkit.supervise", run_dir, "--json"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert sup.returncode == 0, sup.stderr
    figures = json.loads(sup.stdout)
    table = subprocess.run([sys.executable, "-m", "slurmkit.supervise", run_dir], env=env,
                           capture_output=True, text=True, timeout=120).stdout

    # A screenshot in a fresh profile: not blank (the page has pictures and text on it).
    shot = str(tmp_path / "shot.png")
    res = chromium(["--window-size=1300,2200", f"--screenshot={shot}", f"file://{html_path}"],
                   str(tmp_path / "profile-shot"))
    assert os.path.isfile(shot), res.stdout + res.stderr
    import matplotlib.image as mpimg

    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2200, 1300)
    assert float(pixels.var()) > 0.01, "the screenshot is (nearly) one colour"
    assert float((pixels.mean(axis=2) < 0.5).mean()) > 0.01  # some of it is drawn dark

    # The DOM as Chromium built it: the timeline lists the three failures with their classes.
    dom = chromium(["--dump-dom", f"file://{html_path}"], str(tmp_path / "profile-dom")).stdout
    section = re.search(r'<section id="timeline">(.*?)</section>', dom, re.S)
    assert section, dom[:2000]
    assert re.search(r'<img src="data:image/png;base64,', section.group(1))
    rows = re.findall(r'<tr class="failure" data-class="([a-z_]+)" data-rank="(-?\d+)">(.*?)</tr>',
                      section.group(1), re.S)
    assert [(c, int(r)) for c, r, _ in rows] == [(cls, rank) for _, cls, rank in FAULTS], rows
    assert [re.findall(r"<td>([a-z_]+)</td>", cells)[0] for _, _, cells in rows] == \
        ["rank_crash", "hang", "node_loss"]  # the class is shown, not only an attribute
    assert [c for c, _, _ in rows] == [f["cls"] for f in figures["failures"]]

    # The goodput figures are supervise's, to the last digit (embedded) and as printed.
    embedded = re.search(r'<script type="application/json" id="supervise-figures">(.*?)</script>', dom, re.S)
    assert embedded and json.loads(embedded.group(1)) == figures
    shown = dict(re.findall(r'data-figure="([a-z ]+)" data-value="([^"]+)"', dom))
    assert float(shown["goodput"]) == figures["goodput"]
    assert float(shown["productive"]) == figures["productive_s"]
    assert float(shown["wall time"]) == figures["wall_s"]
    printed = re.search(r"goodput\s+│\s+(\S+%)", table)
    assert printed and f">{printed.group(1)}<" in dom, table
    assert figures["failures_by_class"] == {"rank_crash": 1, "hang": 1, "node_loss": 1}
    assert figures["replacements"] == 1 and figures["restarts"] == 2 and figures["status"] == "completed"
