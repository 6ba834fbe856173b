"""DCP save plans and write results travel as checked JSON (dcp_coord.py), never pickle."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from slurmkit.store import dcp_coord
from slurmkit.store.coord import Coordinator
from slurmkit.store.dcp_coord import PlanError, decode_plan, decode_results, encode_plan
from slurmkit.store.sealing import SealingWriter


def _local_plan(state: dict[str, Any]) -> Any:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state, storage_meta=None, is_coordinator=True)
    return planner.create_local_plan()


def test_a_real_local_plan_survives_the_json_round_trip() -> None:
    state = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
             "extra": io.BytesIO(b"abc")}
    plan = _local_plan(state)
    wire = json.loads(json.dumps(encode_plan(plan)))
    back = decode_plan(wire)
    assert back.items == plan.items
    assert back.planner_data == plan.planner_data


@pytest.mark.parametrize("field,value,match", [
    ("dtype", "torch.load", "not a dtype"),
    ("dtype", "os.system", "not a torch attribute"),
    ("sizes", "1,2", "list of ints"),
    ("layout", "torch.float32", "not a layout"),
])
def test_a_hostile_plan_is_refused(field: str, value: Any, match: str) -> None:
    wire = json.loads(json.dumps(encode_plan(_local_plan({"w": torch.ones(2)}))))
    wire["items"][0]["tensor"][field] = value
    with pytest.raises(PlanError, match=match):
        decode_plan(wire)


def test_write_results_must_be_plain_numbers_and_names() -> None:
    with pytest.raises(PlanError, match="ints >= 0"):
        decode_results([{"index": {"fqn": "w"}, "size": -1, "path": "__0_0.distcp",
                         "offset": 0, "length": 1}])
    with pytest.raises(PlanError, match="without a file name"):
        decode_results([{"index": {"fqn": "w"}, "size": 1, "offset": 0, "length": 1}])


def test_a_world_of_one_save_writes_a_loadable_checkpoint(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0)}
    md = dcp_coord.save(state, SealingWriter(str(tmp_path), algo="crc32", thread_count=1,
                                             direct=False),
                        DefaultSavePlanner(), Coordinator(None, 0, 1))
    assert md is not None and "w" in md.state_dict_metadata
    out = {"w": torch.zeros(6)}
    dcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(out["w"], state["w"])
