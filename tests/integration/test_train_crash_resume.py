"""A crash a few steps after a periodic (async) checkpoint, then a restart of all ranks, must
end with the same parameters as the uninterrupted run, bit for bit.

4 real gloo ranks on 2 emulated nodes (the smallest world where float sums of gradients can
depend on the reduction order: with 2 ranks a + b == b + a). Rank 3 dies with ``os._exit``
before step 8 (``SLURMKIT_FAULT=exit:3:8:once``); the survivors are killed as the node agent
kills a failed generation; all 4 ranks restart and restore the newest periodic checkpoint
(step 6, or step 3 if step 6's write had not committed yet). The resumed run's first
optimizer step is then its DDP's first iteration, which reduces in a different bucket layout
than the uninterrupted run's step at the same point: the case ``slurmkit.train.reduce`` fixes.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from slurmkit.ledger.ledger import read_ledger
from slurmkit.launch.localranks import LocalRun, spawn_ranks, write_config

pytestmark = pytest.mark.integration

WORLD, NODES = 4, 2
STEPS, INTERVAL, CRASH_STEP, CRASH_RANK = 9, 3, 8, 3
TIMEOUT_S = 180


def sections(strategy: str) -> dict[str, Any]:
    return {
        "model": {"name": "test", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "ffn_dim": 128, "vocab_size": 512, "max_seq_len": 64},
        "parallel": {"strategy": strategy, "pg_timeout_s": 60},
        "train": {"steps": STEPS, "micro_batch": 1, "seq_len": 32, "warmup_steps": 2,
                  "ckpt_interval_steps": INTERVAL, "cpu_peak_tflops": 0.1},
        "store": {"nvme_uri": "$SLURMKIT_RUN_DIR/ckpt/nvme",
                  "lustre_uri": "$SLURMKIT_RUN_DIR/ckpt/shared"},
    }


def launch(tmp: str, strategy: str, run_dir: str, *, fault: str = "",
           generation: int = 0) -> LocalRun:
    path = write_config(os.path.join(tmp, f"{strategy}.yaml"), sections(strategy))
    env = {**os.environ, "SLURMKIT_FAULT": fault}
    return spawn_ranks(path, run_dir, WORLD, env=env, generation=generation, nodes=NODES)


def final_digest(run_dir: str) -> str:
    with open(os.path.join(run_dir, "final.json")) as f:
        record = json.load(f)
    assert record["step"] == STEPS and record["world_size"] == WORLD
    return str(record["param_sha256"])


def wait_for_exit(run: LocalRun, rank: int) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while run.procs[rank].poll() is None:
        if time.monotonic() > deadline:
            run.kill()
            raise AssertionError(f"rank {rank} did not crash:\n{run.tail()}")
        time.sleep(0.05)
    return int(run.procs[rank].returncode)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_crash_after_periodic_checkpoint_then_restart_is_bit_exact(tmp_path: Any,
                                                                   strategy: str) -> None:
    tmp = str(tmp_path)
    ref_dir = os.path.join(tmp, "ref")
    ref = launch(tmp, strategy, ref_dir)
    assert ref.wait(TIMEOUT_S) == [0] * WORLD, ref.tail()
    expected = final_digest(ref_dir)

    run_dir = os.path.join(tmp, "crash")
    fault = f"exit:{CRASH_RANK}:{CRASH_STEP}:once"
    gen0 = launch(tmp, strategy, run_dir, fault=fault)
    try:
        assert wait_for_exit(gen0, CRASH_RANK) == 1, gen0.tail()
    finally:
        gen0.kill()  # the survivors are stuck in (or failing) a collective: end the generation
    assert os.path.exists(os.path.join(run_dir, "faults", f"exit-rank{CRASH_RANK}-step"
                                                          f"{CRASH_STEP}.fired"))
    assert not os.path.exists(os.path.join(run_dir, "final.json"))

    gen1 = launch(tmp, strategy, run_dir, fault=fault, generation=1)  # `once`: no new crash
    assert gen1.wait(TIMEOUT_S) == [0] * WORLD, gen1.tail()

    events = list(read_ledger(os.path.join(run_dir, "ledger.jsonl")))
    resumed = [e for e in events if e["event"] == "train_resumed"]
    assert len(resumed) == 1 and resumed[0]["generation"] == 1
    # a periodic checkpoint, steps before the crash; no stop checkpoint was ever taken
    assert resumed[0]["step"] in (CRASH_STEP // INTERVAL * INTERVAL,
                                  CRASH_STEP // INTERVAL * INTERVAL - INTERVAL)
    assert not any(e["event"] == "train_stopped" for e in events)
    assert final_digest(run_dir) == expected
