"""Hostile input, third round (issue 34), items 6, 11, 12 and 13: rendered text and secrets.

One parametrized test per item, each case asserting the outcome:

- 6: a value holding a character that is not printable (U+2028, U+2029, U+0085, a bidi
  override, ...) is refused wherever it would reach the job, and the renderer cuts lines at
  "\\n" only;
- 11: secrets in disguise (key names, NAME=value tokens, URIs, images, more key shapes,
  ``${oc.env:...}``) are refused, named, never echoed;
- 12: ``logs`` and ``status`` show every non-printable character escaped;
- 13: job.env / cluster.env cannot replace what slurmkit sets; LD_* / BASH_ENV are warned about.

A refused submission exits 2 with Detected/Requirement/Fix, writes nothing and runs no sbatch
(a fake sbatch first on PATH records any call).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from pathlib import Path

import pytest
from rich.console import Console

from slurmkit.cli import logs, submit
from slurmkit.config import compose
from slurmkit.progress import _description
from slurmkit.render import build_jobspec, render_standalone, render_submitit_script
from slurmkit.render.sbatch import script_lines, setup_lines
from slurmkit.runview import clean

BASE = ["+exp=tiny", "cluster=local_slurm", "cluster.kind=slurm"]
# Key shapes, split so that secret scanners do not flag this file.
JWT = "eyJhbGciOiJIUzI1NiJ9" + ".eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
STRIPE = "sk_" + "live_4eC39HqLyjWDarjtT1zdp7dc"
GOOGLE = "AI" + "zaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYEXAMPLEKEY"
HEX = "3f9a0c1b" * 5


@pytest.fixture
def no_sbatch(tmp_path, monkeypatch) -> Path:
    """A fake ``sbatch`` first on PATH that records being run; returns the record's path."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    called = tmp_path / "sbatch-called"
    fake = bindir / "sbatch"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> '{called}'\necho 'Submitted batch job 1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return called


def _refused(argv: list[str], tmp_path: Path, capsys, called: Path, root: str | None = None) -> str:
    runs = root or str(tmp_path / "runs")
    code = submit.main([*BASE, *argv, f"submit.run_root='{runs}'"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "configuration error" in err and "Detected:" in err and "Requirement:" in err and "Fix:" in err
    assert not (tmp_path / "runs").exists(), "a refused submission wrote something"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"], "a refused submission wrote something"
    assert not called.exists(), "a refused submission ran sbatch"
    return err


# ---------------------------------------------------------------------------- item 6

@pytest.mark.parametrize("argv,where,code", [
    (["+job.env.NCCL_DEBUG='INFO\u2028#SBATCH --qos=high'"], "environment variable NCCL_DEBUG", "U+2028"),
    (["+cluster.env.X='a\u2029b'"], "environment variable X", "U+2029"),
    (["+job.env.X='a\x85b'"], "environment variable X", "U+0085"),
    (["cluster.setup=['module load x\u2028touch /tmp/pwned']"], "cluster.setup line", "U+2028"),
    (["cluster.container_mounts=['/a:/a\x85/b:/b']"], "cluster.container_mounts", "U+0085"),
    (["job.command=[python,'train.py\u202e']"], "job.command", "U+202E"),
    (["store.lustre_uri='/lustre/ckpt\u2028x'"], "store.lustre_uri", "U+2028"),
    (["cluster.account='acct\u00a0x'"], "cluster.account", "U+00A0"),
    ("ROOT", "submit.run_root", "U+2028"),  # the case: a run root holding U+2028
    (["-m", "train.lr=1e-3,3e-3", "+job.env.X='a\u2028b'"], "environment variable X", "U+2028"),  # a sweep
])
def test_item6_unprintable_values_are_refused(argv, where, code, tmp_path, capsys, no_sbatch) -> None:
    root = None
    if argv == "ROOT":
        argv, root = [], str(tmp_path / "runs\u2028x")
    err = _refused(argv, tmp_path, capsys, no_sbatch, root)
    assert where in err and code in err and "non-printable" in err, err


def test_item6_the_renderer_cuts_lines_at_newlines_only() -> None:
    """Past the checks (a sweep places its spec later; code that builds a spec itself), the
    renderer neither turns U+2028 into a line break nor renders such a value at all."""
    assert script_lines("a\u2028b\x85c\nd\n") == ["a\u2028b\x85c", "d"]
    spec = build_jobspec(compose(BASE), "/r/x")
    assert setup_lines(dataclasses.replace(spec, setup=("echo a",)))[-1] == "echo a"
    bad = dataclasses.replace(spec, run_dir="/r/x\u2028touch /tmp/pwned")
    for render in (lambda: render_submitit_script(bad, python="python3"),
                   lambda: render_standalone(bad, "/r/x/job.sbatch", python="python3")):
        with pytest.raises(Exception, match="U\\+2028"):
            render()


# ---------------------------------------------------------------------------- item 11

@pytest.mark.parametrize("argv,why,secret", [
    (["+job.env.AZURE_STORAGE_KEY=abc"], "a key name", None),
    (["+job.env.DB_PASS=abc"], "PASSWORD", None),
    ([f"+job.env.AUTH_HEADER='Bearer {JWT}'"], "JSON Web Token", JWT),
    ([f"+job.env.PAYMENTS='{STRIPE}'"], "Stripe key", STRIPE),
    ([f"+job.env.MAPS='{GOOGLE}'"], "Google API key", GOOGLE),
    (["+job.env.CACHE='redis://:hunter2@cache:6379/0'"], "password inside a URL", "hunter2"),
    (["+job.env.DB='postgres://bob:hun/ter2@db:5432/x'"], "password inside a URL", "hun/ter2"),
    (["store.lustre_uri=s3://bob:hunter2@bucket/ckpt"], "store.lustre_uri", "hunter2"),
    (["job.command=[env,'AWS_SECRET_ACCESS_KEY=hunter2',python,train.py]"], "a name with SECRET", "hunter2"),
    (["job.command=[python,train.py,--password,hunter2]"], "a name with PASSWORD", "hunter2"),
    ([f"job.command=[python,train.py,--api-key,{HEX}]"], "long random string", HEX),
    (["cluster.setup=['export DB_PASS=hunter2']"], "DB_PASS", "hunter2"),
    (["cluster.container_image='bob:hunter2@nvcr.io#nvidia/pytorch:24.01'"], "user and password", "hunter2"),
    (["+job.env.X='${oc.env:AWS_SECRET_ACCESS_KEY}'"], "AWS_SECRET_ACCESS_KEY", AWS_SECRET),
    (["job.command=[python,train.py,'--key=${oc.env:AWS_SECRET_ACCESS_KEY}']"], "AWS_SECRET_ACCESS_KEY",
     AWS_SECRET),
    (["+job.env.X='${oc.decode:\"1\"}'"], "resolver", None),
    (["train.data_path='https://bob:hunter2@data.site/tokens.bin'"], "train.data_path", "hunter2"),
    (["+job.env.X='hunter2\u2028'"], "U+2028", "hunter2"),  # an env value is never quoted
])
def test_item11_secrets_in_disguise_are_refused_unechoed(argv, why, secret, tmp_path, capsys, no_sbatch,
                                                         monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    err = _refused(argv, tmp_path, capsys, no_sbatch)
    assert why in err, err
    if secret is not None:
        assert secret not in err, "the secret itself was printed"


@pytest.mark.parametrize("override", [
    "+job.env.NCCL_SOCKET_IFNAME='=bond0'", "+job.env.NCCL_IB_HCA='mlx5_0,mlx5_1'",
    "+job.env.TOKENIZERS_PARALLELISM=false", "+job.env.MAX_TOKENS=4096", "+job.env.PAD_TOKEN_ID=0",
    "+job.env.AWS_SHARED_CREDENTIALS_FILE=/home/u/.aws/creds", "+job.env.HF_HOME=/lustre/hf",
    f"+job.env.CONFIG_SHA256={HEX}", "+job.env.PROXY='http://proxy.site:3128'",
    "+job.env.PKG='https://registry.site:443/@scope/pkg'", "+job.env.DATA='${oc.env:HOME}/data'",
    "job.command=[python,train.py,'--max-tokens=5','--pad-token=0','--eos-token=</s>']",
    "cluster.container_image='nvcr.io#nvidia/pytorch:24.01-py3'",
    f"cluster.container_image='ubuntu:22.04@sha256:{HEX}{HEX[:24]}'",
    "cluster.setup=['export HF_TOKEN=$(cat ~/.hf_token)','module load cuda/12.4']",
])
def test_item11_ordinary_values_are_not_secrets(override) -> None:
    build_jobspec(compose([*BASE, override]), "/r/x")


# ---------------------------------------------------------------------------- item 12

@pytest.mark.parametrize("raw,shown", [
    ("bidi \u202eevil", "bidi \\u202eevil"), ("csi \x9b2J", "csi \\x9b2J"), ("nel \x85x", "nel \\x85x"),
    ("ls \u2028x", "ls \\u2028x"), ("esc \x1b[2J", "esc \\x1b[2J"), ("zw \u200bx", "zw \\u200bx"),
])
def test_item12_logs_and_status_escape_every_unprintable_character(raw, shown, tmp_path) -> None:
    log = tmp_path / "rank0.log"
    log.write_bytes(f"caf\u00e9 \u65e5\u672c\tok\n{raw}\nend\r\n".encode())
    out = io.StringIO()
    logs.follow(str(log), out, lines=10, follow_file=False)
    assert out.getvalue() == f"caf\u00e9 \u65e5\u672c\tok\n{shown}\nend\n"
    assert clean(raw).plain == shown  # status: escaped, not '?'
    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    console.print(clean(f"run {raw}"))
    assert shown in console.file.getvalue()  # type: ignore[attr-defined]
    assert shown in _description(raw, "RUNNING")  # submit.wait's progress bar


# ---------------------------------------------------------------------------- item 13

@pytest.mark.parametrize("override,where", [
    ("+job.env.SLURMKIT_CONFIG_SHA256=''", "job.env.SLURMKIT_CONFIG_SHA256"),
    ("+job.env.SLURMKIT_RUN_DIR=/tmp/other", "job.env.SLURMKIT_RUN_DIR"),
    ("+cluster.env.SLURMKIT_CONFIG=/tmp/c.yaml", "cluster.env.SLURMKIT_CONFIG"),
    ("+job.env.RANK=0", "job.env.RANK"), ("+cluster.env.WORLD_SIZE=1", "cluster.env.WORLD_SIZE"),
    ("+job.env.MASTER_ADDR=evil.example", "job.env.MASTER_ADDR"), ("+job.env.MASTER_PORT=1", "job.env.MASTER_PORT"),
    ("+job.env.LOCAL_RANK=0", "job.env.LOCAL_RANK"), ("+job.env.SLURM_NTASKS=1", "job.env.SLURM_NTASKS"),
    ("+job.env.SLURMKIT_DEVICE=cpu", "job.env.SLURMKIT_DEVICE"),
])
def test_item13_reserved_env_names_are_refused(override, where, tmp_path, capsys, no_sbatch) -> None:
    err = _refused([override], tmp_path, capsys, no_sbatch)
    assert where in err, err


@pytest.mark.parametrize("override,name", [("+job.env.LD_PRELOAD=/tmp/x.so", "job.env.LD_PRELOAD"),
                                           ("+cluster.env.LD_LIBRARY_PATH=/opt/lib", "cluster.env.LD_LIBRARY_PATH"),
                                           ("+job.env.BASH_ENV=/tmp/rc", "job.env.BASH_ENV")])
def test_item13_loader_and_shell_variables_are_warned_about(override, name, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        spec = build_jobspec(compose([*BASE, override]), "/r/x")
    assert any(name in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), caplog.text
    assert name.rsplit(".", 1)[1] in dict(spec.env)


def test_item13_the_test_knobs_stay_allowed() -> None:
    spec = build_jobspec(compose([*BASE, "+job.env.SLURMKIT_STEP_DELAY_S=0.25",
                                  "+job.env.SLURMKIT_FAULT=raise:1:15"]), "/r/x")
    assert ("SLURMKIT_STEP_DELAY_S", "0.25") in spec.env


def test_item13_env_names_are_shell_names() -> None:
    """A name bash cannot export (a non-ASCII letter passed isalnum() before) is refused; a YAML
    file can hold one where the command line cannot."""
    cfg = compose(BASE)
    with pytest.raises(Exception, match="environment variable name 'R\u00c4NK' in job.env"):
        build_jobspec(dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, env={"R\u00c4NK": "1"})), "/r/x")
