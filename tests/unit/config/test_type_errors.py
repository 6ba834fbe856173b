"""A value of the wrong type keeps OmegaConf's own words and says the type the schema expects
(issue 37: ``train.steps=abc`` and ``job.command=python train.py`` said "check the spelling");
a group option that does not exist points at SLURMKIT_CONF_DIR, never into site-packages."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from slurmkit.cli import submit
from slurmkit.config import compose
from slurmkit.config.compose import field_type
from slurmkit.errors import ConfigError


@pytest.mark.parametrize(("override", "said", "expected", "fix"), [
    ("train.steps=abc", "Value 'abc' of type 'str' could not be converted to Integer", "train.steps is int",
     "a whole number: train.steps=20"),
    ("job.command=python train.py", "is not a ListConfig", "job.command is list[str]", "job.command=[python,train.py]"),
    ("train.lr=fast", "could not be converted to Float", "train.lr is float", "a number"),
    ("supervisor.warm_standby=maybe", "not a valid bool", "supervisor.warm_standby is bool", "true or false"),
    ("job.env=3", "Cannot assign int", "job.env is dict[str, str]", "+job.env.a=1"),
])
def test_a_type_error_says_what_was_given_and_what_is_expected(override: str, said: str, expected: str,
                                                              fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose(["+exp=tiny", override])
    text = str(err.value)
    assert f"Detected: {override}: " in text and said in text and expected in text, text
    assert fix in text.split("Fix:", 1)[1], text
    assert "check the spelling" not in text


def test_field_types_come_from_the_schema() -> None:
    assert field_type("train.steps") == "int"
    assert field_type("job.command") == "list[str]"
    assert field_type("store.keep_nvme") == "int" and field_type("job.time") is not None
    assert field_type("train.nosuch") is None and field_type("nosuch.x") is None


def test_an_unknown_group_option_points_at_the_site_conf_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("SLURMKIT_CONF_DIR", raising=False)
    with pytest.raises(ConfigError) as err:
        compose(["+exp=tiny", "cluster=mysite"])
    fix = str(err.value).split("Fix:", 1)[1]
    assert "SLURMKIT_CONF_DIR" in fix and "cluster/mysite.yaml" in fix and "site-packages" not in fix
    monkeypatch.setenv("SLURMKIT_CONF_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        compose(["+exp=tiny", "cluster=mysite"])
    assert f"add {tmp_path}/cluster/mysite.yaml" in str(err.value)


def test_submit_without_an_experiment_is_refused(tmp_path) -> None:
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(ConfigError) as exc:
        submit.run(["job.name=x", f"submit.run_root={tmp_path}"], {"PATH": ""}, Console(file=out),
                   Console(file=err))
    text = str(exc.value)
    assert "no experiment" in text and "tiny" in text and "+exp=tiny" in text.split("Fix:", 1)[1]
    assert not any(tmp_path.iterdir())  # nothing written, nothing submitted
