"""Fields that hold one of a fixed set of words: one declaration (a class's CHOICES), one check
(slurmkit.choices.check_choices), one message naming every allowed value; the values stay plain
str, so rendered scripts, environment variables and ledgers carry the word itself."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from slurmkit.choices import check_choices, choice_table
from slurmkit.config import compose
from slurmkit.config.schema import SlurmkitConfig
from slurmkit.errors import ConfigError

SECTIONS = typing.get_type_hints(SlurmkitConfig)
# What a section needs besides its defaults to be valid: a store a tier, train.data=memmap a file.
REQUIRED: dict[str, dict[str, Any]] = {"store": {"nvme_uri": "/tmp/nvme"}, "cluster": {"name": "x"},
                                       "train": {"data_path": "/tmp/tokens.bin"}}
FIELDS = [(section, name) for section, cls in SECTIONS.items()
          for name in getattr(cls, "CHOICES", {})]


def test_the_choice_fields_are_the_known_ones() -> None:
    keys = {f"{s}.{n}" for s, n in FIELDS}
    assert keys >= {"cluster.kind", "submit.emit", "parallel.strategy", "train.dtype", "train.data",
                    "train.data_dtype", "store.busy_policy", "store.checksum", "topology.cpu_mode",
                    "topology.nic_kinds", "supervisor.requeue_as", "supervisor.require_heartbeat",
                    "supervisor.exit0_after_signal", "health.link_backend", "health.straggler_action"}
    assert [k for k, _, _ in choice_table(SlurmkitConfig)] == [f"{s}.{n}" for s, n in FIELDS]


@pytest.mark.parametrize("section,name", FIELDS, ids=[f"{s}.{n}" for s, n in FIELDS])
def test_each_default_is_allowed_and_a_bad_value_is_refused_naming_them_all(section: str, name: str) -> None:
    cls = SECTIONS[section]
    allowed = cls.CHOICES[name]
    default = cls(**REQUIRED.get(section, {}))
    value = getattr(default, name)
    assert all(v in allowed for v in value) if isinstance(value, list) else value in allowed
    bogus: Any = ["bogus"] if isinstance(value, list) else "bogus"
    with pytest.raises(ConfigError) as err:
        cls(**{**REQUIRED.get(section, {}), name: bogus})
    text = str(err.value)
    assert text.startswith(f"Detected: {section}.{name}=")
    words = ", ".join(v if v else "''" for v in allowed)
    assert f"{section}.{name} is one of {words}." in text
    assert f"Fix: set {section}.{name}=" in text


def test_every_allowed_value_is_accepted_and_stays_a_plain_str() -> None:
    for section, name in FIELDS:
        cls = SECTIONS[section]
        for word in cls.CHOICES[name]:
            value: Any = [word] if isinstance(getattr(cls(**REQUIRED.get(section, {})), name), list) else word
            obj = cls(**{**REQUIRED.get(section, {}), name: value})
            got = getattr(obj, name)
            assert got == value and type(got if isinstance(got, str) else got[0]) is str


def test_a_bad_choice_is_refused_at_compose_with_the_allowed_values() -> None:
    with pytest.raises(ConfigError) as err:
        compose(["+exp=tiny", "cluster=local", "parallel.strategy=bogus"])
    assert str(err.value) == ("Detected: parallel.strategy='bogus'. Requirement: parallel.strategy is "
                              "one of auto, ddp, fsdp. Fix: set parallel.strategy=auto (the default), "
                              "or another of those values.")
    with pytest.raises(ConfigError, match=r"submit.emit is one of '', sbatch\. Fix: set submit.emit=''"):
        compose(["cluster=local", "submit.emit=script"])
    with pytest.raises(ConfigError, match=r"every entry of topology.nic_kinds is one of rdma, eth"):
        compose(["cluster=local", "topology.nic_kinds=[rdma,wifi]"])


def test_the_two_supervisor_words_that_a_bool_can_spell_take_any_case() -> None:
    cfg = compose(["cluster=local", "supervisor.require_heartbeat=true",  # a bool to Hydra
                   "supervisor.exit0_after_signal=Completed"])
    assert (cfg.supervisor.require_heartbeat, cfg.supervisor.exit0_after_signal) == ("true", "completed")
    assert type(cfg.supervisor.require_heartbeat) is str
    with pytest.raises(ConfigError, match="parallel.strategy is one of"):
        compose(["cluster=local", "parallel.strategy=DDP"])  # the others are exact, as they were


def test_check_choices_on_a_dataclass_of_its_own() -> None:
    @dataclasses.dataclass
    class Toy:
        mode: str = "a"
        kinds: list[str] = dataclasses.field(default_factory=lambda: ["x"])

    check_choices("toy", Toy(), {"mode": ("a", "b"), "kinds": ("x", "y")})
    with pytest.raises(ConfigError, match=r"Fix: set toy.mode=a \(the default\)"):
        check_choices("toy", Toy(mode="c"), {"mode": ("a", "b")})
    with pytest.raises(ConfigError, match=r"Fix: set toy.kinds=\[x\], or list others"):
        check_choices("toy", Toy(kinds=["x", "z"]), {"kinds": ("x", "y")})
    folded = Toy(mode="B")
    check_choices("toy", folded, {"mode": ("a", "b")}, fold_case=("mode",))
    assert folded.mode == "b"
