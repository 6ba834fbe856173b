"""The report of a real run with several real faults, opened in a real browser.

tests/integration/test_faults.py's multi-fault job (a rank SIGKILLed, an NCCL abort, a SIGSTOPped
rank: three generations restarted in the allocation) ends with :func:`assert_report_in_chromium`:
``python -m slurmkit.report`` writes report.html, headless Chromium (Debian's package) renders it,
and the check is that the screenshot is a picture, the rendered timeline lists the run's failures
with their classes and ranks, and the goodput figures are those of ``python -m slurmkit.supervise``
for the same ledger. (It once had a job of its own, with a node loss onto a spare: issue 35 folded
it into a job the suite runs anyway.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter

from tests.integration.helpers import read_ledger

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium(args: list[str], profile: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium")
    assert exe, "no chromium: install Debian's package (tools/setup --cluster does: apt-get install chromium)"
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=180)


def assert_report_in_chromium(run_dir: str, env: dict[str, str], tmp_path) -> None:
    """The report of the ended run at ``run_dir``, rendered by Chromium, shows its failures and
    supervise's goodput figures."""
    env = {**env, "TMPDIR": str(tmp_path)}
    failures = [(e["cls"], int(e["rank"])) for e in read_ledger(run_dir) if e["event"] == "failure"]
    assert failures, "a run without failures: nothing for the timeline to list"
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
    assert [(c, int(r)) for c, r, _ in rows] == failures, rows
    assert [re.findall(r"<td>([a-z_]+)</td>", cells)[0] for _, _, cells in rows] == \
        [cls for cls, _ in failures]  # the class is shown, not only an attribute
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
    assert figures["failures_by_class"] == dict(Counter(cls for cls, _ in failures))
    restarts = sum(e["action"] == "restart" for e in read_ledger(run_dir) if e["event"] == "decision")
    assert figures["restarts"] == restarts and figures["status"] == "completed", figures
