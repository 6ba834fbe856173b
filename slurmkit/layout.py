"""The resolved layout of a run: nodes, training nodes, spares, ranks and GPUs per node, world size.

Computed once, at submit, from the composed config and frozen into the run directory as
``layout.json`` beside ``config.yaml``. Every consumer reads this one answer: the renderer
(what Slurm is asked for), the planner (what must fit), the node agent (how many ranks it
starts, which GPU each uses) and the status and report tools. Before it existed, three places
computed ``ranks_per_node`` with three different rules (``job.gpus_per_node=0`` on an 8-GPU
cluster: the agent started 8 ranks, the batch script and the planner said 1).

``layout.json`` lives on the shared file system, so it is read as untrusted input: exact keys,
integer types, the sums checked, and a digest of the ``config.yaml`` it was frozen with, so a
layout that belongs to another config is refused rather than half-believed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

from slurmkit.atomic import atomic_write
from slurmkit.errors import ActionableError, ConfigError
from slurmkit.runfiles import CONFIG_NAME, LAYOUT_NAME
from slurmkit.untrusted import UntrustedDataError, parse_json, read_regular

log = logging.getLogger(__name__)

FROZEN_FILE_MODE = 0o644  # config.yaml and layout.json: the job's user alone writes them
LAYOUT_VERSION = 1
MAX_LAYOUT_BYTES = 64 * 1024  # a layout is a few hundred bytes; anything larger is not one
MAX_CONFIG_BYTES = 16 * 1024 * 1024  # a frozen config is a few KiB (slurmkit.runview reads as much)


class _Cluster(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def gpus_per_node(self) -> int: ...


class _Job(Protocol):
    @property
    def nodes(self) -> int: ...
    @property
    def ranks_per_node(self) -> int | None: ...
    @property
    def gpus_per_node(self) -> int | None: ...


class _Supervisor(Protocol):
    @property
    def spare_nodes(self) -> int: ...


class LayoutConfig(Protocol):
    """The parts of slurmkit.config.SlurmkitConfig a layout is resolved from."""

    @property
    def cluster(self) -> _Cluster: ...
    @property
    def job(self) -> _Job: ...
    @property
    def supervisor(self) -> _Supervisor: ...


class LayoutError(ActionableError):
    """``layout.json`` in a run directory is missing, damaged or belongs to another config."""


@dataclass(frozen=True)
class Layout:
    """Where a run's ranks are: the one answer every component uses."""

    nodes: int  # allocated, spares included (what Slurm is asked for)
    train_nodes: int  # nodes that run ranks
    spare_nodes: int  # nodes held back to replace a failed one
    ranks_per_node: int
    gpus_per_node: int  # GPUs requested per node; 0: CPU ranks
    config_sha256: str = ""  # of the config.yaml it was frozen with ("" before it is frozen)

    @property
    def world_size(self) -> int:
        return self.train_nodes * self.ranks_per_node

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    def to_dict(self) -> dict[str, Any]:
        return {"version": LAYOUT_VERSION, **asdict(self), "world_size": self.world_size}

    @classmethod
    def from_dict(cls, data: object, source: str) -> Layout:
        """Validate what was read from ``source``; raises LayoutError naming the first problem."""
        if not isinstance(data, dict):
            raise _damaged(source, f"a JSON {type(data).__name__}, not an object")
        names = {f.name for f in fields(cls)}
        expected = names | {"version", "world_size"}
        unknown, missing = sorted(set(data) - expected), sorted(expected - set(data))
        if unknown or missing:
            raise _damaged(source, f"unknown keys {unknown} / missing keys {missing}")
        if data["version"] != LAYOUT_VERSION:
            raise _damaged(source, f"version {data['version']!r} (this slurmkit reads {LAYOUT_VERSION})")
        for name in ("nodes", "train_nodes", "spare_nodes", "ranks_per_node", "gpus_per_node", "world_size"):
            value = data[name]
            if type(value) is not int or value < 0:  # bool is an int subclass: refuse it too
                raise _damaged(source, f"{name}={value!r}, not a non-negative integer")
        digest = data["config_sha256"]
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise _damaged(source, f"config_sha256={digest!r}, not a sha256 hex digest")
        layout = cls(**{n: data[n] for n in names})
        if layout.train_nodes < 1 or layout.ranks_per_node < 1:
            raise _damaged(source, f"train_nodes={layout.train_nodes}, ranks_per_node={layout.ranks_per_node} "
                                   "(at least 1 each)")
        if layout.nodes != layout.train_nodes + layout.spare_nodes:
            raise _damaged(source, f"nodes={layout.nodes} but train_nodes + spare_nodes = "
                                   f"{layout.train_nodes + layout.spare_nodes}")
        if data["world_size"] != layout.world_size:
            raise _damaged(source, f"world_size={data['world_size']} but train_nodes x ranks_per_node = "
                                   f"{layout.world_size}")
        return layout


def _damaged(source: str, what: str) -> LayoutError:
    return LayoutError(f"{source} holds {what}",
                       f"the {LAYOUT_NAME} that slurmkit submit wrote beside {CONFIG_NAME}",
                       "resubmit the run (python -m slurmkit.submit ...); do not edit the run directory's "
                       f"{LAYOUT_NAME} by hand")


def resolve_gpus_per_node(cfg: LayoutConfig) -> int:
    """``job.gpus_per_node`` when set (0 means CPU ranks), else all of the cluster's GPUs."""
    cluster_gpus = cfg.cluster.gpus_per_node
    gpus = cluster_gpus if cfg.job.gpus_per_node is None else cfg.job.gpus_per_node
    if cluster_gpus and gpus > cluster_gpus:
        raise ConfigError(
            f"job.gpus_per_node={gpus} on cluster '{cfg.cluster.name}' whose nodes have {cluster_gpus} GPUs",
            f"at most {cluster_gpus} GPUs per node",
            f"set job.gpus_per_node={cluster_gpus} and raise job.nodes instead")
    return gpus


def resolve_layout(cfg: LayoutConfig) -> Layout:
    """The layout ``cfg`` asks for, checked: ranks default to the GPUs the job gets (1 on CPU).

    The GPUs the *job* gets count, never the cluster's: with ``job.gpus_per_node=0`` the job
    runs one CPU rank per node even on an 8-GPU cluster, unless ``job.ranks_per_node`` says more.
    """
    gpus = resolve_gpus_per_node(cfg)
    ranks = cfg.job.ranks_per_node if cfg.job.ranks_per_node is not None else max(gpus, 1)
    if gpus and ranks > gpus and ranks % gpus:
        raise ConfigError(f"job.ranks_per_node={ranks} with {gpus} GPUs per node",
                          "ranks per node equal to, a divisor of, or a multiple of the GPUs",
                          f"set job.ranks_per_node={gpus}")
    spares = cfg.supervisor.spare_nodes
    return Layout(nodes=cfg.job.nodes + spares, train_nodes=cfg.job.nodes, spare_nodes=spares,
                  ranks_per_node=ranks, gpus_per_node=gpus)


def config_digest(config_text: bytes) -> str:
    return hashlib.sha256(config_text).hexdigest()


def write_layout(run_dir: str, layout: Layout) -> str:
    """Freeze ``layout`` beside the run's config.yaml (already written); atomic: temp, fsync, rename."""
    with open(os.path.join(run_dir, CONFIG_NAME), "rb") as f:
        frozen = Layout(**{**asdict(layout), "config_sha256": config_digest(f.read())})
    path = os.path.join(run_dir, LAYOUT_NAME)
    # 0644 whatever the umask: writable by the job's user only (slurmkit/rundir.py)
    atomic_write(path, json.dumps(frozen.to_dict(), indent=1, sort_keys=True) + "\n", mode=FROZEN_FILE_MODE)
    return path


def read_layout(run_dir: str) -> Layout:
    """The run's frozen layout, validated, and checked against the config.yaml beside it."""
    path = os.path.join(run_dir, LAYOUT_NAME)
    raw = _read_frozen(path, MAX_LAYOUT_BYTES)
    config_text = _read_frozen(os.path.join(run_dir, CONFIG_NAME), MAX_CONFIG_BYTES)
    try:  # within limits: a 5,000-digit number or deep nesting is refused, never a crash of the agent
        data = parse_json(raw, max_bytes=MAX_LAYOUT_BYTES)
    except UntrustedDataError as exc:
        raise _damaged(path, str(exc)) from None
    layout = Layout.from_dict(data, path)
    if layout.config_sha256 != config_digest(config_text):
        raise LayoutError(f"{path} was frozen with another {CONFIG_NAME} (sha256 {layout.config_sha256[:12]}... "
                          f"vs {config_digest(config_text)[:12]}... now)",
                          f"the layout and config that slurmkit submit froze together",
                          f"resubmit the run; never edit a run directory's {CONFIG_NAME} by hand")
    return layout


def _read_frozen(path: str, max_bytes: int) -> bytes:
    """The bytes of a frozen file of the run directory: a regular file, never a link followed or
    a FIFO waited on (the run directory is shared), at most ``max_bytes``; else LayoutError."""
    try:
        return read_regular(path, max_bytes)
    except UntrustedDataError as exc:
        detected = str(exc)
    except OSError as exc:  # ELOOP: a symbolic link where slurmkit submit wrote a file
        detected = f"{exc.filename or path} cannot be read ({exc.strerror or exc})"
    raise LayoutError(detected, f"the run directory's {CONFIG_NAME} and {LAYOUT_NAME}, regular files written "
                      "by slurmkit submit",
                      "check that the run directory is on a file system every node mounts, or resubmit the run")


def load_layout(run_dir: str, cfg: LayoutConfig) -> Layout:
    """What the node agent uses: the frozen layout, or for a run directory written before
    layouts were frozen (a requeued older job), the same resolution from its frozen config."""
    if not os.path.exists(os.path.join(run_dir, LAYOUT_NAME)):
        log.warning("%s has no %s (submitted by an older slurmkit): resolving it from %s",
                    run_dir, LAYOUT_NAME, CONFIG_NAME)
        return resolve_layout(cfg)
    return read_layout(run_dir)
