"""report.html as a reader sees it (issue 37): Jinja2 templates with autoescape, the run page's
header, the number of failures the interval advice rests on, the sweep page's table of variants
and its per-variant timelines one per row.

Run directories are written by the project's own writers (tests/unit/watch_runs.py's FakeRun:
the Ledger, MetricsWriter) or by test_run_report.write_run.
"""

from __future__ import annotations

import fnmatch
import html
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest
from omegaconf import OmegaConf

from slurmkit.report import figures
from slurmkit.report.html import TEMPLATE_DIR, Row, environment, render
from slurmkit.report.run import load_run
from slurmkit.report.write import write
from tests.unit.report.test_run_report import EVENTS, THREE_FAULTS, write_run
from tests.unit.watch_runs import FakeRun

REPO = Path(__file__).resolve().parents[3]
HOSTILE = "job.name=<script>alert(1)</script>"
CSP = ('<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
       'style-src \'unsafe-inline\'">')


def _read(path: str) -> str:
    return open(path, encoding="utf-8").read()


def header(page: str) -> dict[str, str]:
    """The header's rows as text: field -> what the reader sees."""
    table = re.search(r'<table class="head" id="run-header">(.*?)</table>', page, re.S)
    assert table, page[:2000]
    return {f: html.unescape(re.sub(r"<[^>]+>", "", v)) for f, v in
            re.findall(r'<tr data-field="([a-z]+)"><th>[^<]*</th><td>(.*?)</td></tr>', table.group(1), re.S)}


def _command(run_dir: str, command: list[str]) -> None:
    """FakeRun's frozen config with a job.command (what submit freezes from the run's config)."""
    path = os.path.join(run_dir, "config.yaml")
    cfg = OmegaConf.load(path)
    cfg.job.command = command
    OmegaConf.save(cfg, path)


def crashed_run(run_dir: str, *, overrides: list[str] | None, commit: str | None,
                successor: bool = False) -> FakeRun:
    """Submitted (with the overrides and commit submit records, when given) at 1_800_000_000,
    allocated on node1, node2, a crash, trained on; with ``successor`` the run then goes on as
    job 4250 on node2, node3; ended."""
    r = FakeRun(run_dir)
    extra: dict[str, Any] = {}
    if overrides is not None:
        extra["overrides"] = overrides
    if commit is not None:
        extra["commit"] = commit
    r.submit.append("submitted", job_id="4242", executor="slurm", name="tiny", nodes=2, ranks_per_node=2,
                    config_hash="abc", **extra)
    r.allocation()
    r.start_generation()
    for s in range(1, 11):
        r.step(s, 6.0 - s * 0.05)
    r.checkpoint(10)
    r.crash()
    r.start_generation(restored=10)
    if successor:
        r.agent.append("successor", job_id="4250", predecessor="4242", reason="node lost")
        r.allocation(job_id="4250", nodes=("node2", "node3"))
        r.start_generation(restored=10)
    for s in range(11, 21):
        r.step(s, 6.0 - s * 0.05)
    r.clock.now = 1_800_000_000.0 + 3 * 3600  # ends at 11:00
    r.finish(20)
    r.metrics.close()
    return r


def test_the_header_names_jobs_command_overrides_commit_hosts_and_dates(tmp_path) -> None:
    run = str(tmp_path / "run")
    crashed_run(run, overrides=["+exp=tiny", "train.lr=3e-4", "model=micro"], commit="abc123", successor=True)
    _command(run, ["python", "-m", "slurmkit.train", "--tag", "two words"])
    shown = header(_read(write(run)[0]))
    assert shown["jobs"] == "4242, 4250"  # the submitted job and its successor, in order
    assert shown["command"] == "python -m slurmkit.train --tag 'two words'"
    assert shown["overrides"] == "+exp=tiny train.lr=3e-4 model=micro"
    assert shown["commit"] == "abc123"
    assert shown["hosts"] == "node1, node2, node3"  # every allocation's nodes, once each, in order
    assert shown["submitted"] == "2027-01-15 08:00 UTC"  # FakeRun's clock: 1_800_000_000
    assert shown["ended"] == "2027-01-15 11:00 UTC"
    assert "resumes" not in shown


def test_an_older_ledger_shows_dashes_not_empty_claims(tmp_path) -> None:
    """A ledger from before the submitted event carried overrides and commit (and a config
    without job.command): "-", never an empty cell, 0 or "none given"."""
    run = str(tmp_path / "run")
    r = crashed_run(run, overrides=None, commit=None)
    shown = header(_read(write(run)[0]))
    assert shown["command"] == shown["overrides"] == shown["commit"] == "-", shown
    assert shown["jobs"] == "4242" and shown["hosts"] == "node1, node2"
    assert all(v.strip() and v != "0" for v in shown.values()), shown
    # given but empty: said so, not "-"
    r.submit.append("submitted", job_id="4300", overrides=[])
    assert header(_read(write(run)[0]))["overrides"] == "none given"


def test_a_resumed_run_names_the_job_it_resumes_and_its_newest_overrides(tmp_path) -> None:
    run = str(tmp_path / "run")
    r = crashed_run(run, overrides=["+exp=tiny"], commit="abc123")
    r.clock.tick(600)
    r.submit.append("submitted", job_id="4300", executor="slurm", name="tiny", nodes=2, ranks_per_node=2,
                    config_hash="abc", resumes="4242", overrides=["+exp=tiny", "train.steps=40"],
                    commit="3f2a9c1b7d2e-dirty")
    r.allocation(job_id="4300", nodes=("node7", "node8"))
    shown = header(_read(write(run)[0]))
    assert shown["jobs"] == "4242, 4300"
    assert shown["resumes"] == "job 4242 (slurmkit resume)"
    assert shown["overrides"] == "+exp=tiny train.steps=40" and shown["commit"] == "3f2a9c1b7d2e-dirty"
    assert shown["hosts"] == "node1, node2, node7, node8"
    assert shown["submitted"] == "2027-01-15 08:00 UTC"  # the run's first submission
    assert shown["ended"] == "-"  # resumed after its end: it goes on


def test_hostile_overrides_command_and_hosts_are_escaped(tmp_path) -> None:
    run = str(tmp_path / "run")
    r = FakeRun(run)
    r.submit.append("submitted", job_id="1", overrides=["+exp=tiny", HOSTILE], commit="<i>abc</i>")
    r.allocation(nodes=("node1", '"><img src=x onerror=alert(2)>'))
    _command(run, ["python", "<b>bold</b>"])
    page = _read(write(run)[0])
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>alert" not in page and "<b>bold" not in page and "<i>abc" not in page
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(2)&gt;" in page
    assert re.findall(r"<script[^>]*>", page) == ['<script type="application/json" id="supervise-figures">']
    shown = header(page)
    assert shown["overrides"] == f"+exp=tiny '{HOSTILE}'" and shown["command"] == "python '<b>bold</b>'"
    assert CSP in page  # the page's policy, exactly: no script runs, nothing is fetched


def test_autoescape_is_on_in_the_report_templates() -> None:
    env = environment()
    assert env.autoescape is True and env.undefined is jinja2.StrictUndefined
    assert env.from_string("{{ v }}").render(v="<b>x</b>") == "&lt;b&gt;x&lt;/b&gt;"
    parts = env.get_template("parts.html.j2").module
    table = str(parts.table(["<b>h</b>"], [Row(["<b>cell</b>", "1"], {"data-x": '"><b>'})]))  # type: ignore[attr-defined]
    assert "<b>" not in table and "&lt;b&gt;cell&lt;/b&gt;" in table and "&lt;b&gt;h&lt;/b&gt;" in table
    assert '<td class="n">1</td>' in table  # a number is right-aligned
    with pytest.raises(jinja2.UndefinedError):
        render("run.html.j2", title="t")  # a missing value fails, never prints nothing


def test_nothing_is_marked_safe_but_the_figures_json() -> None:
    """Untrusted text is escaped by the engine: no template says |safe, and html.py builds one
    Markup (the supervise figures' JSON, "<" as \\u003c)."""
    names = os.listdir(TEMPLATE_DIR)
    assert {"base.html.j2", "run.html.j2", "sweep.html.j2", "parts.html.j2"} <= set(names)
    for name in names:
        text = _read(os.path.join(TEMPLATE_DIR, name))
        assert "|safe" not in text.replace(" ", "") and "autoescape false" not in text, name
    source = _read(os.path.join(os.path.dirname(TEMPLATE_DIR), "html.py"))
    assert source.count("Markup(") == 1 and 'Markup(json.dumps(dataclasses.asdict(r)).replace("<", "\\\\u003c"))' in source


def test_the_templates_ship_in_the_package(monkeypatch) -> None:
    """setup.py's package_data takes every file of slurmkit/report/templates/."""
    import setuptools

    seen: dict[str, Any] = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(REPO)
    exec(compile((REPO / "setup.py").read_text(), str(REPO / "setup.py"), "exec"),
         {"__name__": "__main__", "__file__": str(REPO / "setup.py")})
    globs = seen["package_data"]["slurmkit.report"]
    files = [f"templates/{n}" for n in os.listdir(TEMPLATE_DIR)]
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)
    assert "slurmkit.report" in seen["packages"]


def _advice_caveat(page: str) -> tuple[str, str] | None:
    m = re.search(r'<p class="(caveat|sub)" id="mtbf-basis" data-failures="([^"]*)">(.*?)</p>', page, re.S)
    return None if m is None else (m.group(1), html.unescape(m.group(3)))


def test_advice_on_one_failure_says_it_is_a_guess(tmp_path) -> None:
    run = write_run(str(tmp_path / "run"))  # EVENTS: one rank crash, 72 s holding nodes
    page = _read(write(run)[0])
    got = _advice_caveat(page)
    assert got is not None and got[0] == "caveat", got
    assert "rests on 1 failure in 72 s of run" in got[1]
    assert "a guess, not a rate" in got[1] and "--mtbf-h" in got[1]
    assert "this run: 1 failure in " in page  # M's source, in the singular


def test_advice_on_three_failures_has_no_caveat(tmp_path) -> None:
    run = str(tmp_path / "run")
    shutil.copytree(THREE_FAULTS, run)
    d = load_run(run)
    assert d.advice is not None and d.advice.mtbf_failures == len(d.report.failures) == 3
    page = _read(write(run)[0])
    got = _advice_caveat(page)
    assert got is not None and got[0] == "sub", got
    assert "rests on 3 failures in " in got[1] and "guess" not in got[1]
    assert "a guess, not a rate" not in page


def test_advice_on_two_failures_still_has_the_caveat(tmp_path) -> None:
    second = [{"t": 1070.0, "event": "failure", "cls": "hang", "rank": 0, "node": "n2",
               "evidence": "no beat", "time_of_fault": 1068.0},
              {"t": 1070.5, "event": "decision", "action": "restart", "reason": "r", "exclude": []}]
    events = sorted([*EVENTS, *second], key=lambda e: e["t"])
    page = _read(write(write_run(str(tmp_path / "run"), events=events))[0])
    got = _advice_caveat(page)
    assert got is not None and got[0] == "caveat" and "rests on 2 failures" in got[1], got


def test_advice_from_mtbf_h_rests_on_the_users_figure(tmp_path) -> None:
    run = write_run(str(tmp_path / "run"))
    page = _read(write(run, mtbf_h=5.0)[0])
    got = _advice_caveat(page)
    assert got is not None and got[0] == "sub" and "--mtbf-h 5" in got[1], got
    assert "a guess" not in page


def _sweep(tmp_path: Path) -> Path:
    """Variant 0: EVENTS (a crash at step 34, 14 steps lost); 1: the same without the failure and
    without metrics; 2: only submitted (running, nothing trained); 3: not started."""
    sweep_dir = tmp_path / "tiny" / "20260101-000000-sweep"
    variants = []
    for i, lr in enumerate(["1e-3", "3e-3", "1e-2", "3e-2"]):
        run = sweep_dir / str(i)
        run.mkdir(parents=True)
        if i == 0:
            write_run(str(run))
        elif i == 1:
            write_run(str(run), events=[e for e in EVENTS if e["event"] not in ("failure", "fault_injected")],
                      metrics=False)
        elif i == 2:
            write_run(str(run), events=EVENTS[:1], metrics=False)
        variants.append({"index": i, "overrides": [f"train.lr={lr}", HOSTILE] if i == 3 else [f"train.lr={lr}"],
                         "run_dir": str(run)})
    (sweep_dir / "sweep.json").write_text(json.dumps(
        {"kind": "sweep", "name": "tiny", "job_id": "42", "array": "0-3", "executor": "slurm",
         "common_overrides": ["+exp=tiny"], "variants": variants}))
    return sweep_dir


def test_the_sweep_page_opens_with_a_table_of_variants(tmp_path) -> None:
    sweep_dir = _sweep(tmp_path)
    page = _read(write(str(sweep_dir))[0])
    section = re.search(r'<section id="variants">(.*?)</section>', page, re.S)
    assert section and page.index('<section id="variants">') < page.index("<img")  # at the top
    head = [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", section.group(1))]
    assert head == ["variant", "overrides", "status", "final step", "final loss", "goodput", "steps lost"]
    rows = [[html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", cells)]
            for cells in re.findall(r'<tr class="variant" data-index="\d+">(.*?)</tr>', section.group(1))]
    assert rows == [
        # final loss: the last metrics row (step 40 of generation 1: 10 - 40/10); goodput 40/77 s
        ["0", "train.lr=1e-3", "completed", "40", "6", "51.9%", "14"],
        ["1", "train.lr=3e-3", "completed", "40", "-", "51.9%", "0"],  # no metrics.jsonl: no loss
        ["2", "train.lr=1e-2", "running", "-", "-", "-", "-"],  # submitted, nothing trained: unknown
        ["3", f"train.lr=3e-2 '{HOSTILE}'", "not started", "-", "-", "-", "-"]]
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in section.group(1)
    assert "common overrides <code>+exp=tiny</code>" in page


def test_the_sweep_timelines_are_one_per_row(tmp_path) -> None:
    sweep_dir = _sweep(tmp_path)
    page = _read(write(str(sweep_dir))[0])
    section = re.search(r'<section id="timeline">(.*?)</section>', page, re.S)
    assert section
    rows = re.findall(r'<div class="variant-row"><h3>([^<]*)</h3>\s*<img src="data:image/png;base64,[^"]+" '
                      r'alt="timeline">', section.group(1))
    assert rows == ["0: train.lr=1e-3", "1: train.lr=3e-3", "2: train.lr=1e-2"]
    assert "grid" not in section.group(1)  # not in columns: each at the page's full width
    # every other figure is still there: shared goodput and loss; per variant timeline, curves and
    # saves, and the advice of the one that failed
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 2 + 3 * 3 + 1


def test_the_timeline_text_is_readable_at_the_pages_width(tmp_path, monkeypatch) -> None:
    """Every text of the timeline is at least 9 pt, and the picture is about the page's width
    (1280 px at most), so shown at full width its smallest text is some 12 px or more."""
    drawn: list[Any] = []
    real = figures.png
    monkeypatch.setattr(figures, "png", lambda fig: (drawn.append(fig), real(fig))[1])
    d = load_run(write_run(str(tmp_path / "run")))
    picture = figures.timeline(d)
    (fig,) = drawn
    import matplotlib.text

    sizes = [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip()]
    assert sizes and min(sizes) >= figures.TIMELINE_TEXT_PT >= 9, sorted(sizes)[:5]
    import io

    import matplotlib.image as mpimg

    width = mpimg.imread(io.BytesIO(picture)).shape[1]
    shown_px = min(sizes) * 110 / 72 * min(1.0, 1280 / width)
    assert shown_px >= 12, (width, shown_px)
