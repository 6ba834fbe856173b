"""failure_env never overrides the user; check_timeouts explains contradictions."""

from __future__ import annotations

import dataclasses
import re

import pytest

from slurmkit.config import SlurmkitConfig, compose
from slurmkit.errors import ConfigError
from slurmkit.supervise.timeouts import check_timeouts, failure_env

WANTED = ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
          "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_PROPAGATE_ERROR", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]


@pytest.fixture(scope="module")
def cfg() -> SlurmkitConfig:
    return compose(["+exp=tiny"])


def with_(cfg: SlurmkitConfig, **sections: dict[str, object]) -> SlurmkitConfig:
    """A copy of ``cfg`` with fields of its sections replaced: with_(cfg, job={"requeue": False})."""
    changes = {name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in sections.items()}
    return dataclasses.replace(cfg, **changes)


def rank_env(cfg: SlurmkitConfig, base: dict[str, str]) -> dict[str, str]:
    """What the node agent gives a rank: its own environment plus failure_env on top."""
    env = dict(base)
    env.update(failure_env(cfg, "/runs/r1", base))
    return env


def test_failure_env_defaults(cfg: SlurmkitConfig) -> None:
    env = failure_env(cfg, "/runs/r1", {})
    assert sorted(env) == sorted(WANTED)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/runs/r1/nccl_trace/rank_"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]  # torch >= 2.7 and older
    assert env["TORCH_NCCL_PROPAGATE_ERROR"] == "1"


@pytest.mark.parametrize(("pg_timeout_s", "heartbeat_s"), [(600.0, 660), (60.0, 480), (1800.0, 1860)])
def test_watchdog_heartbeat_outlasts_a_collective(cfg: SlurmkitConfig, pg_timeout_s: float,
                                                  heartbeat_s: int) -> None:
    c = with_(cfg, parallel={"pg_timeout_s": pg_timeout_s}, supervisor={"heartbeat_timeout_s": 30.0})
    assert failure_env(c, "/r", {})["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == str(heartbeat_s)


@pytest.mark.parametrize("key", WANTED)
@pytest.mark.parametrize("value", ["0", ""])
def test_user_value_is_never_overridden(cfg: SlurmkitConfig, key: str, value: str) -> None:
    assert key not in failure_env(cfg, "/r", {key: value})
    assert rank_env(cfg, {key: value})[key] == value


@pytest.mark.parametrize("value", ["0", "1"])
def test_old_async_error_handling_name_counts_as_the_users_choice(cfg: SlurmkitConfig, value: str) -> None:
    env = rank_env(cfg, {"NCCL_ASYNC_ERROR_HANDLING": value})
    assert env["NCCL_ASYNC_ERROR_HANDLING"] == value
    # torch reads the new name first: setting it would silently override the user's old one.
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # the others still come


def test_base_is_not_modified(cfg: SlurmkitConfig) -> None:
    base = {"PATH": "/usr/bin"}
    failure_env(cfg, "/r", base)
    assert base == {"PATH": "/usr/bin"}


# ------------------------------------------------------------------ check_timeouts

def actionable(exc: ConfigError) -> str:
    text = str(exc)
    assert text.startswith("Detected: ") and ". Requirement: " in text and ". Fix: " in text
    return text


def test_consistent_timeouts_pass(cfg: SlurmkitConfig) -> None:
    check_timeouts(cfg)  # the tiny experiment as shipped


@pytest.mark.parametrize("heartbeat_s", [600.0, 900.0])
def test_heartbeat_not_below_pg_timeout_is_an_error(cfg: SlurmkitConfig, heartbeat_s: float) -> None:
    c = with_(cfg, parallel={"pg_timeout_s": 600.0}, supervisor={"heartbeat_timeout_s": heartbeat_s})
    with pytest.raises(ConfigError) as info:
        check_timeouts(c)
    text = actionable(info.value)
    assert f"supervisor.heartbeat_timeout_s={heartbeat_s:g} >= parallel.pg_timeout_s=600" in text
    assert "set supervisor.heartbeat_timeout_s below 600" in info.value.fix


def suggested_lead(exc: ConfigError) -> int:
    m = re.search(r"job\.signal_lead_s=(\d+) or more", exc.fix)
    assert m is not None, exc.fix
    return int(m.group(1))


@pytest.mark.parametrize("poll_s", [0.5, 60.0])
def test_signal_lead_too_short_for_the_polls(cfg: SlurmkitConfig, poll_s: float) -> None:
    c = with_(cfg, job={"requeue": True, "signal_lead_s": 1}, supervisor={"poll_interval_s": poll_s})
    with pytest.raises(ConfigError) as info:
        check_timeouts(c)
    text = actionable(info.value)
    assert "job.signal_lead_s=1 with job.requeue=true" in text and f"poll_interval_s={poll_s:g}" in text
    check_timeouts(with_(c, job={"signal_lead_s": suggested_lead(info.value)}))  # the fix works


def test_short_signal_lead_is_fine_without_requeue(cfg: SlurmkitConfig) -> None:
    check_timeouts(with_(cfg, job={"requeue": False, "signal_lead_s": 0}, cluster={"kill_wait_s": 0}))


def test_warning_plus_kill_wait_too_short_for_a_snapshot(cfg: SlurmkitConfig) -> None:
    c = with_(cfg, job={"requeue": True, "signal_lead_s": 2}, cluster={"kill_wait_s": 0},
              supervisor={"poll_interval_s": 0.5})
    with pytest.raises(ConfigError) as info:
        check_timeouts(c)
    text = actionable(info.value)
    assert "job.signal_lead_s=2 + cluster.kill_wait_s=0" in text and "= 6 s" in text
    check_timeouts(with_(c, job={"signal_lead_s": suggested_lead(info.value)}))


def test_old_flight_recorder_name_counts_as_the_users_choice(cfg: SlurmkitConfig) -> None:
    env = failure_env(cfg, "/runs/r1", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})
    assert "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env


@pytest.mark.parametrize("name", ["TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"])
def test_a_users_dump_file_under_either_name_stands(cfg: SlurmkitConfig, name: str) -> None:
    env = failure_env(cfg, "/runs/r1", {name: "/scratch/fr_"})
    assert "TORCH_FR_DUMP_TEMP_FILE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env
