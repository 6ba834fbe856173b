"""A key the schema does not define is refused, `+` or not, with the closest known names
(issue 37: ``+train.stpes=20`` and ``+optimizer=adamw`` were accepted and silently dropped)."""

from __future__ import annotations

import pytest

from slurmkit.config import compose
from slurmkit.config.compose import unknown_keys
from slurmkit.errors import ConfigError


@pytest.mark.parametrize(("override", "named", "hint"), [
    ("+train.stpes=20", "train.stpes (from the override +train.stpes=20)", "did you mean train.steps"),
    ("+optimizer=adamw", "optimizer (from the override +optimizer=adamw)", "a key of the top level"),
    ("+job.nodess=2", "job.nodess", "did you mean job.nodes"),
    ("+store.tiers.nvme.pathh=/x", "store.tiers", None),
    # without `+`: Hydra's own advice was to add it with `+`, which was then refused
    ("train.lrr=1e-3", "train.lrr (from the override train.lrr=1e-3)", "did you mean train.lr"),
    ("nosuch=1", "nosuch (from the override nosuch=1)", "a key of the top level"),
])
def test_an_unknown_key_is_refused_with_what_is_known(override: str, named: str, hint: str | None) -> None:
    with pytest.raises(ConfigError) as err:
        compose(["+exp=tiny", override])
    text = str(err.value)
    assert named in text and "Detected:" in text and "Fix:" in text, text
    if hint:
        assert hint in text, text


def test_mapping_fields_hold_any_key_and_every_shipped_config_is_known() -> None:
    cfg = compose(["+exp=tiny", "+job.env.MY_FLAG=1", "+cluster.env.SITE_X=y"])
    assert cfg.job.env["MY_FLAG"] == "1" and cfg.cluster.env["SITE_X"] == "y"


def test_the_walk_names_the_nested_path() -> None:
    tree = {"train": {"steps": 3, "stpes": 4}, "job": {"env": {"ANY": "1"}, "nodes": 1}, "bogus": 1}
    assert [p for p, _ in unknown_keys(tree)] == ["train.stpes", "bogus"]
