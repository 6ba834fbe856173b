"""`python -m slurmkit.submit [-m] +exp=NAME [cluster=NAME] [key=value ...]`

Compose the config, validate it, freeze it into a new run directory, render the job through
submitit and submit it: to Slurm when a controller answers (cluster=auto), else as local
processes. Returns as soon as the job is queued and prints where to follow it.

With -m (--multirun), Hydra's sweep syntax (key=a,b, range(), choice()) runs every combination
as one Slurm job array, one run directory per variant under one sweep directory
(slurmkit/sweep/); submit.array_parallelism=K runs at most K variants at once.
"""

from __future__ import annotations

import dataclasses
import functools
import getpass
import logging
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from slurmkit.atomic import atomic_write
from slurmkit.cli import hydraflags
from slurmkit.config import SlurmkitConfig, compose, config_hash, to_yaml
from slurmkit.errors import ConfigError, SlurmkitError, SubmissionError, print_error
from slurmkit.failures.programs import is_reference_trainer
from slurmkit.launch.local import Submitted, local_gpu_parameters, submit_local  # and re-exported
from slurmkit.layout import FROZEN_FILE_MODE, Layout, config_digest, resolve_layout, write_layout
from slurmkit.rundir import RUN_DIR_MODE, make_submitit_dir, seal_pickles
from slurmkit.render import JobSpec, build_jobspec, make_executor, render_standalone, render_submitit_script
from slurmkit.runfiles import CONFIG_NAME, LOGS_DIR, SCRIPT_NAME, SUBMITIT_DIR
from slurmkit.submit_checks import (check_adopt, check_run_root, check_store_backends, make_run_dir, remove_created,
                                    with_command_resolved)
from slurmkit.ledger.ledger import LEDGER_NAME, Ledger

if TYPE_CHECKING:
    from slurmkit.slurm.capabilities import SiteCapabilities

USAGE = __doc__ or ""
log = logging.getLogger(__name__)


def slurm_reachable(env: Mapping[str, str], timeout_s: float = 5.0) -> bool:
    """True when `sbatch` exists and a controller answers `scontrol ping`."""
    if shutil.which("sbatch", path=env.get("PATH")) is None:
        return False
    from slurmkit.slurm.client import slurm_client

    return slurm_client(env, timeout_s=timeout_s).controller_reachable(timeout_s)


def resolve_cluster(cfg: SlurmkitConfig, env: Mapping[str, str],
                    probe: Callable[[Mapping[str, str]], bool] = slurm_reachable) -> SlurmkitConfig:
    if cfg.cluster.kind != "auto":
        return cfg
    kind = "slurm" if probe(env) else "local"
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, kind=kind))


def new_run_dir(cfg: SlurmkitConfig, clock: Callable[[], float] = time.time) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(clock()))
    return os.path.abspath(os.path.join(cfg.submit.run_root, cfg.job.name, f"{stamp}-{secrets.token_hex(2)}"))


def validate(cfg: SlurmkitConfig, layout: Layout | None = None) -> None:
    """Checks that need more than one component: timeouts, the parallel layout vs the cluster
    (``layout``: the run's resolved layout, the one the job, the planner and the agent use)."""
    from slurmkit.supervise.timeouts import check_timeouts

    layout = resolve_layout(cfg) if layout is None else layout
    check_auto_site(cfg, layout)
    check_timeouts(cfg)
    check_store_backends(cfg.store)
    check_adopt(cfg, is_reference_trainer(cfg.job.command))
    if is_reference_trainer(cfg.job.command):  # the trainer's memory plan: nothing for another program
        from slurmkit.train.planner import check_config

        check_config(cfg, layout=layout)


def check_auto_site(cfg: SlurmkitConfig, layout: Layout) -> None:
    """cluster=auto found a Slurm controller but no site profile says where jobs go: a job of
    several nodes is refused rather than sent to whatever partition and account the site
    defaults to (from a login node, as soon as ``scontrol ping`` answered). One node may try."""
    c = cfg.cluster
    if c.name != "auto" or c.kind != "slurm" or c.partition or c.account or layout.nodes <= 1:
        return
    raise ConfigError(
        f"cluster=auto found Slurm (a controller answered) but no site profile: a {layout.nodes}-node job "
        "with neither cluster.partition nor cluster.account",
        "a cluster profile that says where multi-node jobs go (partition, account, GPUs per node)",
        "write cluster/<site>.yaml in a directory named by SLURMKIT_CONF_DIR (docs/site.md; `slurmkit submit "
        "--info` shows where configs are looked for) and submit with cluster=<site>; or name them here: "
        "cluster.partition=P cluster.account=A; or try one node with job.nodes=1")


def topology_srun_args(cfg: SlurmkitConfig) -> list[str]:
    from slurmkit.topology import srun_binding_args

    return list(srun_binding_args(cfg.topology))


def freeze(cfg: SlurmkitConfig, run_dir: str, layout: Layout | None = None) -> None:
    """Write config.yaml, then layout.json beside it (each atomically; the layout carries the
    config's digest, so an agent never pairs one run's layout with another's config)."""
    os.makedirs(os.path.join(run_dir, LOGS_DIR), exist_ok=True)
    os.chmod(run_dir, RUN_DIR_MODE)  # (a sweep's variant directory too) slurmkit/rundir.py
    # FROZEN_FILE_MODE whatever the umask (slurmkit/rundir.py)
    atomic_write(os.path.join(run_dir, CONFIG_NAME), frozen_text(cfg), mode=FROZEN_FILE_MODE)
    write_layout(run_dir, resolve_layout(cfg) if layout is None else layout)


def freeze_site(run_dir: str, env: Mapping[str, str], err: Console) -> SiteCapabilities | None:
    """capabilities.json beside config.yaml: what the site can do, for the job's agents (cached
    per user for an hour, slurmkit/slurm/capabilities.py); returned for the submission itself.
    Never fails a submission."""
    from slurmkit.slurm.capabilities import site_capabilities, write_run_dir_copy

    caps = None
    try:
        caps = site_capabilities(env)
        write_run_dir_copy(run_dir, caps)
        problem = "" if caps.version else "; ".join(caps.problems) or "no answer"
    except Exception as exc:  # information for the job, not a condition of it
        problem = str(exc)
    if problem:
        print_error(err, f"Detected: the site probe learned nothing ({problem}). Requirement: none, "
                    "the job runs with the site's capabilities unknown. Fix: check that `scontrol "
                    "show config` answers here", "warning")
    return caps


def submit_with_site(spec: JobSpec, caps: SiteCapabilities | None, err: Console,
                     submit: Callable[[JobSpec], Submitted]) -> Submitted:
    """Submit asking for what the site has: ``--requeue=expedite`` where the probe found it
    enabled. When sbatch refuses that (the probe is an hour old, the admin turned it off: its
    message names the option), the job goes in again with plain ``--requeue``, and says so;
    any other refusal stands."""
    if not (spec.requeue and caps is not None and caps.expedited_requeue):
        return submit(spec)
    try:
        return submit(dataclasses.replace(spec, requeue_expedite=True))
    except SubmissionError as exc:
        said = f"{exc} {exc.__cause__ or ''}"  # sbatch's own words are in the cause
        if "requeue" not in said.lower():
            raise  # refused for another reason (a partition, a QOS): that answer stands
        line = next((ln for ln in said.splitlines() if "requeue" in ln.lower()), said)
        print_error(err, f"Detected: sbatch refused --requeue=expedite ({line.strip()[:300]}). "
                    "Requirement: none, a plain --requeue does the job with Slurm's usual requeue hold. "
                    "Fix: nothing; submitted again with --requeue", "warning")
        return submit(spec)


def frozen_text(cfg: SlurmkitConfig) -> bytes:
    """The bytes of config.yaml; the batch script carries their sha256 (slurmkit/rundir.py)."""
    return to_yaml(cfg).encode("utf-8")


def submit_slurm(spec: JobSpec) -> Submitted:
    from slurmkit.launch.entry import submitit_entry

    make_submitit_dir(spec.run_dir)  # 0700 before submitit writes its pickle there (rundir.py)
    executor = make_executor(spec)
    try:
        job = executor.submit(submitit_entry, spec.run_dir)
    except Exception as exc:  # submitit wraps sbatch's failure in several types; all are fatal here
        text = str(exc)
        raise SubmissionError(
            f"Detected: sbatch refused the job: {text.strip().splitlines()[-1] if text.strip() else exc!r}. "
            "Requirement: a partition, account, qos and resources this cluster accepts. "
            "Fix: check `sinfo -s` and `sacctmgr show assoc user=$USER`, then set cluster.partition / "
            "cluster.account / cluster.qos or lower the resources.") from exc
    seal_pickles(spec.run_dir)
    return Submitted(str(job.job_id), spec.run_dir, "slurm", job)


def warn_singleton(spec: JobSpec, env: Mapping[str, str], console: Console) -> None:
    """Say why the job will sit PENDING: --dependency=singleton holds it while another job of
    this user with the same name is queued or running. One squeue call; silent if it fails."""
    if not spec.singleton:
        return
    from slurmkit.slurm.client import slurm_client

    try:
        rows = slurm_client(env, interactive=True).squeue(
            user=env.get("USER") or getpass.getuser())
    except Exception as exc:  # only a hint: never let it stop a submission
        log.info("squeue for the singleton hint failed: %s", exc)
        return
    same = [r for r in rows if r.name == spec.name]
    if not same:
        return
    listed = ", ".join(f"{r.job_id} ({r.state})" for r in same[:5]) + (" ..." if len(same) > 5 else "")
    console.print(
        f"[bold yellow]note[/]: {len(same)} job(s) named {escape(spec.name)} already queued or running: "
        f"{escape(listed)}. With job.singleton=true (--dependency=singleton) this job stays PENDING "
        "(reason: Dependency) until they end. To run them at the same time, submit with "
        "job.singleton=false or another job.name.", highlight=False)


def git_commit(cwd: str, timeout_s: float = 5.0) -> str:
    """The git commit of the directory submit runs in (the user's code, for the report's
    header), with ``-dirty`` when tracked files changed; "" outside a repository or without git."""
    git = shutil.which("git")
    if git is None:
        return ""
    try:
        head = subprocess.run([git, "rev-parse", "--short=12", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, timeout=timeout_s)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run([git, "diff", "--quiet", "HEAD", "--"], cwd=cwd, capture_output=True,
                               timeout=timeout_s).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return ""
    sha = head.stdout.strip()
    return f"{sha}-dirty" if dirty and sha else sha


def require_experiment(argv: list[str]) -> None:
    """No submission without ``+exp=NAME``: without one the root config's defaults made a job
    of the all-reduce example's shape that nobody asked for (a 1-hour, 2-node allocation on a
    site, sent as soon as a controller answered)."""
    if any(a.lstrip("+").startswith("exp=") for a in argv):
        return
    from slurmkit.config.compose import available

    names = available("exp")
    raise ConfigError("no experiment on the command line", f"+exp=NAME, one of: {', '.join(names)} "
                      "(or a file exp/NAME.yaml in $SLURMKIT_CONF_DIR)",
                      "add +exp=tiny to try the reference trainer on this machine; a program of your own "
                      "runs with +exp=tiny job.command=[python,train.py] (docs/trainers.md)")


def refuse_sweep_without_multirun(argv: list[str]) -> None:
    from slurmkit.sweep import sweeping

    swept = sweeping(argv)
    if swept:
        raise ConfigError(
            f"{' '.join(swept)} asks for a sweep (a list of values) without -m",
            "a sweep runs with -m / --multirun, one variant per combination",
            f"add -m: python -m slurmkit.submit -m {' '.join(argv)}; or quote a value meant as one "
            "string (key='a,b')")


def print_submitted(console: Console, s: Submitted, spec: JobSpec) -> None:
    console.print(f"[bold green]submitted[/] {spec.name}: job [bold]{s.job_id}[/] ({s.executor})")
    console.print(f"  run directory : {s.run_dir}")
    console.print(f"  config        : {os.path.join(s.run_dir, CONFIG_NAME)}")
    console.print(f"  agent logs    : {os.path.join(s.run_dir, SUBMITIT_DIR)}/{s.job_id}_*_log.out")
    console.print(f"  rank logs     : {os.path.join(s.run_dir, LOGS_DIR)}/rank<N>.log")
    console.print(f"  ledger        : {os.path.join(s.run_dir, LEDGER_NAME)}")
    console.print(f"  watch         : slurmkit status --watch {shlex.quote(s.run_dir)}")
    console.print(f"  follow logs   : slurmkit logs -f {shlex.quote(s.run_dir)} --rank 0")
    console.print(f"  cancel        : slurmkit cancel --checkpoint {shlex.quote(s.run_dir)}")


def wait_job(s: Submitted, env: Mapping[str, str], timeout_s: float, *,
             clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> int:
    """Block until the job ends; 0 when it completed.

    sacct is polled after 1 s, then at intervals doubling to 30 s: a job waited on for a day
    costs slurmdbd a few thousand queries, not 86,400.
    """
    if s.executor == "local":
        try:
            s.job.wait()  # type: ignore[attr-defined]
        except Exception:  # submitit re-raises the job's failure; its state tells the outcome
            pass
        return 0 if s.job.state == "FINISHED" and s.job.exception() is None else 1  # type: ignore[attr-defined]
    from slurmkit.slurm.client import slurm_client

    from slurmkit.slurm.records import TERMINAL_STATES

    client = slurm_client(env, clock=clock, sleep=sleep)
    from slurmkit.supervise.exits.successor import successor_of

    job_id, deadline = s.job_id, clock() + (timeout_s or 10 ** 9)
    while True:
        state = client.wait_for_state(job_id, TERMINAL_STATES, max(deadline - clock(), 1.0), poll_s=1.0,
                                      max_poll_s=30.0, source="sacct")
        nxt = successor_of(s.run_dir, job_id)  # the job handed the run to one it submitted
        if nxt is None or nxt == job_id:
            return 0 if state == "COMPLETED" else 1
        print(f"job {job_id} handed the run over to job {nxt}: waiting for it", flush=True)
        job_id = nxt


def run(argv: list[str], env: Mapping[str, str], console: Console, err: Console, *,
        cwd: str | None = None) -> int:
    """``cwd``: the directory submit runs in (default: this process's), where a relative path in
    job.command is looked for (slurmkit/submit_checks.py)."""
    if any(a in ("-h", "--help") for a in argv):
        console.print(USAGE, markup=False, highlight=False)
        console.print(hydraflags.info_text(), markup=False, highlight=False)
        console.print(hydraflags.keys_text(), markup=False, highlight=False)
        return 0
    done = hydraflags.handle(argv, console)  # --cfg job, --info, ...; hydra.* refused
    if done is not None:
        return done
    require_experiment(argv)
    from slurmkit.sweep import split_multirun

    # job.command's files, after the secret checks of build_jobspec (which never echo what they
    # refuse) and before anything is written: for a single run and for every variant of a sweep
    resolve_command = functools.partial(with_command_resolved, cwd=os.getcwd() if cwd is None else cwd)
    multirun, argv = split_multirun(argv)
    if multirun:
        from slurmkit.sweep.submit import SingleRun, run_sweep

        return run_sweep(argv, env, console, err, SingleRun(resolve_cluster, validate, topology_srun_args,
                                                            warn_singleton, freeze, resolve_command))
    refuse_sweep_without_multirun(argv)
    cfg = resolve_cluster(compose(argv), env)
    layout = resolve_layout(cfg)  # once: the job, the planner, layout.json and the agent use it
    validate(cfg, layout)
    run_dir = new_run_dir(cfg)
    spec = build_jobspec(cfg, run_dir, topology_srun_args(cfg) if cfg.cluster.kind == "slurm" else [],
                         layout=layout)
    cfg = resolve_command(cfg)
    spec = dataclasses.replace(spec, config_sha256=config_digest(frozen_text(cfg)))
    if cfg.submit.dry_run:
        if cfg.cluster.kind == "local":
            console.print(f"# local mode: {spec.nodes} agent process(es) x {spec.ranks_per_node} ranks; "
                          "the sbatch script it would submit to Slurm:")
        sys.stdout.write(render_submitit_script(spec))
        return 0
    check_run_root(cfg.submit.run_root)
    if cfg.submit.emit == "sbatch":
        path = os.path.join(run_dir, SCRIPT_NAME)
        text = render_standalone(spec, path)
        created = make_run_dir(run_dir, cfg.submit.run_root)
        try:
            freeze(cfg, run_dir, layout)
            with open(path, "w") as f:
                f.write(text)
        except BaseException:
            remove_created(created, run_dir)
            raise
        console.print(f"wrote {path}\nsubmit it with: sbatch {path}")
        return 0
    if cfg.cluster.kind == "slurm":
        warn_singleton(spec, env, console)
    # Nothing half-way: a refused submission removes the run directory and every parent it
    # created (submit.run_root/<job.name> included), never one another submission uses.
    created = make_run_dir(run_dir, cfg.submit.run_root)
    try:
        freeze(cfg, run_dir, layout)
        if cfg.cluster.kind == "slurm":
            submitted = submit_with_site(spec, freeze_site(run_dir, env, err), err, submit_slurm)
        else:
            submitted = submit_local(spec)
    except BaseException:
        remove_created(created, run_dir)
        raise
    commit = git_commit(os.getcwd() if cwd is None else cwd)
    Ledger(os.path.join(run_dir, LEDGER_NAME), source="submit").append(
        "submitted", job_id=submitted.job_id, executor=submitted.executor, name=spec.name,
        nodes=spec.nodes, ranks_per_node=spec.ranks_per_node, config_hash=config_hash(cfg),
        overrides=list(argv), **({"commit": commit} if commit else {}))
    print_submitted(console, submitted, spec)
    if cfg.submit.keep_finished_runs:
        prune_finished(cfg, console)
    if cfg.submit.wait:
        from slurmkit.progress import follow_progress

        try:
            left_s = follow_progress(submitted.run_dir, submitted.job_id, submitted.executor, env, console,
                                     cfg.submit.timeout_s)
            code = wait_job(submitted, env, left_s)
        except KeyboardInterrupt:
            print_detached(err, submitted)
            return after_detach(err, submitted)
        (console if code == 0 else err).print(f"job {submitted.job_id} "
                                              f"{'completed' if code == 0 else 'did not complete'}")
        return code
    return 0


def prune_finished(cfg: SlurmkitConfig, console: Console) -> None:
    """submit.keep_finished_runs=N: this user's finished runs of this job.name beyond the newest
    N go (slurmkit.cli.clean's rules: ended for good, the user's own). Never fails a submission."""
    from slurmkit.cli.clean import finished_runs, prune_empty_parents, select

    root = os.path.join(cfg.submit.run_root, cfg.job.name)
    try:
        going = select(finished_runs(root, os.getuid()), older_than_s=0, keep=cfg.submit.keep_finished_runs,
                       now=time.time())
        for f in going:
            shutil.rmtree(f.path)
            prune_empty_parents(os.path.dirname(f.path), root)
    except OSError as exc:
        log.warning("submit.keep_finished_runs: %s", exc)
        return
    if going:
        console.print(f"  removed {len(going)} finished run(s) of {escape(cfg.job.name)} beyond the newest "
                      f"{cfg.submit.keep_finished_runs} (submit.keep_finished_runs)", highlight=False)


#: ``submit.wait=true`` interrupted (Ctrl-C): the command stopped waiting, the job runs on.
DETACHED_EXIT = 130


def print_detached(err: Console, s: Submitted) -> None:
    """Ctrl-C while waiting stops the waiting, not the job (a local job's agents run in a
    session of their own: slurmkit.launch.local), as submitit's and SkyPilot's users expect."""
    q = shlex.quote(s.run_dir)
    err.print(f"\n[bold yellow]detached[/]: job {s.job_id} keeps running (Ctrl-C stops only the waiting).",
              highlight=False)
    err.print(f"  watch it again : slurmkit status --watch {escape(q)}", highlight=False)
    err.print(f"  save and stop  : slurmkit cancel --checkpoint {escape(q)}", highlight=False)
    err.print(f"  stop now       : slurmkit cancel {escape(q)}", highlight=False)


#: After the first Ctrl-C, how long a second one is waited for (then the command exits).
SECOND_CTRL_C_S = 3.0


def after_detach(err: Console, s: Submitted, *, interactive: bool | None = None,
                 wait: Callable[[float], None] = time.sleep, ask: Callable[[str], str] = input,
                 cancel: Callable[[list[str]], int] | None = None) -> int:
    """At a terminal, a second Ctrl-C within SECOND_CTRL_C_S asks whether to cancel the job
    (with a final checkpoint, at once, or not at all); never without asking, never off a
    terminal (a script's SIGINT only detaches). Returns the command's exit code."""
    if interactive is None:
        interactive = sys.stdin.isatty() and sys.stderr.isatty()
    if not interactive:
        return DETACHED_EXIT
    err.print(f"(Ctrl-C again within {SECOND_CTRL_C_S:g} s to be asked whether to cancel the job)", highlight=False)
    try:
        wait(SECOND_CTRL_C_S)
        return DETACHED_EXIT
    except KeyboardInterrupt:
        pass
    try:
        answer = ask(f"cancel job {s.job_id}? [c]heckpoint first / [n]ow / anything else: keep it running: ")
    except (KeyboardInterrupt, EOFError):
        answer = ""
    how = {"c": ["--checkpoint"], "checkpoint": ["--checkpoint"], "n": [], "now": []}.get(answer.strip().lower())
    if how is None:
        err.print(f"job {s.job_id} keeps running", highlight=False)
        return DETACHED_EXIT
    if cancel is None:
        from slurmkit.cli.cancel import main as cancel_main

        def cancel(argv: list[str]) -> int:
            return cancel_main(argv)
    return cancel([s.run_dir, *how])


def main(argv: list[str] | None = None) -> int:
    console, err = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)
    try:
        return run(sys.argv[1:] if argv is None else argv, os.environ, console, err)
    except ConfigError as exc:
        print_error(err, exc, "configuration error")
        return 2
    except SlurmkitError as exc:
        print_error(err, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
