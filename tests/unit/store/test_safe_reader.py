"""DCP's .metadata is unpickled through an allowlist: a crafted one cannot run code (the
rest of what restore refuses: test_hostile.py)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.store.manifest import MANIFEST, FileEntry, Manifest, hash_file, step_dir
from slurmkit.store.safe_reader import SafeReader, UnsafeMetadataError


class Payload:
    """Unpickling this runs ``os.system`` (what a crafted checkpoint would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(64, 8, generator=g), "n": torch.arange(7),
            "h": torch.randn(9, generator=g).to(torch.bfloat16)}


def dcp_save(path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state(), checkpoint_id=path, no_dist=True)


def test_reads_real_dcp_metadata_like_dcp_and_loads_bit_exact(tmp_path: Any) -> None:
    dcp_save(str(tmp_path))
    ours = SafeReader(str(tmp_path)).read_metadata()
    theirs = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    got = {k: torch.zeros_like(v) for k, v in state().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=SafeReader(str(tmp_path)), no_dist=True)
    for k, v in state().items():
        assert torch.equal(got[k], v), k


def test_crafted_metadata_is_refused_before_anything_runs(tmp_path: Any) -> None:
    marker = tmp_path / "pwned"
    dcp_save(str(tmp_path / "ck"))
    md = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata()
    # a real Metadata carrying the payload in one of its fields
    bad = dataclasses.replace(md, planner_data=Payload(str(marker)))
    with open(tmp_path / "ck" / ".metadata", "wb") as f:
        pickle.dump(bad, f)
    with pytest.raises(UnsafeMetadataError, match="posix.system|os.system"):
        SafeReader(str(tmp_path / "ck")).read_metadata()
    assert not marker.exists()


def test_store_restore_refuses_a_crafted_metadata_whose_manifest_was_rewritten(
        tmp_path: Any) -> None:
    """The checksum is no defence (whoever writes the file writes the manifest too)."""
    marker = tmp_path / "pwned"
    events: list[dict[str, Any]] = []
    cfg = StoreConfig(nvme_uri=f"{tmp_path}/nvme")
    st = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                     on_event=events.append)
    st.save(1, state())
    st.wait()
    d = tmp_path / "nvme" / "n0" / step_dir(1)
    with open(d / ".metadata", "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    m = Manifest.from_json((d / MANIFEST).read_bytes())
    digest, size = hash_file(str(d / ".metadata"), m.checksum_algo)
    files = [dataclasses.replace(e, checksum=digest, size=size) if e.name == ".metadata" else e
             for e in m.files]
    assert any(isinstance(e, FileEntry) and e.name == ".metadata" for e in files)
    (d / MANIFEST).write_bytes(dataclasses.replace(m, files=files).to_json())
    # refused, never raised: every rank must reach the vote; the step is skipped as unsafe
    assert st.restore({k: torch.zeros_like(v) for k, v in state().items()}) is None
    assert not marker.exists()
    (ev,) = [e for e in events if e["event"] == "ckpt_rejected"]
    assert ev["step"] == 1 and ("posix.system" in ev["reason"] or "os.system" in ev["reason"])
    assert "Detected:" in ev["reason"] and "Fix:" in ev["reason"]
    st.close()
