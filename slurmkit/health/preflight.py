"""The pre-flight of one node of a run: which checks, the verdict, the ledger record, and the
evidence the supervisor acts on.

The node agent (slurmkit.launch.agent) runs it before each generation's ranks start. Every
attempt is one ``preflight`` ledger event with each check's verdict, figures and message. A
``bad_node`` verdict becomes one agent Evidence of class ``preflight`` (rank -1): the agent
starts no ranks, the generation fails through the usual path, and node 0's policy marks the
node bad at once (slurmkit.failures.classes: ``bad_node``), so a spare takes its place or the
job is requeued without it before any training step. Only what a check found does that (no
space, a failed write, an Xid line, a GPU missing, a site command's non-zero exit, a clock
beyond the bound, a best link far below the train nodes' median). A ``wait`` verdict (a shared
tier that does not answer, or any check that missed its deadline: a loaded node is slow, not
bad) is re-checked, each time with twice the deadline (not the link test: alone, a node would
find no peers), for
``health.wait_max_s``; then the ranks start anyway, the verdict in the ledger: the store copes
with a shared tier that is down, and the ranks' own failures catch a device that really hangs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from slurmkit.config.health import HealthConfig
from slurmkit.errors import ConfigError
from slurmkit.health.clock import ClockCheck, injected_offset_s
from slurmkit.health.extra import check_name, run_site_command
from slurmkit.health.gpus import check_gpus
from slurmkit.health.kernel_log import KernelLogCheck, open_source
from slurmkit.health.links import LinkCheck, Round
from slurmkit.health.result import CheckResult, Verdict, overall, skipped
from slurmkit.health.runner import Check, Timeout, run_checks
from slurmkit.health.storage import MIB, GIB, check_nvme, check_remote, check_shared_path

log = logging.getLogger(__name__)

# Missing a deadline is not evidence against a node (a loaded node misses them too): every
# timeout is "wait", re-checked with a longer deadline. Only what a check found fails a node.
_NODE_TIMEOUT = Timeout(Verdict.WAIT, "the check answers within health.timeout_s (re-checked with a longer "
                        "deadline: a slow node is not a bad one)",
                        "if it never answers, look at the node (a hung GPU or disk), or raise health.timeout_s")
_SHARED_TIMEOUT = Timeout(Verdict.WAIT, "the shared tiers answer within health.shared_timeout_s",
                          "wait for the shared file system or object store (this node is not the cause)")
_MAX_SCALE = 8.0  # re-checks double a deadline up to this many times the configured one


class Ledger(Protocol):
    def append(self, event: str, **fields: Any) -> Any: ...


@dataclass(frozen=True)
class Peers:
    """How this node's checks among nodes (clock, links) reach the others: ``connect`` gives the
    agents' channel over a new store connection (each such check makes its own)."""

    connect: Callable[[], Any]
    node_rank: int
    num_nodes: int
    train_nodes: int
    round: Round = field(default_factory=Round)


def _fixed(result: CheckResult) -> Callable[[float], CheckResult]:
    return lambda _deadline_s: result


def build_checks(health: HealthConfig, store: Any, *, gpus_planned: int, node: str,
                 env: Mapping[str, str], peers: Peers | None = None) -> list[Check]:
    """The checks of ``node`` for a run with store config ``store`` (a StoreConfig) and
    ``gpus_planned`` GPUs per node. ``env`` expands the tier URIs and the kernel log path
    ($SLURMKIT_RUN_DIR, $SLURMKIT_NODE, ...). ``peers``: the checks among nodes too (the agent)."""
    from slurmkit.store.config import store_env
    from slurmkit.store.tier import expand_env, make_tier

    env = {**env, "SLURMKIT_NODE": node}
    t = health.timeout_s
    checks = []
    if health.gpus:
        checks.append(Check("gpus", functools.partial(check_gpus, gpus_planned, health.nvidia_smi, env), t,
                            _NODE_TIMEOUT))
    if health.kernel_log:
        klog: Callable[[float], CheckResult]
        try:
            reader = KernelLogCheck(open_source(expand_env(health.kernel_log, env)), health.bad_xids,
                                    health.kernel_log_lookback_s)
            klog = lambda _deadline_s: reader()  # noqa: E731 - it reads without blocking
        except ConfigError as exc:
            klog = _fixed(skipped("kernel_log", exc.detected))
        checks.append(Check("kernel_log", klog, t, _NODE_TIMEOUT))
    try:
        senv = store_env(store, env)
        nvme = make_tier("nvme", f"{store.nvme_uri.rstrip('/')}/{node}", senv) if store.nvme_uri else None
        shared = [make_tier(n, u, senv, store.s3_profile if n == "object" else "")
                  for n, u in (("lustre", store.lustre_uri), ("object", store.object_uri)) if u]
    except ConfigError as exc:
        checks.append(Check("tiers", _fixed(skipped("tiers", f"checkpoint tiers not checked: {exc.detected}")),
                            t, _NODE_TIMEOUT))
        nvme, shared = None, []
    nvme_path = nvme.local_path("") if nvme is not None else None
    if nvme_path is not None:
        checks.append(Check("nvme", lambda _deadline_s: check_nvme(
            nvme_path, min_free_bytes=int(health.nvme_min_free_gb * GIB),
            probe_bytes=int(health.nvme_probe_mb * MIB), min_write_mb_s=health.nvme_min_write_mb_s), t,
            _NODE_TIMEOUT))
    for tier in shared:
        path = tier.local_path("")
        name = f"shared:{tier.name}"
        def run(_deadline_s: float, name: str = name, path: str | None = path, tier: Any = tier) -> CheckResult:
            return check_shared_path(name, path) if path is not None else check_remote(name, tier)
        checks.append(Check(name, run, health.shared_timeout_s, _SHARED_TIMEOUT))
    if peers is not None:
        checks += network_checks(health, peers, node, env)
    for argv in health.extra_commands:
        def site(deadline_s: float, argv: list[str] = argv) -> CheckResult:
            return run_site_command(argv, env, deadline_s, health.output_max_bytes)
        checks.append(Check(check_name(argv), site, t, _NODE_TIMEOUT))
    return checks


def network_checks(health: HealthConfig, peers: Peers, node: str, env: Mapping[str, str]) -> list[Check]:
    """The clock offset to node 0 and the link test, each on its own store connection."""
    checks = []
    if health.max_clock_offset_s > 0:
        shift = injected_offset_s(env, node)  # a test hook (docs/health.md "Pre-flight"); 0 otherwise
        clock = ClockCheck(peers.connect, node_rank=peers.node_rank, num_nodes=peers.num_nodes,
                           max_offset_s=health.max_clock_offset_s, now=lambda: time.time() + shift)
        checks.append(Check("clock", clock, health.timeout_s, _NODE_TIMEOUT))
    if health.links:
        links = LinkCheck(peers.connect, peers.round, node=node, train_nodes=peers.train_nodes,
                          probe_bytes=int(health.link_probe_mb * MIB), min_ratio=health.min_link_ratio,
                          backend=health.link_backend)
        checks.append(Check("links", links, health.link_timeout_s, _NODE_TIMEOUT, rerun=False))
    return checks


class Preflight:
    """One node's pre-flight, kept by its agent across generations (the kernel log's cursor
    lives in its check)."""

    def __init__(self, checks: list[Check], node: str, ledger: Ledger, *, wait_max_s: float,
                 wait_retry_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, round: Round | None = None) -> None:
        self.checks, self.node, self.ledger = checks, node, ledger
        self.round = round or Round()  # shared with the checks among nodes
        self.wait_max_s, self.wait_retry_s = wait_max_s, wait_retry_s
        self.clock, self.sleep = clock, sleep
        self.last: list[CheckResult] = []

    def _record(self, gen: int, results: list[CheckResult], verdict: Verdict, took_s: float, waited_s: float) -> None:
        self.ledger.append("preflight", generation=gen, node=self.node, verdict=verdict.value,
                           duration_s=round(took_s, 4), waited_s=round(waited_s, 3),
                           checks=[r.to_json() for r in results])
        for r in results:
            if r.verdict in (Verdict.BAD_NODE, Verdict.WAIT):
                log.warning("pre-flight %s on %s: %s: %s", r.name, self.node, r.verdict.value, r.message)

    def kernel_log_now(self) -> CheckResult | None:
        """The kernel-log check once more, while the ranks run: only what was logged since its
        last read (its cursor), without blocking. None when the node has no such check."""
        for c in self.checks:
            if c.name == "kernel_log":
                return c.run(c.timeout_s)
        return None

    def run(self, gen: int, slot: int | None = None) -> Any:
        """Run the checks (re-checking ``wait`` ones) for generation ``gen`` on train slot
        ``slot``; the Evidence of a bad node, or None when the ranks may start."""
        from slurmkit.failures.classes import FailureClass
        from slurmkit.failures.classify import Evidence

        self.round.generation, self.round.slot = gen, slot
        t0 = self.clock()
        checks = self.checks
        results: dict[str, CheckResult] = {}
        scale = 1.0
        while True:
            t = self.clock()
            for r in run_checks(checks, scale=scale, clock=self.clock):
                results[r.name] = r
            got = [results[c.name] for c in self.checks]
            verdict = overall(got)
            self.last = got
            self._record(gen, got, verdict, self.clock() - t, t - t0)
            if verdict == Verdict.BAD_NODE:
                worst = [r for r in got if r.verdict == Verdict.BAD_NODE]
                detail = "; ".join(f"pre-flight {r.name}: {r.message}" for r in worst)
                return Evidence(time.time(), self.node, -1, "agent", FailureClass.PREFLIGHT, detail)
            again = [c for c in self.checks if results[c.name].verdict == Verdict.WAIT and c.rerun]
            if verdict != Verdict.WAIT or not again:
                return None
            if self.clock() - t0 >= self.wait_max_s:
                log.warning("pre-flight on %s: still waiting after %.0f s; starting the ranks anyway",
                            self.node, self.clock() - t0)
                return None
            self.sleep(self.wait_retry_s)
            checks = again
            scale = min(2 * scale, _MAX_SCALE)


def node_preflight(cfg: Any, layout: Any, run_dir: str, node: str, env: Mapping[str, str],
                   ledger: Ledger, peers: Peers | None = None) -> Preflight | None:
    """The agent's pre-flight for ``node`` of the run in ``run_dir`` (None: health.enabled=false)."""
    health: HealthConfig = cfg.health
    if not health.enabled:
        return None
    checks = build_checks(health, cfg.store, gpus_planned=layout.gpus_per_node, node=node,
                          env={**env, "SLURMKIT_RUN_DIR": run_dir}, peers=peers)
    return Preflight(checks, node, ledger, wait_max_s=health.wait_max_s, wait_retry_s=health.wait_retry_s,
                     round=peers.round if peers is not None else None)
