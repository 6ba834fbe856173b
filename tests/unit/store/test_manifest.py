"""Manifest self-checksum, staging encode/decode, config validation, retention rules."""

from __future__ import annotations

import hashlib
import uuid

import pytest
import torch

from slurmkit.errors import ConfigError
from slurmkit.store.config import StoreConfig
from slurmkit.store.manifest import FileEntry, Manifest, ManifestError, step_dir
from slurmkit.store.retention import gc_tier
from slurmkit.store.staging import StagingBuffers, apply_json, decode_json, encode_json
from slurmkit.store.tier import make_tier


def _manifest() -> Manifest:
    return Manifest(step=7, world_size=2, checksum_algo="sha256", config_hash="abc",
                    files=[FileEntry("__0_0.distcp", 10, "aa", 0),
                           FileEntry("__1_0.distcp", 12, "bb", 1)])


def test_manifest_roundtrip_and_total() -> None:
    m = Manifest.from_json(_manifest().to_json())
    assert m.step == 7 and m.total_bytes == 22 and m.files[1].rank == 1


def test_manifest_tamper_is_detected() -> None:
    data = _manifest().to_json().replace(b'"size": 10', b'"size": 11')
    with pytest.raises(ManifestError, match="checksum mismatch"):
        Manifest.from_json(data)


def test_manifest_garbage_is_manifest_error() -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(b"{not json")


def test_json_values_roundtrip_without_pickle() -> None:
    v = {"epoch": 3, "lrs": [0.1, None], "name": "x", "raw": b"\x00\xff", "t": (1, 2)}
    assert decode_json(encode_json(v)) == {**v, "t": [1, 2]}


def test_unsupported_value_is_config_error() -> None:
    with pytest.raises(ConfigError, match="object"):
        StagingBuffers().snapshot({"bad": object()})


def test_staging_reuses_buffers_and_copies() -> None:
    sb = StagingBuffers()
    w = torch.randn(64, 64)
    flat1 = sb.snapshot({"m": {"w": w}, "step": 1})
    w.add_(1)  # the trainer mutates after save() returned
    assert not torch.equal(flat1["m.w"], w)
    allocated = sb.allocated_bytes
    flat2 = sb.snapshot({"m": {"w": w}, "step": 2})
    assert sb.allocated_bytes == allocated  # no new allocation for an unchanged layout
    assert flat2["m.w"].data_ptr() == flat1["m.w"].data_ptr()
    assert torch.equal(flat2["m.w"], w)
    template = {"m": {"w": w}, "step": 0}
    apply_json(template, flat2)
    assert template["step"] == 2


@pytest.mark.parametrize("field,value", [("busy_policy", "maybe"), ("checksum", "md5"),
                                         ("keep_nvme", 0), ("lustre_every_saves", -1)])
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        StoreConfig(nvme_uri="/x", **{field: value})  # type: ignore[arg-type]


def test_config_requires_a_tier() -> None:
    with pytest.raises(ConfigError, match="no tier"):
        StoreConfig()


def _fake_step(tier, step: int, manifest: bool = True) -> None:  # type: ignore[no-untyped-def]
    tier.write_atomic(f"{step_dir(step)}/__0_0.distcp", b"x")
    if manifest:
        m = Manifest(step=step, world_size=1, checksum_algo="sha256",
                     files=[FileEntry("__0_0.distcp", 1, hashlib.sha256(b"x").hexdigest(), 0)])
        tier.write_atomic(f"{step_dir(step)}/manifest.json", m.to_json())


@pytest.mark.parametrize("uri", ["local", "memory"])
def test_retention_keeps_newest_and_protected(uri: str, tmp_path: str) -> None:
    root = f"{tmp_path}/t" if uri == "local" else f"memory://ret/{uuid.uuid4().hex}"
    tier = make_tier("nvme", root, {})
    for s in (1, 2, 3, 4, 5):
        _fake_step(tier, s)
    _fake_step(tier, 0, manifest=False)  # a killed save, older than the newest commit
    deleted = gc_tier(tier, keep=2, protected={2})
    assert deleted == [3, 1]
    left = sorted(int(n[5:]) for n in tier.ls("") if n.startswith("step_"))
    assert left == [2, 4, 5]  # 2 is kept: a promotion still reads it
