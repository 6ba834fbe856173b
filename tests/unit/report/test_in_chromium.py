"""The report rendered by headless Chromium (tests/integration/browser.py's checks, the ones the
multi-fault cluster job ends with), here on run directories the project's writers made: no
cluster. The screenshot is a picture; the DOM Chromium built holds the run page's header (jobs,
command, overrides, commit, hosts, dates), the failures and supervise's figures, and the sweep
page's table of variants with each variant's figures. Chromium is part of the test set-up
(tools/setup --cluster installs Debian's package); without it the tests fail saying so."""

from __future__ import annotations

import os

import pytest

from tests.integration.browser import assert_header, assert_report_in_chromium, assert_sweep_in_chromium
from tests.unit.report.test_page import HOSTILE, _command, _sweep, crashed_run

def test_a_run_report_in_chromium_shows_its_header(tmp_path) -> None:
    run = str(tmp_path / "run")
    crashed_run(run, overrides=["+exp=tiny", HOSTILE], commit="abc123-dirty", successor=True)
    _command(run, ["python", "-m", "slurmkit.train"])
    assert_report_in_chromium(run, dict(os.environ), tmp_path)


def test_the_header_check_fails_on_a_header_that_lies(tmp_path) -> None:
    """assert_header reads the ledger and the config, not the page: a wrong job id is caught."""
    run = str(tmp_path / "run")
    crashed_run(run, overrides=["+exp=tiny"], commit="abc123")
    _command(run, ["python", "-m", "slurmkit.train"])
    dom = ('<table class="head" id="run-header"><tr data-field="jobs"><th>job</th><td>9999</td></tr>'
           "</table>")
    with pytest.raises(AssertionError):
        assert_header(dom, run)


def test_a_sweep_report_in_chromium_shows_its_table_of_variants(tmp_path) -> None:
    assert_sweep_in_chromium(str(_sweep(tmp_path)), dict(os.environ), tmp_path)
