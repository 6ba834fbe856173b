"""The agent's side of ``store.adopt``: a program's own DCP saves taken into the tiered store.

slurmkit.store.adopt does the copies, the commits and the put-back; this module runs them
for one node's agent, off the agent's poll loop (a thread, on its own connection to the
agents' store), and says what happened in the ledger:

* the folder scan of rank 0's agent (slurmkit.launch.programwatch) hands every save the
  program finished to :meth:`Adopter.saved`; its thread names the newest one in an adopt
  notice on the agents' store (``Channel.post_adopt``: a save id, the tiers it goes to);
* every agent's thread reads the notice (one get a second; every nodes/500 s from 500 nodes
  on, so that node 0's store answers at most 500 a second) and copies its ranks' files to
  those tiers; rank 0's agent then commits each tier once every training slot acknowledged
  (``ckpt_adopted``; ``ckpt_failed`` with ``by: adopt`` when one could not), and applies the
  tiers' retention;
* before a generation's ranks start, :meth:`Adopter.put_back` makes this node's part of the
  newest adopted save whole where the program looks for it (``ckpt_put_back`` when it fetched
  anything).

A spare that takes a lost node's slot finds the notice still posted and copies that slot's
files itself (they are in the program's folder, which every node reads).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from slurmkit import adapters
from slurmkit.adapters.command import TORCHTITAN
from slurmkit.runtoken import ChannelError
from slurmkit.store import adopt
from slurmkit.store.config import StoreConfig, store_env
from slurmkit.store.manifest import METADATA, hash_file
from slurmkit.store.tier import Tier, TierError, make_tier

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often an agent reads the adopt notice, at most
NOTICE_READS_PER_S = 500.0  # the job's agents together read it at most this often (node 0's store)
Append = Callable[..., Any]


def step_namer(adapter: str, glob: str | None) -> Callable[[int], str] | None:
    """The directory of step N in the program's folder, relative to it; None where the
    program's saves are not DCP directories slurmkit knows how to name."""
    if glob:
        pattern = glob[: -len("/" + METADATA)] if glob.endswith("/" + METADATA) else glob
        if "*" in pattern or "?" in pattern or "{step}" not in pattern:
            return None
        return lambda step: pattern.replace("{step}", str(step))
    if adapter == TORCHTITAN:
        return lambda step: f"step-{step}"
    return None


class Adopter:
    """One agent's adoption of the program's saves (see the module)."""

    def __init__(self, cfg: StoreConfig, env: Mapping[str, str], *, node: str, node_rank: int, nodes: int,
                 ranks_per_node: int, train_nodes: int, adapter: str, folder: str,
                 step_name: Callable[[int], str], glob: str | None, connect: Callable[[], Any],
                 append: Append, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.node, self.node_rank = cfg, node, node_rank
        self.poll_s = max(POLL_S, nodes / NOTICE_READS_PER_S)
        self.ranks_per_node, self.train_nodes = ranks_per_node, train_nodes
        self.adapter, self.folder, self.step_name, self.glob = adapter, folder, step_name, glob
        self._connect, self._append, self._clock = connect, append, clock
        tier_env = store_env(cfg, env)
        self.tiers: dict[str, Tier] = {}
        if cfg.lustre_uri:
            self.tiers["lustre"] = make_tier("lustre", cfg.lustre_uri, tier_env)
        if cfg.object_uri:
            self.tiers["object"] = make_tier("object", cfg.object_uri, tier_env, cfg.s3_profile)
        self.slot: int | None = None  # this node's training slot (None: a spare)
        self.verified: adopt.Verified = {}
        self._lock = threading.Lock()
        self._saved: tuple[int, str] | None = None  # node 0: the newest finished save not yet posted
        self._posted = 0  # node 0: saves posted by this process
        self._last_posted = -1  # node 0: the newest step posted (a step is posted once)
        self._ended: set[int] = set()  # rank 0's agent: steps whose every tier was committed or given up
        self._object_at: float | None = None  # node 0: when a save last went to the object tier
        self._done: set[tuple[int, str, int]] = set()  # (step, save id, slot) taken up here
        self._offered: set[tuple[int, int]] = set()  # (step, slot) whose every copy ended, well or not
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the agent's calls
    def start(self) -> Adopter:
        self._thread = threading.Thread(target=self._run, name="slurmkit-adopt", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def saved(self, step: int, path: str) -> None:
        """Node 0: the program finished the save of ``step`` at ``path`` (its folder scan)."""
        with self._lock:
            if self._saved is None or step >= self._saved[0]:
                self._saved = (step, path)

    def ranks(self, slot: int) -> set[int]:
        return {slot * self.ranks_per_node + lr for lr in range(self.ranks_per_node)}

    def program_newest(self) -> int | None:
        """The newest save the program finished in its folder (one bounded listing)."""
        try:
            found = adapters.complete_checkpoints(self.adapter, self.folder, self.glob)
        except Exception as exc:  # noqa: BLE001 - a reader's bug must never stop a start
            log.warning("cannot list the program's checkpoints in %s: %r", self.folder, exc)
            return None
        return max((s for s, _ in found), default=None)

    def put_back(self, gen: int, slot: int) -> adopt.PutBack | None:
        """Before generation ``gen``'s ranks start at ``slot``: this node's part of the newest
        adopted save, made whole in the program's folder; the ledger says what was fetched."""
        self.slot = slot
        t0 = self._clock()
        try:
            got = adopt.put_back(list(self.tiers.values()), self.folder, self.step_name, self.program_newest(),
                                 self.ranks(slot), metadata=slot == 0, verified=self.verified)
        except Exception as exc:  # noqa: BLE001 - the put-back never stops a generation's start
            log.warning("generation %d: the adopted save could not be put back: %r", gen, exc)
            self._append("ckpt_failed", tier="user", by="adopt", generation=gen, node=self.node,
                         error=str(exc)[:500], pending=False, put_back=True)
            return None
        if got.fetched:
            log.warning("generation %d: step %s put back from the %s tier: %s (damaged: %s)", gen, got.step,
                        got.tier, ", ".join(got.fetched), ", ".join(got.damaged) or "none")
            self._append("ckpt_put_back", step=got.step, generation=gen, node=self.node, slot=slot,
                         files=got.fetched, damaged=got.damaged, tier=got.tier, bytes=got.bytes,
                         seconds=round(self._clock() - t0, 3))
        return got

    def finish(self, timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> bool:
        """The program completed: its last save adopted before the agent leaves (node-local
        disks and a scratch folder may not outlive the job), waiting at most ``timeout_s``.
        Rank 0's agent names the save if its folder scan had not yet; every agent copies its
        part; rank 0's commits. True when this agent's part is done."""
        slot, last = self.slot, self.program_newest()
        if slot is None or last is None:
            return True
        if slot == 0:
            self.saved(last, os.path.join(self.folder, self.step_name(last)))
        deadline = self._clock() + timeout_s
        while self._clock() < deadline:
            if (last in self._ended) if slot == 0 else any(s >= last and k == slot for s, k in set(self._offered)):
                return True
            sleep(0.2)
        log.warning("the program's last save (step %d) was not adopted within %.0f s", last, timeout_s)
        return False

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        channel = None
        while not self._stop.wait(self.poll_s):
            try:
                if channel is None:
                    channel = self._connect()
                self._post(channel)  # (the agent of slot 0: it holds rank 0, whose folder scan saw the save)
                self._follow(channel)
            except ChannelError as exc:
                log.error("adopt notice refused: %s", exc)
            except Exception as exc:  # noqa: BLE001 - adoption never ends the agent
                log.warning("adopting the program's save: %r", exc)
                channel = None  # a broken connection: made again at the next turn

    def _post(self, channel: Any) -> None:
        with self._lock:
            saved, self._saved = self._saved, None
        if saved is None:
            return
        step, path = saved
        if step <= self._last_posted:
            return
        step_path = path if os.path.isdir(path) else os.path.dirname(path)
        try:
            adopt.step_files(step_path)  # only a DCP save the program finished
            digest, _ = hash_file(METADATA, self.cfg.checksum, root=step_path)
        except (adopt.AdoptError, OSError) as exc:
            log.warning("the program's save of step %d is not adopted: %s", step, exc)
            self._append("ckpt_failed", tier="user", by="adopt", step=step, node=self.node, error=str(exc)[:500],
                         pending=False)
            self._ended.add(step)  # (given up: finish() does not wait for it)
            return
        created = round(time.time(), 6)
        tiers: list[str] = [name for name in ("lustre", "object") if name in self.tiers and self._due(name)]
        if not tiers:
            self._ended.add(step)
            return
        self._posted += 1
        self._last_posted = step
        if "object" in tiers:
            self._object_at = self._clock()
        notice = adopt.Notice(step=step, sid=adopt.save_id(step, digest, created), created=created, tiers=tiers,
                              world_size=self.ranks_per_node * self.train_nodes, slots=self.train_nodes,
                              algo=self.cfg.checksum, origin=adopt.ORIGIN + self.adapter)
        channel.post_adopt(notice.to_json())

    def _due(self, tier: str) -> bool:
        """Whether the next save goes to ``tier``: the shared tier every save; the object tier
        every object_every_saves saves or after object_every_min minutes (every save where
        it is the only tier)."""
        if tier == "lustre" or "lustre" not in self.tiers:
            return True
        every, minutes = self.cfg.object_every_saves, self.cfg.object_every_min
        if every > 0 and (self._posted + 1) % every == 0:
            return True
        return minutes > 0 and (self._object_at is None or self._clock() - self._object_at >= 60 * minutes)

    def _follow(self, channel: Any) -> None:
        raw = channel.adopt_notice()
        slot = self.slot
        if raw is None or slot is None:
            return
        notice = adopt.Notice.from_json(raw)
        if slot >= notice.slots or (notice.step, notice.sid, slot) in self._done:
            return
        self._done.add((notice.step, notice.sid, slot))
        step_path = os.path.join(self.folder, self.step_name(notice.step))
        t0 = self._clock()
        try:
            names = adopt.own(adopt.step_files(step_path), self.ranks(slot), metadata=slot == 0)
            entries = adopt.hash_entries(step_path, names, notice.algo)
        except (adopt.AdoptError, OSError) as exc:
            problem = f"slot {slot}: {exc}"
            log.warning("step %d: %s", notice.step, problem)
            for name in notice.tiers:
                self._refuse(name, notice, slot, problem)
            self._offered.add((notice.step, slot))
            return
        for name in notice.tiers:
            tier = self.tiers.get(name)
            if tier is None:
                continue
            try:
                adopt.offer(tier, step_path, notice, entries, slot)
            except (adopt.AdoptError, TierError, OSError) as exc:
                log.warning("step %d to the %s tier: %s", notice.step, name, exc)
        self._offered.add((notice.step, slot))  # (finish() waits for this, not for the notice taken up)
        if slot == 0:  # the holder of rank 0 (and .metadata) commits
            for name in notice.tiers:
                self._commit(name, notice, t0)
            self._ended.add(notice.step)

    def _refuse(self, name: str, notice: adopt.Notice, slot: int, problem: str) -> None:
        tier = self.tiers.get(name)
        if tier is None:
            return
        try:
            adopt.refuse(tier, notice, slot, problem)
        except TierError as exc:
            log.warning("cannot acknowledge step %d on %s: %s", notice.step, name, exc)

    def _commit(self, name: str, notice: adopt.Notice, t0: float) -> None:
        tier = self.tiers.get(name)
        if tier is None:
            return

        def superseded() -> bool:
            with self._lock:
                return self._saved is not None and self._saved[0] > notice.step
        acks = adopt.wait_acks(tier, notice, self.cfg.commit_timeout_s, superseded=superseded)
        try:
            m = adopt.commit(tier, notice, acks)
        except (adopt.AdoptError, TierError, OSError) as exc:
            log.warning("step %d not adopted on %s: %s", notice.step, name, exc)
            self._append("ckpt_failed", by="adopt", step=notice.step, tier=name, node=self.node,
                         error=str(exc)[:500], pending=False)
            return
        self._append("ckpt_adopted", step=notice.step, tier=name, node=self.node, files=len(m.files),
                     bytes=m.total_bytes, seconds=round(self._clock() - t0, 3), origin=notice.origin)
        keep = self.cfg.keep_lustre if name == "lustre" else self.cfg.keep_object
        try:
            deleted = adopt.retain(tier, keep)
        except (TierError, OSError) as exc:
            log.warning("retention of adopted saves on %s: %s", name, exc)
            return
        if deleted:
            log.info("adopted saves deleted on %s by retention (keep %d): %s", name, keep, deleted)
