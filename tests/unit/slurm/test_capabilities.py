"""The site capability probe from canned Slurm output: 22.05 as the local cluster prints it, and
newer sites as Slurm's documentation describes them (slurmkit/slurm/capabilities.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from slurmkit.slurm.capabilities import (
    SiteCapabilities,
    parse_gres,
    parse_version,
    probe,
)
from slurmkit.slurm.errors import SlurmCommandError
from slurmkit.slurm.runner import CommandResult


def config_text(**values: str) -> str:
    """``scontrol show config`` as Slurm prints it: a header line, then ``Key = value``."""
    lines = ["Configuration data as of 2026-12-03T15:01:11"]
    lines += [f"{k:<23} = {v}" for k, v in values.items()]
    return "\n".join(lines) + "\n\nSlurmctld(primary) at vm is UP\n"


#: The local cluster's 22.05.8 (the keys the probe reads, values as printed there).
CONFIG_2205 = config_text(
    ClusterName="slurmkit", JobRequeue="0", KillWait="10 sec", PlugStackConfig="(null)",
    PreemptMode="REQUEUE", ProctrackType="proctrack/linuxproc", PrologFlags="(null)",
    SchedulerParameters="(null)", SlurmctldParameters="(null)",
    SLURM_CONF="/nonexistent/etc/slurm.conf", SLURM_VERSION="22.05.8", TaskPlugin="task/none",
    UnkillableStepTimeout="60 sec")

#: A 25.11 site that enabled expedited requeue (sbatch(1), slurm.conf(5) of 25.11).
CONFIG_2511 = config_text(
    ClusterName="eos", JobRequeue="1", KillWait="30 sec", PreemptMode="REQUEUE",
    PreemptParameters="send_user_signal,reclaim_licenses", ProctrackType="proctrack/cgroup",
    PrologFlags="Alloc,Contain,X11", SchedulerParameters="bf_continue,requeue_setup_env_fail",
    SlurmctldParameters="enable_configless,enable_expedited_requeue,enable_stepmgr",
    SLURM_VERSION="25.11.2", TaskPlugin="task/affinity,task/cgroup", UnkillableStepTimeout="120 sec")

NODES_TYPED = ("NodeName=gpu001 State=IDLE Gres=gpu:h100:8(S:0-1),nic:mlx5:4 CPUTot=224\n"
               "NodeName=gpu002 State=IDLE Gres=gpu:h100:8(S:0-1) CPUTot=224\n")
NODES_UNTYPED = "NodeName=node1 State=IDLE Gres=gpu:4 CPUTot=2\n"
HELPFORMAT_2205 = "Account             AdminComment        AllocCPUS           ExitCode\n"
HELPFORMAT_2302 = HELPFORMAT_2205 + "FailedNode          Flags\n"
SQUEUE_JSON_2205 = json.dumps({"meta": {"plugin": {"type": "openapi/v0.0.38"},
                                        "Slurm": {"release": "22.05.8"}}, "errors": [], "jobs": []})


class Canned:
    """A CommandRunner answering from a table; an argv it lacks fails as an unknown command."""

    def __init__(self, answers: Mapping[tuple[str, ...], str | SlurmCommandError]) -> None:
        self.answers = dict(answers)
        self.calls: list[list[str]] = []

    def run(self, args: list[str], *, timeout_s: float = 30, input: str | None = None,
            env: Mapping[str, str] | None = None) -> CommandResult:
        self.calls.append(list(args))
        answer = self.answers.get(tuple(args))
        if answer is None:
            raise SlurmCommandError(args, 1, f"{args[0]}: unrecognized option")
        if isinstance(answer, SlurmCommandError):
            raise answer
        return CommandResult(list(args), 0, answer, "")


def site(config: str | None, *, nodes: str = NODES_UNTYPED, helpformat: str = HELPFORMAT_2205,
         squeue_json: str | SlurmCommandError | None = SQUEUE_JSON_2205, srun_help: str = "",
         **more: str | SlurmCommandError) -> Canned:
    answers: dict[tuple[str, ...], str | SlurmCommandError] = {
        ("scontrol", "show", "node", "-o"): nodes, ("sacct", "--helpformat"): helpformat,
        ("srun", "--help"): srun_help}
    if config is not None:
        answers[("scontrol", "show", "config")] = config
    if squeue_json is not None:
        answers[("squeue", "--json", "--me")] = squeue_json
    answers.update({tuple(k.split("_")): v for k, v in more.items()})
    return Canned(answers)


def test_2411_prints_task_none_as_null_and_that_is_no_task_plugin_not_unknown() -> None:
    """The local cluster on 24.11.5 (tools/local-cluster up --slurm 24.11): TaskPlugin=task/none
    is shown as "(null)"."""
    caps = probe(site(CONFIG_2205.replace("task/none", "(null)").replace("22.05.8", "24.11.5"),
                      helpformat=HELPFORMAT_2302))
    assert caps.version == "24.11.5" and caps.task_plugins == ("none",) and caps.failed_node_field is True
    assert probe(site(CONFIG_2205.replace("TaskPlugin", "Other"))).task_plugins is None  # not said


def test_a_2205_site_as_the_local_cluster_prints_it(tmp_path) -> None:
    caps = probe(site(CONFIG_2205), slurm_conf=str(tmp_path / "slurm.conf"), clock=lambda: 1000.0)
    assert caps.version == "22.05.8" and caps.cluster_name == "slurmkit" and caps.probed_at == 1000.0
    assert caps.json_output is True and caps.failed_node_field is False
    assert caps.job_requeue is False and caps.expedited_requeue is False and caps.requeue_arg == "--requeue"
    assert caps.requeue_delay_s is None and caps.requeue_setup_env_fail is False
    assert (caps.kill_wait_s, caps.unkillable_step_timeout_s) == (10, 60)
    assert caps.proctrack == "linuxproc" and caps.task_plugins == ("none",) and caps.prolog_flags == ()
    assert caps.stepmgr is False and caps.send_user_signal is False and caps.preempt_mode == "REQUEUE"
    assert caps.pyxis == "absent"  # no plugstack.conf beside slurm.conf: no spank plugins
    assert caps.gres == ("gpu",) and caps.typed_gres is False and caps.problems == ()


def test_a_2511_site_with_expedited_requeue_enabled() -> None:
    caps = probe(site(CONFIG_2511, nodes=NODES_TYPED, helpformat=HELPFORMAT_2302,
                      srun_help="  --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH\n"))
    assert caps.version == "25.11.2" and caps.at_least((25, 11)) is True
    assert caps.expedited_requeue is True and caps.requeue_arg == "--requeue=expedite"
    assert caps.job_requeue is True and caps.failed_node_field is True
    assert caps.requeue_setup_env_fail is True and caps.stepmgr is True and caps.send_user_signal is True
    assert caps.proctrack == "cgroup" and caps.task_plugins == ("affinity", "cgroup")
    assert caps.prolog_flags == ("alloc", "contain", "x11") and caps.kill_wait_s == 30
    assert caps.pyxis == "present"
    assert caps.gres == ("gpu:h100", "nic:mlx5") and caps.typed_gres is True


@pytest.mark.parametrize("version, params, want", [
    ("25.05.4", "enable_expedited_requeue", False),  # asked for, but the release has no such thing
    ("25.11.0", "enable_configless", False),  # the release has it, the admin did not enable it
    ("26.05.1", "enable_expedited_requeue,requeue_delay=5", True),
])
def test_expedited_requeue_needs_the_release_and_the_admin(version, params, want) -> None:
    caps = probe(site(config_text(SLURM_VERSION=version, SlurmctldParameters=params)))
    assert caps.expedited_requeue is want
    assert caps.requeue_arg == ("--requeue=expedite" if want else "--requeue")
    assert caps.requeue_delay_s == (5 if "requeue_delay" in params else None)


def test_the_version_from_json_meta_or_scontrol_when_the_config_names_none() -> None:
    meta = json.dumps({"meta": {"slurm": {"release": "23.02.7"}}, "jobs": []})  # 23.02's spelling
    caps = probe(site(config_text(ClusterName="c", JobRequeue="1"), squeue_json=meta))
    assert caps.version == "23.02.7" and caps.failed_node_field is False  # helpformat says so
    caps = probe(site(config_text(ClusterName="c"), squeue_json=None,
                      **{"scontrol_--version": "slurm 24.11.5\n"}))
    assert caps.version == "24.11.5" and caps.json_output is False


def test_json_output_unknown_when_the_controller_does_not_answer() -> None:
    down = SlurmCommandError(["squeue"], 1, "squeue: error: Unable to contact slurm controller")
    caps = probe(site(CONFIG_2205, squeue_json=down))
    assert caps.json_output is None and any("squeue --json" in p for p in caps.problems)
    assert probe(site(CONFIG_2205, squeue_json="not json")).json_output is False


def test_no_slurm_at_all_is_all_unknown_and_no_exception() -> None:
    caps = probe(Canned({}))
    assert caps.version is None and caps.json_output is None and caps.job_requeue is None
    assert caps.expedited_requeue is None and caps.gres is None and caps.pyxis == "unknown"
    assert caps.stepmgr is None and caps.send_user_signal is None and caps.requeue_setup_env_fail is None
    assert caps.requeue_arg == "--requeue"
    assert any("scontrol show config" in p for p in caps.problems)


@pytest.mark.parametrize("garbage", [
    "", "\x00\xff garbage", "KillWait = lots\nSLURM_VERSION = [bold]x[/bold]\n",
    "JobRequeue = maybe\nSlurmctldParameters = ,,=,enable_expedited_requeue=\nSLURM_VERSION = 99999.1\n",
    "ProctrackType = \nPrologFlags = ,\nTaskPlugin = task/\n" * 3,
])
def test_hostile_text_everywhere_never_raises(garbage) -> None:
    runner = site(garbage, nodes=garbage + "\nNodeName=x CPUTot=many Gres=:::(", helpformat=garbage,
                  squeue_json=garbage, srun_help=garbage, **{"scontrol_--version": garbage})
    caps = probe(runner)
    assert isinstance(caps, SiteCapabilities)
    assert SiteCapabilities.from_dict(json.loads(json.dumps(caps.to_dict()))) == caps


@pytest.mark.parametrize("values, want", [
    (["gpu:h100:8(S:0-1)", "gpu:h100:8(S:0-1)"], (("gpu:h100",), True)),
    (["gpu:4", None, "(null)"], (("gpu",), False)),
    (["gpu:a100:4,nic:2", "gpu:v100:2(S:0)"], (("gpu:a100", "gpu:v100", "nic"), True)),
    (["gpu:a100:4(IDX:0-3),shard:a100:32"], (("gpu:a100", "shard:a100"), True)),
    ([], ((), False)),
])
def test_gres_types_from_node_gres(values, want) -> None:
    assert parse_gres(values) == want


@pytest.mark.parametrize("text, want", [
    ("slurm-wlm 22.05.8", (22, 5, 8)), ("slurm 25.11.0-0rc1", (25, 11, 0)), ("23.02", (23, 2, 0)),
    ("", None), (None, None), ("slurm", None),
])
def test_parse_version(text, want) -> None:
    assert parse_version(text) == want


def test_pyxis_from_the_plugstack_and_its_includes(tmp_path) -> None:
    conf_d = tmp_path / "plugstack.conf.d"
    conf_d.mkdir()
    (tmp_path / "plugstack.conf").write_text(f"# pyxis would go here\ninclude {conf_d}/*.conf\n")
    config = config_text(SLURM_VERSION="23.11.1", PlugStackConfig=str(tmp_path / "plugstack.conf"))
    assert probe(site(config)).pyxis == "absent"  # only a comment names it
    (conf_d / "pyxis.conf").write_text("required /usr/lib/slurm/spank_pyxis.so runtime_path=/run/pyxis\n")
    assert probe(site(config)).pyxis == "present"
    # Not readable as a file (a directory stands in, since root reads any file): unknown, not absent.
    unreadable = config_text(SLURM_VERSION="23.11.1", PlugStackConfig=str(conf_d))
    assert probe(site(unreadable)).pyxis == "unknown"


def test_from_dict_refuses_what_to_dict_does_not_write() -> None:
    good = probe(site(CONFIG_2511, nodes=NODES_TYPED)).to_dict()
    assert SiteCapabilities.from_dict(good).to_dict() == good
    for bad in ({**good, "schema": 2}, {**good, "kill_wait_s": "30"}, {**good, "json_output": 1},
                {**good, "gres": "gpu"}, {**good, "pyxis": "maybe"}, {**good, "probed_at": None},
                {k: v for k, v in good.items() if k != "proctrack"}, [good], "x"):
        with pytest.raises(ValueError):
            SiteCapabilities.from_dict(bad)
