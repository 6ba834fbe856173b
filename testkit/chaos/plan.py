"""Seed -> plan: which faults a campaign run gets, where, and on whom. Pure and reproducible.

The plan depends on nothing but its arguments (``random.Random(seed)``, no clock, no cluster
state), so ``tools/chaos --seed N`` with the same steps and interval replays exactly the run
that failed. Constraints keep a plan meaningful rather than merely random:

- every ``after_save`` fault needs one fresh checkpoint (``saves``) since the previous recovery,
  and the run has ``steps // interval - 1`` of them to hand out; a plan never asks for more;
- a ``during_restart`` fault only follows a fault that restarts ranks, and never two in a row
  (three failures without checkpoint progress are the policy's crash loop: a stop with 93
  that the menu did not ask for);
- faults that may exclude a node (node loss, a killed agent, a full NVMe tier, and a second
  NCCL abort or hang on the same train slot: the policy's repeat rule) are capped so that the
  job still fits on the 4 emulated nodes after its exclusions: 2 without a spare, 1 with one;
  a repeat that would pass the cap goes to a slot without a suspect fault yet (and is not
  drawn once every slot had one);
- a kill inside a save needs one checkpoint more than its ``saves``: the save it hits; so do a
  full NVMe tier and an S3 outage (the save that meets them; the next fault counts from where
  the run was once that save was over) and a time-limit warning after a save (its stop
  checkpoint is the next save's step: warned at step 7, checkpointed and resumed at 8).
"""

from __future__ import annotations

import json
import random
import shlex
from dataclasses import asdict, dataclass, field

from testkit.chaos.menu import AFTER_SAVE, DURING_RESTART, item, pairs

CLUSTER_NODES = 4  # tools/local-cluster's default: the cap on exclusions follows from it
NODE_BUDGET_KINDS = ("node_loss", "agent_sigkill", "nvme_full")  # may cost the job a node
# Faults whose failure class makes the node suspect (slurmkit.failures.classes: nccl_error,
# hang): a second one on the same node excludes it (the policy's repeat rule), which costs the
# node budget too (seen in the 50-seed campaign, seed 50: two NCCL aborts on node 0's ranks,
# then two node losses, left one node for a 2-node job: a stop with 93 no item asked for).
SUSPECT_KINDS = ("nccl_abort", "rank_sigstop")
IN_SAVE = "rank_sigkill_during_save"  # aimed at the save after its ``saves``: one more checkpoint
# after_save faults that use one checkpoint more: the save they hit (inside a save, a full disk,
# a promotion meeting an S3 outage), their own stop checkpoint (a time-limit warning), or the
# save the ranks of a node whose agent died still make before that is noticed (6 s here)
TAKES_A_SAVE = (IN_SAVE, "time_limit_warning", "nvme_full", "s3_down_during_promotion", "agent_sigkill")


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    moment: str
    saves: int = 0  # after_save: checkpoints since the previous recovery (>= 1)
    offset: int = 0  # after_save: steps past that checkpoint (1 .. interval-1)
    target: int = 0  # a rank (rank faults) or a train slot (node faults)
    second: int = -1  # two_at_once: the second rank, on another node

    def describe(self) -> str:
        where = (f"{self.saves} save(s) +{self.offset} steps" if self.moment == AFTER_SAVE
                 else "during the restart of the previous fault")
        if self.kind == IN_SAVE:
            where = f"inside the save after {self.saves} save(s)"
        who = {"rank": f"rank {self.target}", "node": f"train slot {self.target}", "job": "the job"}[
            item(self.kind).target]
        if self.second >= 0:
            who += f" and rank {self.second}"
        return f"{self.kind} on {who}, {where}"


@dataclass(frozen=True)
class RunPlan:
    seed: int
    steps: int
    interval: int
    spare_nodes: int
    faults: tuple[PlannedFault, ...]
    nodes: int = 2
    ranks_per_node: int = 2
    extra: tuple[str, ...] = field(default=())  # overrides passed through to every run

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunPlan":
        raw = json.loads(text)
        raw["faults"] = tuple(PlannedFault(**f) for f in raw["faults"])
        raw["extra"] = tuple(raw.get("extra", ()))
        return cls(**raw)


def draw_plan(seed: int, *, steps: int = 32, interval: int = 4, min_faults: int = 3,
              max_faults: int = 6, extra: tuple[str, ...] = (), nodes: int = 2,
              ranks_per_node: int = 2) -> RunPlan:
    """The plan of seed ``seed`` (see the module doc for the constraints)."""
    if not 1 <= min_faults <= max_faults:
        raise ValueError(f"need 1 <= min_faults <= max_faults, got {min_faults}, {max_faults}")
    if interval < 2 or steps // interval - 1 < max_faults:
        raise ValueError(f"steps={steps} with interval={interval} gives {steps // interval - 1} "
                         f"checkpoints to place faults after; {max_faults} faults need as many "
                         f"(raise steps to {interval * (max_faults + 1)} or more)")
    rng = random.Random(seed)
    n = rng.randint(min_faults, max_faults)
    spare = 1 if rng.random() < 0.25 else 0
    node_budget = 1 if spare else 2
    save_budget = steps // interval - 1
    world = nodes * ranks_per_node
    faults: list[PlannedFault] = []
    suspect_slots: set[int] = set()  # train slots that had an NCCL abort or a hang
    for i in range(n):
        prev = faults[-1] if faults else None
        options = []
        for kind, moment in pairs():
            m = item(kind)
            if moment == DURING_RESTART and (prev is None or prev.moment == DURING_RESTART
                                             or not item(prev.kind).restarts):
                continue
            if moment == AFTER_SAVE and save_budget < 1:
                continue
            if moment == AFTER_SAVE and kind in TAKES_A_SAVE and save_budget - 2 < n - i - 1:
                continue  # its own checkpoint and the one it takes, and one for each later fault
            if kind in NODE_BUDGET_KINDS and node_budget < 1:
                continue
            if kind in SUSPECT_KINDS and node_budget < 1 and len(suspect_slots) >= nodes:
                continue  # every slot had one: another would be a repeat the budget cannot pay
            options.append((kind, moment, m))
        if not options:
            break
        kind, moment, m = options[rng.randrange(len(options))]
        saves = offset = 0
        if moment == AFTER_SAVE:
            left_after = n - i - 1
            hit = 1 if kind in TAKES_A_SAVE else 0
            saves = 2 if save_budget - 2 - hit >= left_after and rng.random() < 0.3 else 1
            save_budget -= saves + hit
            offset = rng.randint(1, interval - 1)
        target, second = 0, -1
        if m.target == "rank":
            target = rng.randrange(world)
            if kind == "two_at_once":
                others = [r for r in range(world) if r // ranks_per_node != target // ranks_per_node]
                second = others[rng.randrange(len(others))]
        elif m.target == "node":
            target = rng.randrange(nodes)
        if kind in NODE_BUDGET_KINDS:
            node_budget -= 1
        if kind in SUSPECT_KINDS:
            slot = target // ranks_per_node
            if slot in suspect_slots and node_budget < 1:  # moved, not redrawn: no rng consumed
                target = next(r for r in range(world) if r // ranks_per_node not in suspect_slots)
                slot = target // ranks_per_node
            if slot in suspect_slots:
                node_budget -= 1
            suspect_slots.add(slot)
        faults.append(PlannedFault(kind, moment, saves, offset, target, second))
    return RunPlan(seed, steps, interval, spare, tuple(faults), nodes, ranks_per_node, tuple(extra))


def armed_spec(plan: RunPlan) -> str:
    """``SLURMKIT_FAULT`` for the plan's trainer-side faults: one ``once`` item per step on each
    rank that gets an NCCL abort. The driver writes every marker before training starts (all
    disarmed) and removes one to arm the fault at the step it picks at run time."""
    ranks = sorted({f.target for f in plan.faults if f.kind == "nccl_abort"})
    return ";".join(f"nccl_abort:{r}:{s}:once" for r in ranks for s in range(1, plan.steps + 1))


def marker_name(rank: int, step: int) -> str:
    """The trainer's once-marker for the NCCL abort (slurmkit.train.faults.Fault.marker_name)."""
    from slurmkit.train.faults import Fault

    return Fault("nccl_abort", rank, step, once=True).marker_name


def replay_command(plan: RunPlan, *, min_faults: int = 3, max_faults: int = 6) -> str:
    """The exact command that replays this plan's run."""
    argv = ["tools/chaos", "--seed", str(plan.seed), "--steps", str(plan.steps),
            "--interval", str(plan.interval)]
    if (min_faults, max_faults) != (3, 6):
        argv += ["--min-faults", str(min_faults), "--max-faults", str(max_faults)]
    for o in plan.extra:
        argv += ["--override", o]
    return shlex.join(argv)
