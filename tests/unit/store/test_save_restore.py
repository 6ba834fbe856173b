"""Single-process save/restore through the public API on local + memory:// tiers."""

from __future__ import annotations

import glob
import os
import threading
import uuid
from typing import Any

import pytest
import torch

from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.store.manifest import step_dir


def make_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g),
                      "h": torch.randn(32, generator=g).to(torch.bfloat16)},
            "optim": {"state": {0: {"exp_avg": torch.randn(64, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
            "rng": torch.get_rng_state(), "step": 0, "blob": b"\x01\x02"}


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    def z(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        return None
    return z(state)  # type: ignore[no-any-return]


@pytest.fixture
def events() -> list[dict[str, Any]]:
    return []


def open_store(tmp_path: str, events: list[dict[str, Any]], **kw: Any) -> CheckpointStore:
    cfg = StoreConfig(nvme_uri=f"{tmp_path}/nvme", lustre_uri=f"{tmp_path}/lustre", **kw)
    return CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                       on_event=events.append, sleep=lambda s: None)


def save_steps(store: CheckpointStore, state: dict[str, Any], steps: list[int]) -> None:
    for s in steps:
        state["model"]["w"].add_(1.0)
        state["step"] = s
        store.save(s, state)
    store.wait()


def test_roundtrip_bit_exact_in_place(tmp_path: str, events: list[dict[str, Any]]) -> None:
    st = open_store(tmp_path, events)
    state = make_state()
    save_steps(st, state, [10, 20])
    tmpl = blank_like(state)
    w = tmpl["model"]["w"]
    r = st.restore(tmpl)
    assert r is not None and r.step == 20 and r.tier == "nvme" and r.skipped == []
    assert tmpl["model"]["w"] is w  # loaded in place into the template tensor
    for k in ("w", "b", "h"):
        assert torch.equal(tmpl["model"][k], state["model"][k])
    assert torch.equal(tmpl["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert tmpl["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert torch.equal(tmpl["rng"], state["rng"])
    assert tmpl["step"] == 20 and tmpl["blob"] == b"\x01\x02"
    kinds = [e["event"] for e in events]
    assert kinds.count("ckpt_saved") == 2 and "ckpt_durable" in kinds and "ckpt_restored" in kinds
    assert st.latest_verified() == 20
    st.close()


def _shard(tmp_path: str, tier: str, step: int) -> str:
    root = f"{tmp_path}/nvme/n0" if tier == "nvme" else f"{tmp_path}/lustre"
    return sorted(glob.glob(f"{root}/{step_dir(step)}/__0_*.distcp"))[0]


def _truncate(p: str) -> None:
    os.truncate(p, os.path.getsize(p) // 2)


def _bitflip(p: str) -> None:
    with open(p, "r+b") as f:
        f.seek(os.path.getsize(p) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


def _no_manifest(p: str) -> None:
    os.remove(os.path.join(os.path.dirname(p), "manifest.json"))


@pytest.mark.parametrize("damage,reason", [(_truncate, "truncated"), (_bitflip, "checksum"),
                                           (_no_manifest, "no manifest")])
def test_corrupt_newest_falls_back(tmp_path: str, events: list[dict[str, Any]],
                                   damage: Any, reason: str) -> None:
    st = open_store(tmp_path, events, lustre_every_saves=1)
    state = make_state()
    save_steps(st, state, [1])
    expected = state["model"]["w"].clone()
    save_steps(st, state, [2])
    damage(_shard(tmp_path, "nvme", 2))
    damage(_shard(tmp_path, "lustre", 2))
    tmpl = blank_like(state)
    r = st.restore(tmpl)
    assert r is not None and r.step == 1
    assert r.skipped and r.skipped[0][0] == 2 and reason in r.skipped[0][1]
    assert torch.equal(tmpl["model"]["w"], expected)
    assert any(e["event"] == "ckpt_skipped" and e["step"] == 2 for e in events)
    st.close()


def test_corrupt_nvme_copy_restores_same_step_from_lustre(tmp_path: str,
                                                          events: list[dict[str, Any]]) -> None:
    st = open_store(tmp_path, events)
    state = make_state()
    save_steps(st, state, [5])
    _bitflip(_shard(tmp_path, "nvme", 5))
    tmpl = blank_like(state)
    r = st.restore(tmpl)
    assert r is not None and (r.step, r.tier) == (5, "lustre")
    assert torch.equal(tmpl["model"]["w"], state["model"]["w"])
    # per file: only the damaged shard came from Lustre, the intact files from NVMe
    (ev,) = [e for e in events if e["event"] == "ckpt_restored"]
    assert ev["bytes_by_tier"]["nvme"] > 0 and ev["bytes_by_tier"]["lustre"] > 0, ev
    assert not r.skipped
    st.close()


def test_lost_node_nvme_restores_from_lustre(tmp_path: str, events: list[dict[str, Any]]) -> None:
    st = open_store(tmp_path, events)
    state = make_state()
    save_steps(st, state, [3])
    st.close()
    other = CheckpointStore.from_config(
        StoreConfig(nvme_uri=f"{tmp_path}/nvme", lustre_uri=f"{tmp_path}/lustre"),
        rank=0, world_size=1, node="n1", env={})  # a different node: its NVMe is empty
    tmpl = blank_like(state)
    r = other.restore(tmpl)
    assert r is not None and (r.step, r.tier) == (3, "lustre")
    other.close()


def test_retention_per_tier(tmp_path: str, events: list[dict[str, Any]]) -> None:
    st = open_store(tmp_path, events, keep_nvme=2, keep_lustre=1, lustre_every_saves=2)
    save_steps(st, make_state(), [1, 2, 3, 4, 5, 6])
    nvme = sorted(os.listdir(f"{tmp_path}/nvme/n0"))
    lustre = sorted(os.listdir(f"{tmp_path}/lustre"))
    assert [n for n in nvme if n.startswith("step_")] == [step_dir(5), step_dir(6)]
    assert [n for n in lustre if n.startswith("step_")] == [step_dir(6)]
    st.close()


def test_the_final_save_reaches_every_slower_tier_between_intervals(
        tmp_path: str, events: list[dict[str, Any]]) -> None:
    """The run's last save is promoted to Lustre and S3 even when neither interval is due
    (node NVMe does not outlive the job); an ordinary save at the same count is not."""
    def opened(where: str) -> CheckpointStore:
        cfg = StoreConfig(nvme_uri=f"{tmp_path}/{where}/nvme",
                          lustre_uri=f"{tmp_path}/{where}/lustre",
                          object_uri=f"memory://final-{uuid.uuid4().hex[:8]}",
                          lustre_every_saves=4, object_every_saves=4)
        return CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                           on_event=events.append, sleep=lambda s: None)

    for where, final in (("plain", False), ("final", True)):
        st = opened(where)
        state = make_state()
        save_steps(st, state, [1, 2])
        st.save(3, state, final=final)
        st.wait()
        durable = {(e["step"], e["tier"]) for e in events if e["event"] == "ckpt_durable"}
        assert ((3, "lustre") in durable and (3, "object") in durable) is final, durable
        assert not {(s, t) for s, t in durable if s < 3}, durable  # 1, 2: never due
        events.clear()
        st.close()


def test_busy_policy_skip_and_wait(tmp_path: str, events: list[dict[str, Any]]) -> None:
    for policy in ("skip", "wait"):
        st = open_store(f"{tmp_path}/{policy}", events, busy_policy=policy)
        gate = threading.Event()
        real = st._writer.write

        def slow(*a: Any, **k: Any) -> Any:
            gate.wait(30)
            return real(*a, **k)

        st._writer.write = slow  # type: ignore[method-assign]
        state = make_state()
        first = st.save(1, state)
        if policy == "skip":
            second = st.save(2, state)
            assert second.skipped and not second.wait()
            gate.set()
        else:
            threading.Timer(0.05, gate.set).start()
            second = st.save(2, state)
            assert second.wait()
        assert first.wait()
        st.close()
    kinds = [(e["event"], e["step"]) for e in events]
    assert ("ckpt_skipped", 2) in kinds and ("ckpt_waited", 2) in kinds


def test_object_tier_only_uses_scratch(tmp_path: str, events: list[dict[str, Any]]) -> None:
    cfg = StoreConfig(object_uri=f"memory://only/{uuid.uuid4().hex}", scratch_dir=str(tmp_path))
    st = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                     on_event=events.append)
    state = make_state()
    save_steps(st, state, [4])
    assert ("ckpt_durable", "object") in [(e["event"], e.get("tier")) for e in events]
    tmpl = blank_like(state)
    r = st.restore(tmpl)
    assert r is not None and (r.step, r.tier) == (4, "object")
    assert torch.equal(tmpl["model"]["w"], state["model"]["w"])
    st.close()


def test_empty_store_restores_nothing(tmp_path: str, events: list[dict[str, Any]]) -> None:
    st = open_store(tmp_path, events)
    assert st.restore(blank_like(make_state())) is None
    assert st.latest_verified() is None
    st.close()
