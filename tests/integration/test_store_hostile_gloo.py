"""Hostile checkpoints against a real gloo world of 2 ranks on a shared tier.

Rank 0 rewrites five of six committed steps (and reseals each manifest): a byte item
carrying a pickle, a ``storage_data`` path outside the step, a manifest name with ``..``,
a truncated shard, and (step 6) rank 1's chunk rewritten so that it does not load while
every checksum matches. Every rank must refuse the four crafted ones, skip step 6 together
(rank 0's part loads; the ranks agree it does not restore), open nothing outside the steps,
agree on step 1, and the run's ledger must say what was found in each step."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from slurmkit.ledger.ledger import read_ledger
from testkit.s3server import free_port
from tests.integration.helpers import start_workers
from tests.integration.store_hostile_workers import hostile_main

pytestmark = pytest.mark.integration


def test_two_ranks_refuse_crafted_steps_skip_one_that_fails_to_load_and_restore_the_good_one(
        tmp_path: Any) -> None:
    root, out = str(tmp_path / "ck"), str(tmp_path)
    start_workers(hostile_main, (2, root, free_port(), out), 2)
    assert not os.path.exists(os.path.join(root, "pwned"))  # the pickle never ran
    for r in (0, 1):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            res = json.load(f)
        assert res["ok"] and res["step"] == 1, res
        assert [s for s, _ in res["skipped"]] == [6, 5, 4, 3, 2], res["skipped"]
        for path in res["outside"].values():
            assert os.path.exists(path)  # the bait was there to be read
            assert path not in res["opened_under_root"], path
        # under the root the restore opened files of step directories and its own scratch
        # only; of a refused step, nothing but the manifest and .metadata that refuse it
        for p in res["opened_under_root"]:
            if os.path.isdir(p):  # a tier directory: files below it are opened by name
                continue
            step = next((part for part in p.split(os.sep) if part.startswith("step_")), "")
            assert step or ".restore" in p.split(os.sep), p
            if step and step != "step_0000000001":
                assert os.path.basename(p) in ("manifest.json", ".metadata"), p
    events = list(read_ledger(os.path.join(out, "run", "ledger.jsonl")))
    rejected = {e["step"]: e["reason"] for e in events if e["event"] == "ckpt_rejected"}
    assert sorted(rejected) == [2, 3, 4, 5], events
    assert "BytesStorageMetadata" in rejected[5]
    assert repr(os.path.join(root, "outside.distcp")) in rejected[4]
    assert "'../stolen.distcp'" in rejected[3] and "path separator" in rejected[3]
    assert "which has" in rejected[2] and "truncated" in rejected[2]
    for reason in rejected.values():  # both ranks refused, each said why
        assert "rank 0:" in reason and "rank 1:" in reason and "Detected:" in reason
    (skip6,) = [e for e in events if e["event"] == "ckpt_skipped" and e["step"] == 6]
    assert "rank 1:" in skip6["reason"] and "does not load" in skip6["reason"], skip6
    (restored,) = [e for e in events if e["event"] == "ckpt_restored"]
    assert restored["step"] == 1
