"""``python -m slurmkit.plan +exp=llama70b cluster=dgx_h100``: the memory plan, before submit.

Composes the config exactly as submit does, estimates memory per device for the layout and
prints it as a table. Exit 0 when the layout fits, 2 (with the Detected/Requirement/Fix
message) when it does not or cannot work. When a Slurm controller answers, a second table shows
what the site can do (slurmkit/slurm/capabilities.py; the probe is cached for an hour).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slurmkit.cli import hydraflags
from slurmkit.config.compose import compose
from slurmkit.errors import ConfigError, print_error
from slurmkit.slurm.capabilities import CACHE_TTL_S, SiteCapabilities
from slurmkit.submit_checks import with_command_resolved
from slurmkit.train.planner import MemoryEstimate, check_config, estimate_on, hardware_of


def host_mem_gb() -> float:
    """This machine's memory (a local run's ranks share it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def render(est: MemoryEstimate, title: str) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("item")
    table.add_column("per device", justify="right")
    for label, value in est.rows():
        style = "red" if label == "fits" and not est.fits else None
        table.add_row(label, value, style=style)
    return table


def _yes(value: bool | None, yes: str = "yes", no: str = "no") -> str:
    return "unknown" if value is None else (yes if value else no)


def _listed(values: tuple[str, ...] | None) -> str:
    return "unknown" if values is None else (", ".join(values) or "none")


def _secs(value: int | None) -> str:
    return "unknown" if value is None else f"{value} s"


def site_rows(caps: SiteCapabilities) -> list[tuple[str, str, str]]:
    """(capability, what the site has, what it means for the job), every value as found."""
    if caps.requeue_delay_s is not None:
        hold = f"{caps.requeue_delay_s} s (requeue_delay)"
    else:
        hold = "~121 s (credential lifetime + 1 s)" if caps.at_least((26, 5)) is False else "not set"
    if caps.proctrack is None:
        tracked = ""
    elif caps.proctrack == "cgroup":
        tracked = "every process of the job ends with it"
    else:
        tracked = "a process the job forks may outlive it"
    gres = _listed(caps.gres)
    if caps.typed_gres is not None:
        gres += " (typed)" if caps.typed_gres else " (untyped)"
    return [
        ("Slurm", caps.version or "unknown", f"cluster {caps.cluster_name or 'unknown'}"),
        ("--json output", _yes(caps.json_output),
         "the supervisor reads sacct as JSON" if caps.json_accounting else
         "sacct read as text: 22.05's JSON gives a failed step exit code 0" if caps.json_output else
         "text parsers are the fallback"),
        ("sacct FailedNode", _yes(caps.failed_node_field), "Slurm 23.02+"),
        ("JobRequeue", _yes(caps.job_requeue, "1", "0"), "the site's default; the job asks --requeue or "
                                                         "--no-requeue (job.requeue)"),
        ("expedited requeue", _yes(caps.expedited_requeue, "enabled", "no"),
         caps.requeue_arg if caps.expedited_requeue else
         "Slurm 25.11+ with SlurmctldParameters=enable_expedited_requeue"),
        ("requeue hold", hold, "before a requeued job is eligible"),
        ("requeue_setup_env_fail", _yes(caps.requeue_setup_env_fail), "SchedulerParameters"),
        ("KillWait", _secs(caps.kill_wait_s), "SIGTERM to SIGKILL at the job's end"),
        ("UnkillableStepTimeout", _secs(caps.unkillable_step_timeout_s), ""),
        ("proctrack", caps.proctrack or "unknown", tracked),
        ("TaskPlugin", _listed(caps.task_plugins), ""),
        ("PrologFlags", _listed(caps.prolog_flags), ""),
        ("enable_stepmgr", _yes(caps.stepmgr), "step management on the batch host (24.05+)"),
        ("send_user_signal", _yes(caps.send_user_signal), "the job's --signal at preemption"),
        ("PreemptMode", caps.preempt_mode or "unknown", ""),
        ("pyxis", caps.pyxis, "job.container_image needs it"),
        ("GRES", gres, ""),
        ("probed", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(caps.probed_at)),
         f"cached for {CACHE_TTL_S / 3600:g} h"),
        *(("problem", p.splitlines()[0] if p else "", "") for p in caps.problems[:3]),
    ]


def site_table(caps: SiteCapabilities) -> Table:
    table = Table(title="site", show_header=True, header_style="bold")
    for name in ("capability", "found", "for the job"):
        table.add_column(name)
    for row in site_rows(caps):
        table.add_row(*(Text(cell) for cell in row))  # Slurm's text, never read as markup
    return table


def probe_site(env: Mapping[str, str]) -> SiteCapabilities | None:
    """The site's capabilities, or None when no Slurm controller answers here."""
    from slurmkit.slurm.capabilities import site_capabilities
    from slurmkit.cli.submit import slurm_reachable

    return site_capabilities(env) if slurm_reachable(env) else None


def print_site(console: Console, env: Mapping[str, str],
               site: Callable[[Mapping[str, str]], SiteCapabilities | None]) -> None:
    try:
        caps = site(env)
    except Exception as exc:  # the site table is information: it never fails the plan
        console.print(Text(f"site: the probe failed: {exc}"))
        return
    if caps is None:
        console.print("no Slurm here: local executor")
    else:
        console.print(site_table(caps))


def main(argv: list[str] | None = None, console: Console | None = None,
         env: Mapping[str, str] | None = None,
         site: Callable[[Mapping[str, str]], SiteCapabilities | None] = probe_site,
         cwd: str | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    console = console or Console()
    if any(a in ("-h", "--help") for a in overrides):
        console.print(__doc__ or "", markup=False, highlight=False, soft_wrap=True)
        return 0
    env = os.environ if env is None else env
    try:
        done = hydraflags.handle(overrides, console)  # --cfg job, --info, ...; hydra.* refused
        if done is not None:
            return done
        cfg = compose(overrides)
        # submit would refuse a script job.command names that is not there: so does the plan
        with_command_resolved(cfg, os.getcwd() if cwd is None else cwd)
    except ConfigError as exc:
        print_error(console, exc, "configuration error")
        return 2
    title = f"slurmkit plan: {cfg.model.name} on {cfg.cluster.name}"
    try:
        est = check_config(cfg, host_mem_gb=host_mem_gb())
    except ConfigError as exc:
        try:  # show the numbers that failed, when the layout itself is possible
            hw = hardware_of(cfg, host_mem_gb=host_mem_gb())
            console.print(render(estimate_on(cfg.model, cfg.parallel, cfg.train, hw), title))
        except ConfigError:
            pass  # the layout is impossible: the message below says why
        print_error(console, exc, "configuration error")
        return 2
    console.print(render(est, title))
    print_site(console, env, site)
    return 0


if __name__ == "__main__":
    sys.exit(main())
