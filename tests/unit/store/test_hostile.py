"""Hostile checkpoints against the real store: nothing runs, nothing outside the step is
read, and restore falls back to the older good step with the reason in a ``ckpt_rejected``
event. Every attack also rewrites the manifest to match (a checksum is no defence)."""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from slurmkit.errors import ActionableError
from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.store.catalog import check_step, read_manifest
from slurmkit.store.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    ManifestError,
    UnsafeManifestError,
    check_name,
    step_dir,
)
from slurmkit.store.restore import RestoreError
from slurmkit.store.safe_reader import SafeLoadPlanner, SafeReader, UnsafeMetadataError
from slurmkit.store.tier import make_tier
from tests.unit.store.hostile_steps import (
    OpenAudit,
    Payload,
    byte_item_pickle,
    manifest_dotdot,
    read_md,
    reseal,
    storage_outside,
    truncated_rewritten,
    write_md,
)


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(512, 16, generator=g), "b": torch.randn(16, generator=g)},
            "step": torch.tensor(step), "note": f"saved at {step}"}


def blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(512, 16), "b": torch.zeros(16)},
            "step": torch.tensor(0), "note": None}


def saved_store(tmp_path: Any, events: list[dict[str, Any]]) -> CheckpointStore:
    cfg = StoreConfig(nvme_uri=f"{tmp_path}/nvme", keep_nvme=3)
    st = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                     on_event=events.append)
    for step in (1, 2):
        st.save(step, make_state(step))
        st.wait()
    return st


def the_step(tmp_path: Any, step: int) -> str:
    (path,) = glob.glob(f"{tmp_path}/nvme/**/{step_dir(step)}", recursive=True)
    return path


def restore_falls_back(tmp_path: Any, st: CheckpointStore, events: list[dict[str, Any]],
                       found: str) -> list[str]:
    """Restore: step 1 exactly, step 2 rejected with ``found`` in the reason; returns every
    path the restore opened."""
    tmpl = blank()
    with OpenAudit.get().recording() as opened:
        r = st.restore(tmpl)
    assert r is not None and r.step == 1, r
    want = make_state(1)
    assert torch.equal(tmpl["model"]["w"], want["model"]["w"])
    assert torch.equal(tmpl["model"]["b"], want["model"]["b"])
    assert int(tmpl["step"]) == 1 and tmpl["note"] == "saved at 1"
    rejected = [e for e in events if e["event"] == "ckpt_rejected"]
    assert [e["step"] for e in rejected] == [2], events
    assert found in rejected[0]["reason"], rejected[0]["reason"]
    assert "Detected:" in rejected[0]["reason"] and "Fix:" in rejected[0]["reason"]
    assert r.skipped and r.skipped[0][0] == 2 and found in r.skipped[0][1]
    return list(opened)


def inside(paths: list[str], root: str) -> list[str]:
    """The absolute paths not under ``root`` (plain names are opened below a recorded
    directory of it)."""
    return [p for p in paths if os.sep in p and not p.startswith(os.path.abspath(root) + os.sep)
            and p != os.path.abspath(root)]


def test_byte_item_carrying_a_pickle_never_runs(tmp_path: Any) -> None:
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)
    marker = tmp_path / "pwned"
    byte_item_pickle(the_step(tmp_path, 2), "model.b", str(marker))
    restore_falls_back(tmp_path, st, events, "BytesStorageMetadata")
    assert not marker.exists()
    st.close()


def test_storage_data_path_outside_the_step_is_never_opened(tmp_path: Any) -> None:
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)
    outside = str(tmp_path / "elsewhere.distcp")
    storage_outside(the_step(tmp_path, 2), "model.w", outside)
    opened = restore_falls_back(tmp_path, st, events, repr(outside))
    assert outside not in opened
    assert inside(opened, str(tmp_path / "nvme")) == []
    st.close()


def test_manifest_name_with_dotdot_is_refused_by_restore_verify_and_promotion(
        tmp_path: Any) -> None:
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)
    d = the_step(tmp_path, 2)
    outside = os.path.join(os.path.dirname(d), "stolen.distcp")
    name = manifest_dotdot(d, "model.w", outside)
    opened = restore_falls_back(tmp_path, st, events, repr(name))
    assert outside not in opened
    # every other reader of the manifest refuses it too (verify, promotion, retention)
    tier = make_tier("nvme", os.path.dirname(d), {})
    with pytest.raises(UnsafeManifestError, match=r"\.\./stolen"):
        read_manifest(tier, 2)
    with OpenAudit.get().recording() as opened:
        status = check_step(tier, 2, deep=True)
    assert not status.ok and "path separator" in (status.problem or "")
    assert outside not in opened
    st.close()


def test_truncated_shard_with_rewritten_manifest_falls_back(tmp_path: Any) -> None:
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)
    shard = truncated_rewritten(the_step(tmp_path, 2), "model.w")
    restore_falls_back(tmp_path, st, events, f"of {shard!r}, which has")
    st.close()


def test_crafted_copy_on_one_tier_is_reported_and_the_other_copy_restores(
        tmp_path: Any) -> None:
    events: list[dict[str, Any]] = []
    cfg = StoreConfig(nvme_uri=f"{tmp_path}/nvme", lustre_uri=f"{tmp_path}/lustre")
    st = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                     on_event=events.append)
    st.save(1, make_state(1))
    st.wait()
    marker = tmp_path / "pwned"
    byte_item_pickle(the_step(tmp_path, 1), "model.b", str(marker))
    tmpl = blank()
    r = st.restore(tmpl)
    assert r is not None and r.step == 1 and r.tier == "lustre"
    assert torch.equal(tmpl["model"]["b"], make_state(1)["model"]["b"])
    rejected = [e for e in events if e["event"] == "ckpt_rejected"]
    assert rejected and "nvme" in rejected[0]["reason"] and rejected[0]["step"] == 1
    assert not marker.exists()
    st.close()


def test_a_value_declared_larger_than_its_stored_bytes_is_refused_before_allocating(
        tmp_path: Any) -> None:
    """A JSON value's load buffer is allocated from its declared size: 2**62 bytes must be
    refused from .metadata, not attempted."""
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)
    d = the_step(tmp_path, 2)
    md = read_md(d)
    key = next(k for k in md.state_dict_metadata if k.endswith("note"))
    entry = md.state_dict_metadata[key]
    huge = torch.Size([1 << 62])
    md.state_dict_metadata[key] = dataclasses.replace(
        entry, size=huge, chunks=[dataclasses.replace(entry.chunks[0], sizes=huge)])
    write_md(d, md)
    reseal(d)
    restore_falls_back(tmp_path, st, events, f"{key!r} as a torch.uint8 tensor of size "
                                             f"[{1 << 62}]")
    st.close()


def test_a_template_that_does_not_fit_raises_a_restore_error(tmp_path: Any) -> None:
    """Not DCP's CheckpointException (a BaseException that ``except Exception`` misses)."""
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)
    tmpl = {**blank(), "extra": torch.zeros(3)}
    with pytest.raises(RestoreError, match="Missing key in checkpoint state_dict: extra"):
        st.restore(tmpl)
    st.close()


# -- the pieces, on plain DCP directories ------------------------------------------------

def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def test_dcp_byte_item_runs_code_with_the_default_planner_and_never_with_ours(
        tmp_path: Any) -> None:
    """The attack is real: plain DCP runs the pickle. SafeReader and SafeLoadPlanner, each
    on its own, refuse it."""
    marker = tmp_path / "pwned"
    path = str(tmp_path / "ck")
    _quiet(lambda: dcp.save({"w": torch.ones(4), "obj": Payload(str(marker))},
                            checkpoint_id=path, no_dist=True))
    with pytest.raises(UnsafeMetadataError, match="BytesStorageMetadata"):
        SafeReader(path).read_metadata()
    with pytest.raises(BaseException, match="BytesStorageMetadata"):  # DCP wraps it
        _quiet(lambda: dcp.load({"w": torch.zeros(4), "obj": None}, checkpoint_id=path,
                                planner=SafeLoadPlanner(), no_dist=True))
    assert not marker.exists()
    _quiet(lambda: dcp.load({"w": torch.zeros(4), "obj": None}, checkpoint_id=path,
                            no_dist=True))
    assert marker.exists()  # what the default planner does with the same files


def test_safe_reader_refuses_a_byte_range_past_the_end_of_its_file(tmp_path: Any) -> None:
    path = str(tmp_path / "ck")
    _quiet(lambda: dcp.save({"w": torch.ones(1024)}, checkpoint_id=path, no_dist=True))
    (shard,) = glob.glob(f"{path}/*.distcp")
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(BaseException, match="which has 100 bytes"):
        _quiet(lambda: dcp.load({"w": torch.zeros(1024)}, storage_reader=SafeReader(path),
                                planner=SafeLoadPlanner(), no_dist=True))


@pytest.mark.parametrize("name", ["../x.distcp", "/etc/passwd", "a/b", "a\\b", "..", ".",
                                  "", "x\x00y", "x\ny", "y" * 256])
def test_unsafe_manifest_names_are_refused(tmp_path: Any, name: str) -> None:
    with pytest.raises(UnsafeManifestError) as err:
        check_name(name)
    assert isinstance(err.value, ActionableError) and isinstance(err.value, ManifestError)
    assert str(err.value).startswith("Detected:") and repr(name) in str(err.value)
    m = Manifest(step=3, world_size=1, checksum_algo="crc32",
                 files=[FileEntry(name=name, size=1, checksum="00000000", rank=0)])
    with pytest.raises(UnsafeManifestError):
        Manifest.from_json(m.to_json())


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "__17_3.distcp", "a..b"])
def test_plain_names_pass(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("entry,why", [
    ({"size": "12"}, "size"), ({"size": -1}, "size"), ({"rank": True}, "rank"),
    ({"checksum": 7}, "checksum")])
def test_manifest_fields_of_the_wrong_type_are_refused(entry: dict[str, Any], why: str) -> None:
    good = FileEntry(name="__0_0.distcp", size=12, checksum="0000000a", rank=0)
    m = Manifest(step=3, world_size=1, checksum_algo="crc32",
                 files=[FileEntry(**{**good.__dict__, **entry})])
    with pytest.raises(ManifestError, match=why):
        Manifest.from_json(m.to_json())


def test_a_file_listed_twice_is_refused() -> None:
    e = FileEntry(name="__0_0.distcp", size=12, checksum="0000000a", rank=0)
    m = Manifest(step=3, world_size=1, checksum_algo="crc32", files=[e, e])
    with pytest.raises(ManifestError, match="twice"):
        Manifest.from_json(m.to_json())


def test_store_written_steps_hold_tensor_entries_only(tmp_path: Any) -> None:
    """slurmkit never writes a byte item (so refusing them costs nothing): strings, bytes
    and numbers in the state become JSON tensors."""
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)
    md = SafeReader(the_step(tmp_path, 2)).read_metadata()
    assert {type(v).__name__ for v in md.state_dict_metadata.values()} == {
        "TensorStorageMetadata"}
    with open(os.path.join(the_step(tmp_path, 2), MANIFEST), "rb") as f:
        assert Manifest.from_json(f.read()).step == 2
    st.close()
