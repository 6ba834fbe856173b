"""The training loop in-process (one gloo rank) with an in-memory fake store.

The real store and real multi-rank processes are exercised in
tests/integration/test_train_resume.py; this checks the loop's own logic fast.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from slurmkit.errors import SlurmkitError
from slurmkit.train.config import ModelConfig, ParallelConfig, TrainConfig
from slurmkit.train.parallel import select_runtime
from slurmkit.train.signals import EXIT_CHECKPOINTED_ON_SIGNAL, StopRequest
from slurmkit.train.trainer import RankContext, Trainer

MODEL = ModelConfig(name="t", dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                    vocab_size=64, max_seq_len=16)


class Handle:
    def __init__(self, ok: bool) -> None:
        self.blocking_s = 0.001
        self.ok = ok

    def wait(self) -> bool:
        return self.ok


class MemoryStore:
    """Keeps deep copies of saved states; restores the newest in place like the real one."""

    def __init__(self, fail: bool = False, shared_ok: bool = True) -> None:
        self.saved: dict[int, Any] = {}
        self.fail = fail
        self.shared: set[int] = set()  # saves asked to reach the shared tier
        self.shared_ok = shared_ok
        self.waited_shared: list[int] = []
        self.final: set[int] = set()  # saves asked to reach every slower tier

    def save(self, step: int, state: dict[str, Any], *, shared: bool = False,
             final: bool = False) -> Handle:
        self.saved[step] = copy.deepcopy(state)
        if shared:
            self.shared.add(step)
        if final:
            self.final.add(step)
        return Handle(not self.fail)

    def wait_shared(self, step: int) -> bool:
        self.waited_shared.append(step)
        return self.shared_ok and step in self.shared

    def restore(self, template: dict[str, Any]) -> Any:
        if not self.saved:
            return None
        step = max(self.saved)
        _load(template, self.saved[step])
        return type("R", (), {"step": step, "tier": "memory"})()

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


def _load(dst: dict[Any, Any], src: dict[Any, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, torch.Tensor) and isinstance(dst.get(key), torch.Tensor):
            dst[key].copy_(value)
        elif isinstance(value, dict) and isinstance(dst.get(key), dict):
            _load(dst[key], value)
        else:
            dst[key] = copy.deepcopy(value)


@pytest.fixture
def group(tmp_path: Any) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trainer(store: MemoryStore, run_dir: str, stop: StopRequest | None = None,
            **train: Any) -> Trainer:
    t = TrainConfig(**{"steps": 6, "micro_batch": 2, "global_batch": 4, "seq_len": 8,
                       "warmup_steps": 1, "ckpt_interval_steps": 2, **train})
    return Trainer(MODEL, ParallelConfig(strategy="ddp"), t,
                   ctx=RankContext(rank=0, world_size=1, run_dir=run_dir),
                   runtime=select_runtime(t, 0, cuda=False), strategy="ddp", store=store,
                   stop=stop or StopRequest())


def digest(run_dir: str) -> str:
    with open(os.path.join(run_dir, "final.json")) as f:
        return str(json.load(f)["param_sha256"])


def test_stop_and_resume_matches_an_uninterrupted_run(group: None, tmp_path: Any) -> None:
    a_dir, b_dir = str(tmp_path / "a"), str(tmp_path / "b")
    os.makedirs(a_dir)
    os.makedirs(b_dir)
    assert trainer(MemoryStore(), a_dir).run() == 0
    store = MemoryStore()
    assert trainer(store, b_dir, stop_at_step=3).run() == EXIT_CHECKPOINTED_ON_SIGNAL
    assert sorted(store.saved) == [2, 3]
    assert int(store.saved[3]["data"]["position"]) == 3 * 4
    assert trainer(store, b_dir).run() == 0
    assert digest(b_dir) == digest(a_dir)
    assert sorted(store.saved) == [2, 3, 4, 6]


def test_a_stop_request_ends_at_the_next_step_boundary(group: None, tmp_path: Any) -> None:
    store, stop = MemoryStore(), StopRequest()
    stop.request(15)
    assert trainer(store, str(tmp_path), stop).run() == EXIT_CHECKPOINTED_ON_SIGNAL
    assert sorted(store.saved) == [1]
    assert not os.path.exists(os.path.join(str(tmp_path), "final.json"))
    rows = [json.loads(x) for x in open(os.path.join(str(tmp_path), "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1] and rows[0]["ckpt_blocking_s"] > 0


def test_a_failed_stop_checkpoint_is_not_reported_as_saved(group: None, tmp_path: Any) -> None:
    with pytest.raises(SlurmkitError, match="not committed"):
        trainer(MemoryStore(fail=True), str(tmp_path), stop_at_step=1).run()


def test_the_stop_checkpoint_is_sent_to_the_shared_tier_and_waited_for(group: None,
                                                                       tmp_path: Any) -> None:
    store = MemoryStore()
    assert trainer(store, str(tmp_path), stop_at_step=3).run() == EXIT_CHECKPOINTED_ON_SIGNAL
    assert store.shared == {3}  # the periodic save of step 2 keeps its normal promotion
    assert store.waited_shared == [3]


def test_only_the_last_steps_save_is_sent_to_every_tier(group: None, tmp_path: Any) -> None:
    store = MemoryStore()
    assert trainer(store, str(tmp_path), steps=5).run() == 0  # saves at 2, 4 and the end, 5
    assert sorted(store.saved) == [2, 4, 5] and store.final == {5} and not store.shared
    stopped = MemoryStore()
    assert trainer(stopped, str(tmp_path / "s"), stop_at_step=3).run() == EXIT_CHECKPOINTED_ON_SIGNAL
    assert not stopped.final  # a stop save is not the result: the shared tier suffices


def test_a_stop_checkpoint_missing_from_the_shared_tier_is_not_exit_95(group: None,
                                                                       tmp_path: Any) -> None:
    with pytest.raises(SlurmkitError, match="did not reach the shared tier"):
        trainer(MemoryStore(shared_ok=False), str(tmp_path), stop_at_step=1).run()


def test_tensor_parallel_is_rejected_with_a_clear_error(tmp_path: Any) -> None:
    t = TrainConfig(steps=1, seq_len=8)
    with pytest.raises(SlurmkitError, match="parallel.tensor=2.*data parallelism only"):
        Trainer(MODEL, ParallelConfig(tensor=2), t, ctx=RankContext(rank=0, world_size=1),
                runtime=select_runtime(t, 0, cuda=False), strategy="fsdp", store=None,
                stop=StopRequest())


def test_rank0_logs_a_step_line_at_the_interval(group: None, tmp_path: Any, caplog: Any) -> None:
    """`slurmkit logs -f RUN` showed no training: rank 0 now logs its steps (issue 37)."""
    caplog.set_level("INFO", logger="slurmkit.train.trainer")
    assert trainer(MemoryStore(), str(tmp_path), steps=7, log_interval_steps=3).run() == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["1/7", "3/7", "6/7", "7/7"], lines
    metrics = [json.loads(x) for x in open(os.path.join(str(tmp_path), "metrics.jsonl"))]
    assert f"loss {metrics[2]['loss']:.4f}" in lines[1] and "tok/s" in lines[1] and "mfu" in lines[1]
    caplog.clear()
    assert trainer(MemoryStore(), str(tmp_path / "quiet"), steps=3, log_interval_steps=0).run() == 0
    assert not [r for r in caplog.records if r.getMessage().startswith("step ")]
