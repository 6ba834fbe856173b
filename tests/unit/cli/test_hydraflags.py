"""Hydra's flags on ``submit`` and ``plan``: done as a Hydra user expects, or refused with the
reason (before, each one failed in the override lexer: ``LexerNoViableAltException: --cfg``)."""

from __future__ import annotations

import io

import pytest
import yaml
from rich.console import Console

from slurmkit.cli import plan, submit
from slurmkit.errors import ConfigError


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = submit.run(argv, {"PATH": ""}, Console(file=out, width=300), Console(file=err, width=300))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("flag", [["--cfg", "job"], ["--cfg=all"], ["-c", "job"]])
def test_cfg_prints_the_composed_config_and_submits_nothing(flag: list[str], tmp_path) -> None:
    code, out, _ = _run([*flag, "+exp=tiny", "train.steps=7", f"submit.run_root={tmp_path}"])
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["train"]["steps"] == 7 and cfg["submit"]["run_root"] == str(tmp_path)
    assert not any(tmp_path.iterdir())  # nothing frozen, nothing submitted


def test_info_lists_the_groups_and_their_options() -> None:
    code, out, _ = _run(["--info"])
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 1}
    assert "tiny" in rows["exp"] and "llama70b" in rows["exp"] and "local_slurm" in rows["cluster"]
    assert _run(["--info", "defaults"])[0] == 0  # Hydra's optional word is taken, not an override


def test_help_lists_the_groups_and_the_main_keys_with_their_docs() -> None:
    code, out, _ = _run(["--help"])
    assert code == 0 and "Config groups" in out and "llama8b" in out
    lines = out.splitlines()
    # the default from the dataclass, the doc from the comment on the field
    assert any(ln.strip().startswith("train.steps = 200") and "optimizer steps of the whole run" in ln
               for ln in lines), out
    assert any(ln.strip().startswith("job.command = ['python', '-m', 'slurmkit.examples.allreduce']") or
               ln.strip().startswith("job.command = [") for ln in lines), out
    assert any(ln.strip().startswith("cluster.name = (no default)") for ln in lines), out


@pytest.mark.parametrize("argv, fix", [
    (["hydra.run.dir=/x", "+exp=tiny"], "submit.run_root=DIR"),
    (["+hydra.job.name=a", "+exp=tiny"], "job.name=NAME"),
    (["hydra/launcher=basic", "+exp=tiny"], "job array"),
    (["--config-dir", "/x", "+exp=tiny"], "SLURMKIT_CONF_DIR"),
    (["--cfg", "hydra"], "--cfg job"),
    (["--cfg"], "--cfg job"),
])
def test_hydra_settings_that_do_not_apply_are_refused_with_the_way_instead(argv: list[str], fix: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _run(argv)
    assert fix in str(exc.value)


def test_plan_takes_the_same_flags() -> None:
    out = io.StringIO()
    assert plan.main(["--cfg", "job", "+exp=tiny"], console=Console(file=out, width=300), env={"PATH": ""}) == 0
    assert yaml.safe_load(out.getvalue())["job"]["name"]
    err = io.StringIO()
    assert plan.main(["hydra.run.dir=/x", "+exp=tiny"], console=Console(file=err, width=300), env={"PATH": ""}) == 2
    assert "submit.run_root" in err.getvalue()
