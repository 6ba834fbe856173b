"""supervisor.enabled is retired (nothing ever read it): a config that still sets it is answered
precisely. At submit, false is refused with Detected/Requirement/Fix and true is accepted with a
deprecation message; a config.yaml frozen before the key was retired still loads (true or false:
that run always ran supervised, its requeue must not fail now)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from slurmkit.config import compose, load_frozen, to_yaml
from slurmkit.errors import ConfigError

FROZEN_BEFORE = Path(__file__).resolve().parents[2] / "data" / "report" / "three_faults" / "config.yaml"


def _retired_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "supervisor.enabled" in r.getMessage()]


def test_the_packaged_configs_no_longer_set_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = compose(["+exp=tiny", "cluster=local"])
    assert cfg.supervisor.enabled is None
    assert _retired_messages(caplog) == []


def test_false_is_refused_at_submit_with_a_fix() -> None:
    with pytest.raises(ConfigError) as err:
        compose(["+exp=tiny", "cluster=local", "supervisor.enabled=false"])
    text = str(err.value)
    assert "Detected: supervisor.enabled=false, a retired key" in text
    assert "Fix: remove supervisor.enabled" in text


def test_true_is_accepted_with_a_deprecation_message(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = compose(["+exp=tiny", "cluster=local", "supervisor.enabled=true"])
    assert cfg.supervisor.max_restarts == 5
    (msg,) = _retired_messages(caplog)
    assert "retired and ignored" in msg and "remove it" in msg


def test_a_config_frozen_before_the_key_was_retired_still_loads(caplog: pytest.LogCaptureFixture) -> None:
    assert "  enabled: true\n  max_restarts" in FROZEN_BEFORE.read_text()  # the fixture predates it
    with caplog.at_level(logging.WARNING):
        cfg = load_frozen(str(FROZEN_BEFORE))
    assert cfg.supervisor.max_restarts == 5 and cfg.supervisor.spare_nodes == 1
    assert any("retired" in m for m in _retired_messages(caplog))


def test_a_frozen_false_is_ignored_with_a_message_not_fatal(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    frozen = tmp_path / "config.yaml"
    frozen.write_text(to_yaml(compose(["+exp=tiny", "cluster=local"])).replace(
        "supervisor:\n  enabled: null\n", "supervisor:\n  enabled: false\n", 1))
    assert "enabled: false" in frozen.read_text()
    with caplog.at_level(logging.WARNING):
        cfg = load_frozen(str(frozen))
    assert cfg.supervisor.enabled is None and cfg.job.name == "tiny"
    assert any("retired supervisor.enabled=false; ignored" in m for m in _retired_messages(caplog))
