"""Schema of the checkpoint store config (conf/store/). Owned by the store package.

Credentials never live here: the object tier reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
and SLURMKIT_S3_ENDPOINT (or AWS_ENDPOINT_URL) from the environment mapping handed to the
store, or uses the named AWS profile.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from slurmkit.choices import check_choices
from slurmkit.errors import ConfigError

BUSY_POLICIES = ("wait", "skip")  # store.busy_policy
CHECKSUMS = ("sha256", "crc32")  # store.checksum
RUN_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
RUN_ID_VAR = "SLURMKIT_RUN_ID"


@dataclass
class StoreConfig:
    """The checkpoint tiers, their promotion and retention; the defaults live here, the tier
    URIs in conf/store/ (a StoreConfig without a tier is refused)."""

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"busy_policy": BUSY_POLICIES, "checksum": CHECKSUMS}

    # fsspec URIs; "" disables a tier. Environment variables ($SLURMKIT_RUN_ID, $USER) expand.
    # nvme_uri gets one sub-directory per node (the node name) appended. Key checkpoints by
    # $SLURMKIT_RUN_ID (the run), not $SLURM_JOB_ID: a resubmitted run gets a new job id.
    nvme_uri: str = ""
    lustre_uri: str = ""
    object_uri: str = ""
    # Promotion policy, counted in completed saves of this process (1 = every save, 0 = never).
    lustre_every_saves: int = 1
    object_every_saves: int = 0
    # Also promote to the object tier when this many minutes passed since the last one (0 = off).
    object_every_min: float = 0.0
    # Retention: number of newest verified steps kept on each tier (at least 1).
    keep_nvme: int = 2
    keep_lustre: int = 3
    keep_object: int = 5
    # Buddy copies: every node's checkpoint files also on this many other nodes' NVMe
    # (ring order, sent over gloo, never through the shared file system), so a save that
    # only reached NVMe survives losing that many nodes. Capped at nodes - 1 (0 on one node).
    replicas: int = 1
    # What save() does while the previous save of this rank is still writing: wait or skip.
    busy_policy: str = "wait"
    # Start writing while save() still copies the state into the staging buffers: the
    # checkpoint is durable sooner (by up to the copy time), but the writer's hashing competes
    # with the training thread for CPU, so save() blocks longer on a busy or small machine.
    # Worth it where cores are spare (a GPU node); off by default.
    overlap_snapshot: bool = False
    # Write checkpoint files to local tiers with O_DIRECT (bypassing the page cache), where
    # the filesystem supports it; false: through the page cache.
    direct_io: bool = True
    # Files one rank copies at the same time during a promotion (bounded concurrency).
    max_concurrent_copies: int = 4
    # DCP writer threads per rank = files per rank per checkpoint (more files copy in parallel;
    # each thread hashes its file while writing it, so this is also the hashing parallelism).
    write_threads: int = 2
    # Promotions of rank r start (r % stagger_slots) * stagger_s seconds late (0 = no stagger).
    stagger_s: float = 0.0
    stagger_slots: int = 8
    # Retries of one promotion (tenacity, exponential backoff from retry_initial_s to retry_max_s).
    retry_attempts: int = 5
    retry_initial_s: float = 1.0
    retry_max_s: float = 60.0
    # After a failed promotion round, the pending queue is retried this often (seconds).
    retry_pending_s: float = 60.0
    # Rank 0 waits this long for other ranks' files before committing a promotion (seconds).
    commit_timeout_s: float = 600.0
    # Checksum of every file in the manifest, computed while writing and verified before a
    # restore reads anything: crc32 (zlib, ~5 GiB/s per core here; catches bit flips, torn and
    # truncated files, like the CRC32 S3 and torch's zip records use) or sha256 (~1.8 GiB/s,
    # a content digest when the checksum must identify the bytes). Neither is a defence
    # against deliberate tampering: whoever can rewrite a shard can rewrite the manifest.
    checksum: str = "crc32"
    # The run's identity, $SLURMKIT_RUN_ID in the URIs above. "" = derived from the run
    # directory ($SLURMKIT_RUN_DIR: its name plus a hash of its path), which a requeue and a
    # resubmission (``sbatch RUN_DIR/job.sbatch``, a new job id) keep; set it to resume the
    # checkpoints of another run directory. Letters, digits, '.', '_', '-' only.
    run_id: str = ""
    # Seconds one rank waits for the others in one coordination step of a save or restore
    # (the ranks' records reaching rank 0, its answer reaching them); then that save fails.
    coord_timeout_s: float = 1800.0
    # AWS profile for the object tier ("" = credentials from the environment mapping).
    s3_profile: str = ""
    # Local directory used when no tier is a local path ("" = the system temp directory).
    scratch_dir: str = ""
    # A third-party program's own DCP saves (torchtitan's checkpoint/step-N, or job.checkpoint_glob
    # pointing at a .metadata) taken into this store by the node agents: each finished save is
    # copied to the shared tier (every save) and the object tier (object_every_saves,
    # object_every_min), verified there, kept by keep_lustre/keep_object, and put back where
    # the program looks for it when its own copy is missing or damaged at a restart
    # (slurmkit.store.adopt). The program's ranks are not touched; the reference trainer
    # saves through the store itself and ignores it.
    adopt: bool = False

    def __post_init__(self) -> None:
        if not (self.nvme_uri or self.lustre_uri or self.object_uri):
            raise ConfigError(
                detected="store with no tier (nvme_uri, lustre_uri and object_uri all empty)",
                requirement="at least one checkpoint tier",
                fix="set store.nvme_uri, store.lustre_uri or store.object_uri "
                    "(or use store=default)",
            )
        check_choices("store", self, self.CHOICES)
        for name in ("keep_nvme", "keep_lustre", "keep_object", "max_concurrent_copies",
                     "write_threads", "retry_attempts", "stagger_slots"):
            if getattr(self, name) < 1:
                raise ConfigError(detected=f"store.{name}={getattr(self, name)}",
                                  requirement=f"store.{name} >= 1", fix=f"set store.{name}=1")
        for name in ("lustre_every_saves", "object_every_saves", "replicas"):
            if getattr(self, name) < 0:
                raise ConfigError(detected=f"store.{name}={getattr(self, name)}",
                                  requirement=f"store.{name} >= 0 (0 = never)",
                                  fix=f"set store.{name}=0")
        if self.run_id and not RUN_ID_RE.fullmatch(self.run_id):
            raise ConfigError(
                detected=f"store.run_id={self.run_id!r}",
                requirement="1-128 characters of letters, digits, '.', '_', '-', not "
                            "starting with '.' (it becomes a directory name)",
                fix="set store.run_id=my-run-1 (or leave it empty to use the run directory)",
            )
        if not self.coord_timeout_s > 0:
            raise ConfigError(detected=f"store.coord_timeout_s={self.coord_timeout_s}",
                              requirement="store.coord_timeout_s > 0",
                              fix="set store.coord_timeout_s=1800")
        for secret_marker in ("@", "aws_secret", "access_key"):
            if secret_marker in self.object_uri.lower():
                raise ConfigError(
                    detected="credentials inside store.object_uri",
                    requirement="S3 credentials come from the environment or a profile",
                    fix="export AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or set store.s3_profile",
                )


def run_identity(cfg: StoreConfig, env: Mapping[str, str]) -> str | None:
    """The name of this run's checkpoints: ``store.run_id``, else one derived from the run
    directory (stable across requeues and resubmissions, unlike the job id), else None.

    Derived: the directory's name (sanitized) and 8 hex digits of its absolute path, so two
    runs whose directories share a name (two sweeps' variant 0) never share checkpoints. No
    file system access: every rank computes the same name from the same path."""
    if cfg.run_id:
        return cfg.run_id
    run_dir = env.get("SLURMKIT_RUN_DIR")
    if not run_dir:
        return None
    path = os.path.normpath(os.path.abspath(run_dir))
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(path)).lstrip(".")[:100] or "run"
    return f"{name}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def store_env(cfg: StoreConfig, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` plus $SLURMKIT_RUN_ID for the tier URIs: ``store.run_id``, else an exported
    SLURMKIT_RUN_ID (checked like store.run_id: it becomes a directory name), else the one
    derived from the run directory."""
    out = dict(env)
    given = cfg.run_id or env.get(RUN_ID_VAR, "")
    if given and not RUN_ID_RE.fullmatch(given):
        raise ConfigError(
            detected=f"{RUN_ID_VAR}={given!r}"[:200],
            requirement="1-128 characters of letters, digits, '.', '_', '-', not starting "
                        "with '.' (it becomes a directory name)",
            fix=f"unset {RUN_ID_VAR} (the run directory names the run) or set a plain name",
        )
    rid = given or run_identity(cfg, env)
    if rid:
        out[RUN_ID_VAR] = rid
    return out
