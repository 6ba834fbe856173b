"""Error messages reach the terminal literally: a Fix hint's brackets are not rich markup."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from rich.console import Console

from slurmkit.errors import ConfigError, print_error

FIX = "set job.command=[python,-m,slurmkit.train]"


def test_print_error_keeps_brackets_and_styles_only_the_label() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, color_system="standard", width=400)
    print_error(console, ConfigError("job.command is empty", "a command", FIX), "configuration error")
    text = buf.getvalue()
    assert FIX + "." in text
    assert "\x1b[" in text.split("configuration error")[0]  # the label is styled (bold red)
    plain = io.StringIO()
    print_error(Console(file=plain, width=400), "[bold]not a tag[/bold]")
    assert plain.getvalue() == "error: [bold]not a tag[/bold]\n"


def test_submit_prints_the_fix_hint_with_its_brackets(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "slurmkit.submit", "+exp=tiny", "cluster=local",
                          "job.command=[]", f"submit.run_root={tmp_path}"],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                         env={**os.environ, "COLUMNS": "400"})
    assert res.returncode == 2, res.stderr
    assert f"Fix: {FIX}." in res.stderr, res.stderr
    assert os.listdir(tmp_path) == []


def test_supervise_prints_a_run_dir_with_brackets_literally(tmp_path) -> None:
    run_dir = tmp_path / "run[python,-m,x]"
    run_dir.mkdir()
    res = subprocess.run([sys.executable, "-m", "slurmkit.supervise", str(run_dir)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"})
    assert res.returncode == 2
    assert f"no ledger.jsonl in {run_dir}" in res.stderr, res.stderr


def test_print_error_escapes_what_would_act_on_the_terminal() -> None:
    """A message quoting a user's value or a file's bytes: a bidi override, a C1 CSI and a line
    separator reach the terminal escaped; newlines and ordinary unicode stay."""
    buf = io.StringIO()
    print_error(Console(file=buf, width=400), "value 'a\u202eb\x9b31mc\u2028d' in\tjob.name (é)\nnext")
    out = buf.getvalue()
    assert "\u202e" not in out and "\x9b" not in out and "\u2028" not in out
    assert "a\\u202eb\\x9b31mc\\u2028d" in out and "job.name (é)\nnext" in out  # rich expands the tab


def test_a_sweep_override_with_a_line_separator_is_printed_escaped(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "slurmkit.submit", "-m", "+exp=tiny", "cluster=local",
                          "job.name=a\u2028b,c", f"submit.run_root={tmp_path}"],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                         env={**os.environ, "COLUMNS": "400"})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "\u2028" not in res.stderr and "\\u2028" in res.stderr, res.stderr
    assert os.listdir(tmp_path) == []
