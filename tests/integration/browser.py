"""The report of a real run with several real faults, opened in a real browser.

tests/integration/test_faults.py's multi-fault job (a rank SIGKILLed, an NCCL abort, a SIGSTOPped
rank: three generations restarted in the allocation) ends with :func:`assert_report_in_chromium`:
``python -m slurmkit.report`` writes report.html, headless Chromium (Debian's package) renders it,
and the check is that the screenshot is a picture, the page's header names the run (every job it
ran as, the command of its frozen config, the overrides and commit it was submitted with, its
hosts), the rendered timeline lists the run's failures with their classes and ranks, and the
goodput figures are those of ``python -m slurmkit.supervise`` for the same ledger. (It once had a
job of its own, with a node loss onto a spare: issue 35 folded it into a job the suite runs
anyway.)

:func:`assert_sweep_in_chromium` does the same for a sweep directory's report: its table of
variants, as Chromium built it, holds each variant of sweep.json with its figures. Neither needs
the cluster itself (tests/unit/report/test_in_chromium.py runs both on written run
directories; they skip without Chromium).
"""

from __future__ import annotations

import html
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from typing import Any

from tests.integration.helpers import read_ledger

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium(args: list[str], profile: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium")
    assert exe, "no chromium: install Debian's package (tools/setup --cluster does: apt-get install chromium)"
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=180)


def rendered(html_path: str, tmp_path, name: str = "") -> str:
    """A screenshot of the page in a fresh profile, checked to be a picture (not blank: pictures
    and text on it), then the DOM as Chromium built it."""
    shot = str(tmp_path / f"shot{name}.png")
    res = chromium(["--window-size=1300,2200", f"--screenshot={shot}", f"file://{html_path}"],
                   str(tmp_path / f"profile-shot{name}"))
    assert os.path.isfile(shot), res.stdout + res.stderr
    import matplotlib.image as mpimg

    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2200, 1300)
    assert float(pixels.var()) > 0.01, "the screenshot is (nearly) one colour"
    assert float((pixels.mean(axis=2) < 0.5).mean()) > 0.01  # some of it is drawn dark
    return chromium(["--dump-dom", f"file://{html_path}"], str(tmp_path / f"profile-dom{name}")).stdout


def _text(cell: str) -> str:
    """A cell of the DOM as a reader sees it: tags dropped, entities read."""
    return html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()


def header_fields(dom: str) -> dict[str, str]:
    """The run page's header (``<table class="head" id="run-header">``): field -> shown text."""
    table = re.search(r'<table class="head" id="run-header">(.*?)</table>', dom, re.S)
    assert table, dom[:3000]
    return {f: _text(v) for f, v in re.findall(r'<tr data-field="([a-z]+)"><th>[^<]*</th><td>(.*?)</td></tr>',
                                                table.group(1), re.S)}


def _words(items: Any) -> str:
    return "-" if items is None else shlex.join(str(i) for i in items) if items else "none given"


def assert_header(dom: str, run_dir: str) -> None:
    """The header names every job the run ran as, the frozen config's command, the overrides and
    commit of the newest submission ("-" where an older ledger lacks them) and every host."""
    from omegaconf import OmegaConf

    events = read_ledger(run_dir)
    shown = header_fields(dom)
    jobs = list(dict.fromkeys(str(e["job_id"]) for e in events
                              if e["event"] in ("submitted", "successor") and e.get("job_id")))
    assert jobs and shown["jobs"].split(", ") == jobs, (shown, jobs)
    command = OmegaConf.to_container(OmegaConf.load(os.path.join(run_dir, "config.yaml")))["job"]["command"]
    assert shown["command"] == shlex.join(command), shown
    newest = [e for e in events if e["event"] == "submitted"][-1]
    assert shown["overrides"] == _words(newest.get("overrides")), (shown, newest)
    assert shown["commit"] == newest.get("commit", "-"), (shown, newest)
    hosts = list(dict.fromkeys(n for e in events if e["event"] == "allocation_start" for n in e["nodes"]))
    assert hosts and shown["hosts"].split(", ") == hosts, (shown, hosts)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", shown["submitted"]), shown


def assert_sweep_in_chromium(sweep_dir: str, env: dict[str, str], tmp_path) -> None:
    """The report of a sweep directory, rendered by Chromium: its table of variants comes first
    and holds each variant of sweep.json, in order, with its overrides and, for those that
    started, supervise's status, final step, goodput and steps lost for its ledger; each started
    variant's timeline is a picture of its own row."""
    env = {**env, "TMPDIR": str(tmp_path)}
    with open(os.path.join(sweep_dir, "sweep.json"), encoding="utf-8") as f:
        sweep = json.load(f)
    out = str(tmp_path / "sweep-report")
    rep = subprocess.run([sys.executable, "-m", "slurmkit.report", sweep_dir, "--out", out], env=env,
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    dom = rendered(os.path.join(out, "report.html"), tmp_path, "-sweep")
    section = re.search(r'<section id="variants">(.*?)</section>', dom, re.S)
    assert section and dom.index('<section id="variants">') < dom.index("<img"), dom[:3000]
    rows = re.findall(r'<tr class="variant" data-index="(\d+)">(.*?)</tr>', section.group(1), re.S)
    assert [int(i) for i, _ in rows] == [v["index"] for v in sweep["variants"]], rows
    started = 0
    for (_, cells), v in zip(rows, sweep["variants"]):
        index, overrides, status, final_step, _loss, goodput, lost = \
            [_text(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", cells, re.S)]
        assert (index, overrides) == (str(v["index"]), shlex.join(v["overrides"]) or "defaults"), cells
        if not os.path.isfile(os.path.join(v["run_dir"], "ledger.jsonl")):
            assert (status, final_step, goodput, lost) == ("not started", "-", "-", "-"), cells
            continue
        started += 1
        sup = subprocess.run([sys.executable, "-m", "slurmkit.supervise", v["run_dir"], "--json"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert sup.returncode == 0, sup.stderr
        fig = json.loads(sup.stdout)
        assert status == fig["status"] and final_step == ("-" if fig["final_step"] is None else str(fig["final_step"]))
        assert goodput == ("-" if fig["goodput"] is None else f"{fig['goodput']:.1%}"), (goodput, fig)
        assert lost == ("-" if fig["steps_lost"] is None else str(fig["steps_lost"])), (lost, fig)
    timeline = re.search(r'<section id="timeline">(.*?)</section>', dom, re.S)
    assert timeline, dom[:3000]
    pictures = re.findall(r'<div class="variant-row"><h3>[^<]*</h3>\s*<img src="data:image/png;base64,',
                          timeline.group(1))
    assert len(pictures) == started >= 1, timeline.group(1)[:2000]


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

    dom = rendered(html_path, tmp_path)
    assert_header(dom, run_dir)

    # The DOM as Chromium built it: the timeline lists the three failures with their classes.
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
