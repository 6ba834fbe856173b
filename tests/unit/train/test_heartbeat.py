"""Heartbeats stay on the node: a private node-local directory, and a real run of the trainer
loop that counts every file operation under the run directory (the shared file system) per
step: there must be none. The same count with the heartbeat in the run directory (the old
layout) shows what the counter catches."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

import slurmkit.train.trainer as trainer_mod
from slurmkit.ledger.ledger import Ledger, read_ledger
from slurmkit.ledger.spool import SpoolReader
from slurmkit.train.__main__ import _ledger
from slurmkit.train.config import ModelConfig, ParallelConfig, TrainConfig
from slurmkit.train.heartbeat import (Heartbeat, LocalDirError, figures_of, heartbeat_path, local_heartbeat_path,
                                      node_local_dir, private_dir, read_heartbeat)
from slurmkit.train.parallel import select_runtime
from slurmkit.train.signals import StopRequest
from slurmkit.train.trainer import RankContext, Trainer

MODEL = ModelConfig(name="t", dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                    vocab_size=64, max_seq_len=16)
STEPS = 8


class FsOps:
    """Every audited file operation (open, rename/replace, mkdir, remove, listdir, scandir,
    chmod, ...) whose path lies under one of ``roots``, while ``active``. Audit hooks cannot be
    removed, so one hook serves every test and records only inside a window."""

    active: FsOps | None = None
    installed = False

    def __init__(self, **roots: str) -> None:
        self.roots = {name: os.path.realpath(r) + os.sep for name, r in roots.items()}
        self.ops: dict[str, list[tuple[str, str]]] = {name: [] for name in roots}
        if not FsOps.installed:
            sys.addaudithook(FsOps.hook)
            FsOps.installed = True

    @classmethod
    def hook(cls, event: str, args: tuple[Any, ...]) -> None:
        me = cls.active
        if me is None or not (event == "open" or event.startswith(("os.", "shutil."))):
            return
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)):
                p = os.path.realpath(os.fsdecode(a))
                for name, root in me.roots.items():
                    if (p + os.sep).startswith(root):
                        me.ops[name].append((event, p))

def snapshot(root: str) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under ``root``: catches writes to files opened earlier."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.join(d, f)] = (st.st_size, st.st_mtime_ns)
    return out


class WindowBeat(Heartbeat):
    """The real heartbeat, marking the steady-state window: from the end of step 1's beat to
    the start of the last step's beat (steps 2..STEPS-1 whole, with their metrics and events)."""

    def __init__(self, *a: Any, counter: FsOps, shared: str, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.counter, self.shared = counter, shared
        self.before: dict[str, tuple[int, int]] = {}
        self.after: dict[str, tuple[int, int]] = {}

    def beat(self, step: int, **extra: Any) -> dict[str, Any]:
        if step == STEPS:
            FsOps.active = None
            self.after = snapshot(self.shared)
        record = super().beat(step, **extra)
        if step == 1:
            self.before = snapshot(self.shared)
            FsOps.active = self.counter
        return record


@pytest.fixture
def group(tmp_path: Any) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_loop(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, *, beat_in_run_dir: bool) -> tuple[FsOps, WindowBeat, str]:
    shared, local = str(tmp_path / "shared"), str(tmp_path / "local")
    run_dir = os.path.join(shared, "run")
    os.makedirs(run_dir)
    os.makedirs(local)
    env = {"SLURMKIT_RUN_DIR": run_dir, "SLURMKIT_NODE_LOCAL_DIR": local}
    env["SLURMKIT_EVENTS_FILE"] = os.path.join(node_local_dir(run_dir, env), "events", "rank0.jsonl")
    # Heartbeat.from_env's path, made by the real code; the run-dir variant is the old layout.
    path = (os.path.join(run_dir, "heartbeat", "rank0.json") if beat_in_run_dir
            else heartbeat_path(env, 0))
    assert path is not None
    if not beat_in_run_dir:
        assert Heartbeat.from_env(env, 0) is not None  # creates the private directory
    counter = FsOps(shared=shared, local=local)
    hb = WindowBeat(path, rank=0, counter=counter, shared=shared)
    monkeypatch.setattr(trainer_mod, "METRICS_FLUSH_INTERVAL_S", 3600.0)  # only close() writes
    t = TrainConfig(steps=STEPS, micro_batch=2, global_batch=4, seq_len=8, warmup_steps=1,
                    ckpt_interval_steps=0, ckpt_at_end=False)
    trainer = Trainer(MODEL, ParallelConfig(strategy="ddp"), t,
                      ctx=RankContext(rank=0, world_size=1, run_dir=run_dir),
                      runtime=select_runtime(t, 0, cuda=False), strategy="ddp", store=None,
                      stop=StopRequest(), ledger=_ledger(env, 0), heartbeat=hb)
    try:
        assert trainer.run() == 0
    finally:
        FsOps.active = None
    return counter, hb, env["SLURMKIT_EVENTS_FILE"]


def test_a_training_step_does_nothing_on_the_shared_file_system(group: None, tmp_path: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    counter, hb, events = run_loop(tmp_path, monkeypatch, beat_in_run_dir=False)
    steps = STEPS - 2
    assert counter.ops["shared"] == []  # 0 shared-FS operations per step
    assert hb.before and hb.after == hb.before  # and no write into a file opened before
    # The counter sees the beats it is meant to see: open + replace per step, node-local.
    assert len(counter.ops["local"]) >= 2 * steps
    assert {e for e, _ in counter.ops["local"]} >= {"open", "os.rename"}
    beat = read_heartbeat(hb.path)
    assert beat is not None and beat["step"] == STEPS
    # Rank 0's events went to the node-local spool, whole, for its agent.
    got = SpoolReader(events).read_new()
    assert [e["event"] for e in got] == ["train_started", "train_finished"]
    # The metrics of every step reached the run directory at close.
    with open(os.path.join(str(tmp_path / "shared" / "run"), "metrics.jsonl")) as f:
        assert len(f.readlines()) == STEPS


def test_the_counter_catches_a_heartbeat_in_the_run_directory(group: None, tmp_path: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    counter, _hb, _events = run_loop(tmp_path, monkeypatch, beat_in_run_dir=True)
    per_step = len(counter.ops["shared"]) / (STEPS - 2)
    assert per_step >= 2  # open of the temporary file + the rename, every step


def test_node_local_dir_is_private_per_user_and_run(tmp_path: Any) -> None:
    env = {"SLURMKIT_NODE_LOCAL_DIR": str(tmp_path)}
    a, b = node_local_dir("/runs/a", env), node_local_dir("/runs/b", env)
    assert a != b and os.path.dirname(a) == os.path.join(str(tmp_path), f"slurmkit-{os.getuid()}")
    assert node_local_dir("/runs/a/", env) == a  # one run, one name, however it is spelt
    os.makedirs(os.path.dirname(a), mode=0o777)
    os.chmod(os.path.dirname(a), 0o777)  # pre-created open to all (umask aside): made private
    private_dir(a)
    for d in (os.path.dirname(a), a):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    assert local_heartbeat_path("/runs/a", 3, env) == os.path.join(a, "heartbeat", "rank3.json")


def test_a_planted_link_in_the_shared_local_root_is_refused(tmp_path: Any) -> None:
    env = {"SLURMKIT_NODE_LOCAL_DIR": str(tmp_path / "shm")}
    os.makedirs(tmp_path / "shm")
    os.makedirs(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "shm" / f"slurmkit-{os.getuid()}")
    with pytest.raises(LocalDirError, match="not a directory.*Fix: remove"):
        Heartbeat.from_env({**env, "SLURMKIT_RUN_DIR": "/runs/a"}, 0)
    assert os.listdir(tmp_path / "elsewhere") == []


def test_heartbeat_fallback_is_node_local_never_the_run_dir(tmp_path: Any) -> None:
    env = {"SLURMKIT_RUN_DIR": str(tmp_path / "run"), "SLURMKIT_NODE_LOCAL_DIR": str(tmp_path / "shm")}
    os.makedirs(tmp_path / "shm")
    hb = Heartbeat.from_env(env, 2)
    assert hb is not None and hb.path.startswith(str(tmp_path / "shm"))
    hb.beat(5)
    assert read_heartbeat(local_heartbeat_path(env["SLURMKIT_RUN_DIR"], 2, env))["step"] == 5  # type: ignore[index]
    assert not os.path.exists(tmp_path / "run")
    assert heartbeat_path({"SLURMKIT_HEARTBEAT_FILE": "/x/y.json"}, 0) == "/x/y.json"


def test_an_agent_ledger_takes_the_trainers_events_from_the_spool(tmp_path: Any) -> None:
    """train/__main__'s sink under an agent is the spool; alone, the ledger itself."""
    spool = str(tmp_path / "shm" / "events" / "rank0.jsonl")
    sink = _ledger({"SLURMKIT_EVENTS_FILE": spool, "SLURMKIT_LEDGER": str(tmp_path / "l.jsonl")}, 0)
    assert type(sink).__name__ == "SpoolWriter"
    assert _ledger({"SLURMKIT_EVENTS_FILE": spool}, 1) is None
    alone = _ledger({"SLURMKIT_LEDGER": str(tmp_path / "l.jsonl")}, 0)
    assert isinstance(alone, Ledger)
    sink.append("train_started", step=0, generation=0)
    agent = Ledger(str(tmp_path / "run" / "ledger.jsonl"), source="agent:n1")
    agent.attach(SpoolReader(spool))
    agent.append("end", status="completed", exit_code=0)
    assert [(e["event"], e["source"]) for e in read_ledger(agent.path)] == [
        ("train_started", "rank0"), ("end", "agent:n1")]


def test_the_stores_real_events_pass_the_schema_through_the_trainers_forwarder(
        group: None, tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A real save on NVMe promoted to the shared tier: ckpt_saved and ckpt_durable reach the
    ledger; the store's ``source`` (the tier copied from) is ``from_tier``, never the writer."""
    import torch
    from omegaconf import OmegaConf

    from slurmkit.train.__main__ import _open_store

    d = str(tmp_path)
    raw = OmegaConf.create({"store": {"nvme_uri": f"{d}/nvme", "lustre_uri": f"{d}/lustre"}})
    led = Ledger(f"{d}/run/ledger.jsonl", source="rank0")
    store = _open_store(raw, {"SLURMKIT_RUN_DIR": f"{d}/run"}, 0, 1, "abc", led)
    assert store is not None
    assert store.save(1, {"w": torch.ones(3)}).wait()
    store.wait()
    store.close()
    got = {e["event"]: e for e in read_ledger(led.path)}
    assert set(got) >= {"ckpt_saved", "ckpt_durable"}
    assert got["ckpt_durable"]["source"] == "rank0" and got["ckpt_durable"]["from_tier"] == "nvme"
    assert "on_event callback failed" not in caplog.text


@pytest.mark.parametrize("record,figures,total", [
    ({"metrics": {"loss": 2.0, "mfu": 0.4}, "total_steps": 9}, {"loss": 2.0, "mfu": 0.4}, 9),
    ({"metrics": {"loss": None, "tps": "1e3", "ok": True}}, {"loss": None, "tps": None, "ok": None}, None),
    ({"metrics": {"bad name": 1.0, "x" * 49: 1.0, "\x1b[2J": 1.0, "good": 3}}, {"good": 3.0}, None),
    ({"metrics": [1, 2], "total_steps": True}, {}, None),
    ({"metrics": {f"m{i}": i for i in range(100)}, "total_steps": 2**60}, {f"m{i}": float(i) for i in range(16)}, None),
    ({"total_steps": -1}, {}, None),
    ({}, {}, None),
])
def test_figures_of_a_beat_take_only_named_numbers_and_a_positive_total(record, figures, total) -> None:
    assert figures_of(record) == (figures, total)
