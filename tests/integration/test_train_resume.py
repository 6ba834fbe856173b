"""Exact resume through the real store and real torch.distributed (2 gloo ranks, subprocesses).

Run A trains N steps uninterrupted; run B stops at step k (a configured stop, or a real
SIGTERM to one rank) with exit 95; run C restores B's newest checkpoint and finishes. The
parameters of A and C must be bit-for-bit equal.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from slurmkit.ledger.ledger import read_ledger
from slurmkit.train.heartbeat import local_heartbeat_path, read_heartbeat
from slurmkit.launch.localranks import spawn_ranks, write_config
from slurmkit.train.signals import EXIT_CHECKPOINTED_ON_SIGNAL

pytestmark = pytest.mark.integration

STEPS = 8
TIMEOUT_S = 120


def sections(strategy: str, *, ac: bool = False, **train: Any) -> dict[str, Any]:
    return {
        "model": {"name": "test", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "ffn_dim": 128, "vocab_size": 512, "max_seq_len": 64},
        "parallel": {"strategy": strategy, "pg_timeout_s": 60, "activation_checkpointing": ac},
        "train": {"steps": STEPS, "micro_batch": 2, "global_batch": 8, "seq_len": 32,
                  "warmup_steps": 2, "ckpt_interval_steps": 3, "cpu_peak_tflops": 0.1,
                  **train},
        "store": {"nvme_uri": "$SLURMKIT_RUN_DIR/ckpt/nvme",
                  "lustre_uri": "$SLURMKIT_RUN_DIR/ckpt/shared"},
    }


def launch(tmp: str, name: str, run_dir: str, cfg: dict[str, Any], generation: int = 0,
           env: dict[str, str] | None = None) -> Any:
    path = write_config(os.path.join(tmp, f"{name}.yaml"), cfg)
    return spawn_ranks(path, run_dir, 2, generation=generation,
                       env={**os.environ, **(env or {})})


def final(run_dir: str) -> dict[str, Any]:
    with open(os.path.join(run_dir, "final.json")) as f:
        return dict(json.load(f))


def run_uninterrupted(tmp: str, strategy: str, **opts: Any) -> dict[str, Any]:
    run_dir = os.path.join(tmp, "A")
    ranks = launch(tmp, "a", run_dir, sections(strategy, **opts))
    assert ranks.wait(TIMEOUT_S) == [0, 0], ranks.tail()
    return final(run_dir)


def memmap_opts(tmp: str) -> dict[str, Any]:
    """A real token file, read by activation-checkpointed FSDP ranks."""
    path = os.path.join(tmp, "tokens.bin")
    np.random.default_rng(0).integers(0, 512, 32 * 200 + 1, dtype=np.uint16).tofile(path)
    return {"ac": True, "data": "memmap", "data_path": path, "data_dtype": "uint16"}


@pytest.mark.parametrize("strategy,variant", [("ddp", ""), ("fsdp", ""),
                                              ("fsdp", "memmap+ac")])
def test_stop_at_step_then_resume_is_bit_exact(tmp_path: Any, strategy: str,
                                               variant: str) -> None:
    tmp = str(tmp_path)
    opts = memmap_opts(tmp) if variant else {}
    a = run_uninterrupted(tmp, strategy, **opts)
    assert a["step"] == STEPS and a["world_size"] == 2

    run_dir = os.path.join(tmp, "B")
    b = launch(tmp, "b", run_dir, sections(strategy, stop_at_step=4, **opts))
    assert b.wait(TIMEOUT_S) == [EXIT_CHECKPOINTED_ON_SIGNAL] * 2, b.tail()
    assert not os.path.exists(os.path.join(run_dir, "final.json"))

    c = launch(tmp, "c", run_dir, sections(strategy, **opts), generation=1)
    assert c.wait(TIMEOUT_S) == [0, 0], c.tail()
    assert final(run_dir)["param_sha256"] == a["param_sha256"]

    events = list(read_ledger(os.path.join(run_dir, "ledger.jsonl")))
    resumed = [e for e in events if e["event"] == "train_resumed"]
    assert [(e["step"], e["tier"]) for e in resumed] == [(4, "nvme")]
    assert any(e["event"] == "train_stopped" and e["step"] == 4 for e in events)
    assert any(e["event"] == "ckpt_saved" for e in events)
    assert events[-1]["event"] in ("train_finished", "ckpt_durable")


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_sigterm_to_one_rank_stops_all_at_one_step_and_resumes_exactly(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    a = run_uninterrupted(tmp, "ddp")

    run_dir = os.path.join(tmp, "B")
    b = launch(tmp, "b", run_dir, sections("ddp"), env={"SLURMKIT_STEP_DELAY_S": "0.3"})
    hb1 = local_heartbeat_path(run_dir, 1)  # node-local (/dev/shm), not the run dir
    pid1 = b.procs[1].pid  # this rank's own beat, never one left at the path by an earlier run
    wait_for(lambda: (beat := read_heartbeat(hb1) or {}).get("pid") == pid1
             and beat.get("step", 0) >= 2, 60, "rank 1 at step 2")
    b.procs[1].send_signal(signal.SIGTERM)  # only rank 1: rank 0 learns it in the all-reduce
    assert b.wait(TIMEOUT_S) == [EXIT_CHECKPOINTED_ON_SIGNAL] * 2, b.tail()
    beats = [read_heartbeat(local_heartbeat_path(run_dir, r)) for r in (0, 1)]
    assert beats[0] is not None and beats[1] is not None
    assert beats[0]["step"] == beats[1]["step"] < STEPS
    stopped = [e for e in read_ledger(os.path.join(run_dir, "ledger.jsonl"))
               if e["event"] == "train_stopped"]
    assert stopped[0]["step"] == beats[0]["step"]

    c = launch(tmp, "c", run_dir, sections("ddp"), generation=1)
    assert c.wait(TIMEOUT_S) == [0, 0], c.tail()
    assert final(run_dir)["param_sha256"] == a["param_sha256"]
    hb = read_heartbeat(hb1)
    assert hb is not None and hb["generation"] == 1 and hb["step"] == STEPS

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["loss"] > 0
    assert all(r["ckpt_blocking_s"] > 0 for r in rows if r["step"] in (3, 6, STEPS))
