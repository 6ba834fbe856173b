"""Which names job.env / cluster.env may set.

Those variables are exported by the batch script after slurmkit's own (sbatch_templates/
setup.sh.j2) and given to every rank after the agent's (slurmkit/launch/agent.py), so a name
slurmkit sets itself would silently replace it: ``SLURMKIT_CONFIG_SHA256=''`` switched the
frozen config's digest check off, ``RANK`` or ``SLURM_NTASKS`` would tell the agent (and the
srun it starts) another world. Those names are refused. A few ``SLURMKIT_*`` knobs are meant to
be set per job (fault injection, the step delay of the tests, the node-local directory); they
are listed in :data:`USER_KNOBS` and stay allowed.

``LD_*`` (``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ...) and ``BASH_ENV`` change what every process
of the job loads or runs before its own code: legitimate on many sites (a library path, a
module system), so they are only named in a warning at submit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from slurmkit import contract
from slurmkit.errors import ConfigError

# A shell variable name: bash refuses anything else in `export NAME=...` (non-ASCII letters too).
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")

# SLURMKIT_* names a job may set for itself: read by the trainer or the agent as a user's
# setting, never set by slurmkit (grep of slurmkit/, tests/ and tools/).
USER_KNOBS = frozenset({
    "SLURMKIT_FAULT",  # slurmkit/train/faults.py: fault injection (tests, chaos, benchmarks)
    "SLURMKIT_STEP_DELAY_S",  # slurmkit/train/__main__.py: slow steps down (tests)
    "SLURMKIT_TEST_CLOCK_OFFSET_S",  # slurmkit/health/clock.py: the clock check's test hook
    "SLURMKIT_LOG_LEVEL",  # slurmkit/train/__main__.py
    "SLURMKIT_NODE_LOCAL_DIR",  # slurmkit/train/heartbeat.py: where node-local files go
    "SLURMKIT_S3_ENDPOINT",  # slurmkit/store/tier.py: the object tier's endpoint
    "SLURMKIT_RUN_ID",  # slurmkit/store/config.py: the run's identity when store.run_id is ""
})


def _rank_contract_names() -> frozenset[str]:
    """Every variable the agent gives a rank as its identity (slurmkit/contract.py), taken from
    the contract itself so that a name added there is reserved here too."""
    who = contract.RankIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1,
                                group_rank=0, master_addr="h", master_port=1)
    return frozenset({*who.full_env(), contract.SLURM_CPUS_PER_TASK, contract.DEVICE})


RANK_CONTRACT = _rank_contract_names()


def reserved(name: str) -> str | None:
    """Why ``name`` may not be set in job.env / cluster.env, or None."""
    if name in RANK_CONTRACT:
        return "a variable of the rank contract that the node agent sets (slurmkit/contract.py)"
    if name.startswith("SLURMKIT_") and name not in USER_KNOBS:
        return "a SLURMKIT_* variable that slurmkit sets or reads as its own"
    return None


def risky(name: str) -> str | None:
    """Why ``name`` deserves a warning (it changes what every process loads or runs), or None."""
    if name.startswith("LD_"):
        return "the dynamic loader reads it in every process of the job (a library loaded first)"
    if name == "BASH_ENV":
        return "every non-interactive shell of the job runs the file it names first"
    return None


def check_env_names(where: str, env: Mapping[str, str]) -> None:
    """Refuse a name in ``env`` (the config key ``where``: job.env or cluster.env) that is not a
    shell variable name or that slurmkit reserves."""
    for name in env:
        if not isinstance(name, str) or not ENV_NAME_RE.fullmatch(name):
            raise ConfigError(f"environment variable name {name!r} in {where}",
                              "ASCII letters, digits and '_', not starting with a digit (a shell "
                              "variable name: the batch script exports it)",
                              f"rename it in {where}")
        why = reserved(name)
        if why:
            knobs = ", ".join(sorted(USER_KNOBS))
            raise ConfigError(f"{where}.{name}: {why}",
                              f"{where} may not replace what slurmkit sets for the run: no "
                              f"SLURMKIT_* name but {knobs}; none of the rank contract's RANK, "
                              "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, SLURM_PROCID, "
                              "SLURM_NTASKS and the others of slurmkit/contract.py",
                              f"remove {name} from {where} (and from the command line: "
                              f"+{where}.{name}=...)")
