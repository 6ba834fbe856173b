"""Hostile checkpoints, third round (issue 34, items 1-4): what someone who can write a
step directory does to the process that reads it. Every attack rewrites a step the real
store committed and reseals its manifest (a checksum is no defence).

  1. a ``.metadata`` whose pickle sets attributes on a class (BUILD with slot state): no
     class changes, whatever the load's verdict;
  2. a verified step that does not load (a record rewritten, JSON nested too deep, an entry
     without its fields): restore falls back to the older step, ``store verify`` reports it;
  3. overlapping records that declare more bytes than are stored: refused before any
     buffer is allocated;
  4. links inside a step or in place of one: never followed.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import pickle
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata, planner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from slurmkit.store.catalog import check_step, read_manifest, step_sizes
from slurmkit.store.cli import main as store_cli
from slurmkit.store.json_values import UnsafeValueError, decode
from slurmkit.store.listing import StepSizes
from slurmkit.store.manifest import ManifestError
from slurmkit.store.recovery import _size as recovery_size
from slurmkit.store.retention import gc_tier
from slurmkit.store.safe_reader import SafeReader, UnsafeMetadataError, check_shape, load_metadata
from slurmkit.store.staging import encode_json
from slurmkit.store.tier import make_tier
from tests.unit.store.hostile_steps import (
    entry_without_field,
    garbage_record,
    overlapping_records,
    replace_json,
    shard_link,
)
from tests.unit.store.test_hostile import blank, make_state, saved_store, the_step
from tests.unit.store.test_safe_reader import dcp_save

# -- 1. no class changes ---------------------------------------------------------------

TSM = "torch.distributed.checkpoint.metadata"


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _slot_build(target: bytes, attr: str, value: bytes) -> bytes:
    """``target``; BUILD (None, {attr: value}): pickle's setattr on whatever is on its stack."""
    return b"\x80\x02" + target + b"N}" + _str(attr) + value + b"s\x86b."


def _dict_build(target: bytes, attr: str, value: bytes) -> bytes:
    return b"\x80\x02" + target + b"}" + _str(attr) + value + b"sb."


BLOBS: dict[str, bytes] = {
    "PosixPath._str (the 40-byte .metadata)": _slot_build(
        _global("pathlib", "PosixPath"), "_str", _str("/tmp/attacker")),
    "TensorStorageMetadata.__setstate__": _slot_build(
        _global(TSM, "TensorStorageMetadata"), "__setstate__", _global("pathlib", "PosixPath")),
    "an enum's _missing_": _slot_build(
        _global(TSM, "_MEM_FORMAT_ENCODING"), "_missing_", _global("pathlib", "PosixPath")),
    "ChunkStorageMetadata.__eq__": _slot_build(
        _global(TSM, "ChunkStorageMetadata"), "__eq__", _global("pathlib", "Path")),
}
# BUILD on other objects the old reader happened to refuse (regression guards)
OTHER_BLOBS: dict[str, bytes] = {
    "Metadata.__init__ (dict state)": _dict_build(
        _global(TSM, "Metadata"), "__init__", _global("pathlib", "PurePath")),
    "torch.Size": _slot_build(_global("torch", "Size"), "__len__", _global("torch", "Size")),
    "a dtype": _slot_build(_global("torch", "float32"), "itemsize", _str("x")),
    "enum.Enum": _slot_build(_global("enum", "Enum"), "_missing_", _global("pathlib", "Path")),
    "an instance's class": b"\x80\x02" + _global(TSM, "MetadataIndex") + b")\x81N}"
                           + _str("__class__") + _global("pathlib", "PosixPath") + b"s\x86b.",
}


def _classes() -> list[type]:
    out: list[type] = [pathlib.PurePath, pathlib.PurePosixPath, pathlib.PosixPath,
                       pathlib.Path, pathlib.PureWindowsPath, pathlib.WindowsPath, enum.Enum,
                       torch.Size]
    for mod in (metadata, filesystem, planner):
        out += [o for o in vars(mod).values() if isinstance(o, type)
                and o.__module__ == mod.__name__
                and (dataclasses.is_dataclass(o) or issubclass(o, enum.Enum))]
    return out


def _snapshot() -> dict[type, dict[str, Any]]:
    return {c: dict(vars(c)) for c in _classes()}


def _changes(before: dict[type, dict[str, Any]]) -> list[str]:
    out = []
    for c, attrs in before.items():
        now = dict(vars(c))
        out += [f"{c.__name__}.{k}" for k in set(now) | set(attrs)
                if k not in now or k not in attrs or now[k] is not attrs[k]]
    return out


def _put_back(before: dict[type, dict[str, Any]]) -> None:
    """Undo what a blob did (the old reader let it), so that later tests run on real
    classes."""
    for c, attrs in before.items():
        for k in set(vars(c)) - set(attrs):
            type.__delattr__(c, k)
        for k, v in attrs.items():
            if vars(c).get(k) is not v:
                type.__setattr__(c, k, v)


@pytest.mark.parametrize("blob", list(BLOBS) + list(OTHER_BLOBS))
def test_1_a_refused_metadata_changes_no_class(tmp_path: Any, blob: str) -> None:
    before = _snapshot()
    try:
        with pytest.raises(UnsafeMetadataError):
            load_metadata({**BLOBS, **OTHER_BLOBS}[blob])
        assert _changes(before) == []
        assert str(pathlib.Path("/x/y")) == "/x/y"
        # and a real checkpoint still reads exactly as DCP reads it
        dcp_save(str(tmp_path))
        ours = SafeReader(str(tmp_path)).read_metadata()
        theirs = dcp.FileSystemReader(str(tmp_path)).read_metadata()
        assert ours.state_dict_metadata == theirs.state_dict_metadata
        assert ours.storage_data == theirs.storage_data
    finally:
        _put_back(before)


def test_1_paths_in_metadata_become_str(tmp_path: Any) -> None:
    dcp_save(str(tmp_path))
    md = SafeReader(str(tmp_path)).read_metadata()
    assert md.storage_meta is not None and type(md.storage_meta.checkpoint_id) is str


def test_1_tuples_nested_a_million_deep_are_refused_not_a_segfault() -> None:
    """As a dict key, such a tuple overflows the C stack when hashed (before this, one
    1 MB .metadata killed the process)."""
    blob = b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"K\x01s."
    with pytest.raises(UnsafeMetadataError, match="nests tuples"):
        load_metadata(blob)


@pytest.mark.parametrize("blob, found", [
    (b"\x80\x02N" + b"r\xf0\xff\xff\xff" + b".", "memo entry out of order"),  # 32 GiB memo
    (b"\x80\x02C\x01x.", "opcode 0x43"),  # bytes: DCP metadata holds none
    (b"\x80\x02(cos\nsystem\nX\x01\x00\x00\x00xo.", "opcode 0x6f"),  # OBJ
])
def test_1_opcodes_and_memo_indices_dcp_never_writes_are_refused_before_unpickling(
        blob: bytes, found: str) -> None:
    with pytest.raises(UnsafeMetadataError, match=found):
        load_metadata(blob)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_1_metadata_in_every_pickle_protocol_reads_as_dcp_wrote_it(
        tmp_path: Any, protocol: int) -> None:
    dcp_save(str(tmp_path))
    theirs = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    ours = load_metadata(pickle.dumps(theirs, protocol=protocol))
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data and ours.planner_data == theirs.planner_data


# -- 2. a verified step that does not load: skipped, never a crash -----------------------

def _garbage(d: str, tmp: Any) -> str:
    garbage_record(d, "model.w")
    return "does not load"


def _deep_json(d: str, tmp: Any) -> str:
    replace_json(d, "note", b"[" * 100_000 + b"]" * 100_000)
    return "'note' is not JSON"


def _no_fields(d: str, tmp: Any) -> str:
    entry_without_field(d, "model.b", "chunks")
    return "without its field 'chunks'"


def _wrong_kind(d: str, tmp: Any) -> str:
    replace_json(d, "note", b'{"a": 1}')
    return "'note' is a dict where the template holds a str"


def _manifest_string(d: str, tmp: Any) -> str:
    with open(os.path.join(d, "manifest.json"), "w") as f:
        f.write('"a manifest"')
    return "malformed manifest: a str"


def _manifest_deep(d: str, tmp: Any) -> str:
    with open(os.path.join(d, "manifest.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    return "malformed manifest"


# (verify has no template: a well-formed value of another kind is not a damaged step)
VERIFY_KNOWS = {"a record rewritten, checksum matching", "JSON nested 100000 deep",
                "an entry without its fields", "a manifest that is a string",
                "a manifest nested 100000 deep"}


FAILS_TO_LOAD: dict[str, Callable[[str, Any], str]] = {
    "a record rewritten, checksum matching": _garbage,
    "JSON nested 100000 deep": _deep_json,
    "an entry without its fields": _no_fields,
    "a JSON value of another kind than the template's": _wrong_kind,
    "a manifest that is a string": _manifest_string,
    "a manifest nested 100000 deep": _manifest_deep,
}


@pytest.mark.parametrize("attack", list(FAILS_TO_LOAD))
def test_2_a_verified_step_that_fails_to_load_falls_back_and_verify_reports_it(
        tmp_path: Any, attack: str, capsys: Any) -> None:
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)  # steps 1 and 2, both good
    d = the_step(tmp_path, 2)
    found = FAILS_TO_LOAD[attack](d, tmp_path)
    tmpl = {**blank(), "note": ""}  # a str: step 1's note is one
    r = st.restore(tmpl)
    assert r is not None and r.step == 1, events
    assert torch.equal(tmpl["model"]["w"], make_state(1)["model"]["w"])
    assert tmpl["note"] == "saved at 1"
    (skip,) = [e for e in events if e["event"] in ("ckpt_skipped", "ckpt_rejected")]
    assert skip["step"] == 2 and found in skip["reason"], skip
    st.close()
    if attack in VERIFY_KNOWS:
        nvme = make_tier("nvme", os.path.dirname(d), {})
        assert not check_step(nvme, 2, deep=True, contents=True).ok
        assert store_cli(["verify", os.path.dirname(d)], env={}) == 1  # a red row
        assert "verified" in capsys.readouterr().out  # (step 1's row: the table printed)


# -- 3. memory amplification -----------------------------------------------------------

def test_3_overlapping_records_cannot_declare_more_than_is_stored(tmp_path: Any) -> None:
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)
    declared = overlapping_records(the_step(tmp_path, 2), "note", 256)
    assert declared > 256 * 10
    r = st.restore(blank())
    assert r is not None and r.step == 1
    (ev,) = [e for e in events if e["event"] == "ckpt_rejected"]
    assert ev["step"] == 2 and "overlapping bytes" in ev["reason"], ev
    st.close()


def _md(chunks: list[tuple[int, int]], records: list[tuple[int, str, int, int]],
        size: int = 16) -> Metadata:
    """A one-key Metadata: ``chunks`` (offset, length) of a 1-D float tensor of ``size``,
    ``records`` (chunk offset, file, byte offset, byte length)."""
    entry = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([size]),
                                  [ChunkStorageMetadata(torch.Size([o]), torch.Size([n]))
                                   for o, n in chunks])
    return Metadata({"w": entry}, storage_data={
        MetadataIndex("w", torch.Size([o])): _StorageInfo(f, off, n)
        for o, f, off, n in records})


@pytest.mark.parametrize("md, found", [
    (_md([(0, 16), (8, 8)], [(0, "a", 0, 64), (8, "a", 64, 32)]), "overlap"),
    (_md([(0, 8)], [(0, "a", 0, 64)]), "uncovered"),
    (_md([(0, 8), (8, 8)], [(0, "a", 0, 64), (8, "a", 32, 64)]), "overlapping bytes"),
    (_md([(0, 16)], [(0, "a", 0, 64), (4, "b", 0, 64)]), "where it has no chunk"),
])
def test_3_chunks_must_tile_and_records_must_not_overlap(md: Metadata, found: str) -> None:
    with pytest.raises(UnsafeMetadataError, match=found):
        check_shape(md)


def _md2(boxes: list[tuple[int, int, int, int]]) -> Metadata:
    """A 4x4 float tensor in chunks (row, col, rows, cols), each record 64 bytes of 'a'."""
    entry = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([4, 4]), [
        ChunkStorageMetadata(torch.Size([r, c]), torch.Size([nr, nc])) for r, c, nr, nc in boxes])
    return Metadata({"w": entry}, storage_data={
        MetadataIndex("w", torch.Size([r, c])): _StorageInfo("a", 64 * i, 64)
        for i, (r, c, _, _) in enumerate(boxes)})


def test_3_two_dimensional_chunks_tile_on_a_grid_or_are_refused() -> None:
    check_shape(_md2([(0, 0, 2, 2), (0, 2, 2, 2), (2, 0, 2, 2), (2, 2, 2, 2)]))  # a grid
    check_shape(_md2([(0, 0, 2, 4), (2, 0, 2, 1), (2, 1, 2, 3)]))  # no grid, still a tiling
    with pytest.raises(UnsafeMetadataError, match="overlap"):
        check_shape(_md2([(0, 0, 2, 4), (1, 0, 3, 4)]))
    with pytest.raises(UnsafeMetadataError, match="overlap"):
        check_shape(_md2([(0, 0, 4, 2), (0, 0, 4, 2), (0, 2, 4, 2)]))


def test_3_json_values_have_depth_limits_and_the_templates_kind() -> None:
    assert decode("k", encode_json({"a": [1, 2]}), {}) == {"a": [1, 2]}
    assert decode("k", encode_json(3), 1.5) == 3 and decode("k", encode_json(b"x"), None) == b"x"
    with pytest.raises(UnsafeValueError, match="nests more than"):
        decode("k", torch.tensor(list(b"[" * 70 + b"]" * 70), dtype=torch.uint8), None)
    with pytest.raises(UnsafeValueError, match="is a list where the template holds a str"):
        decode("k", encode_json([1]), "")


# -- 4. links are never followed --------------------------------------------------------

def test_4_a_shard_that_is_a_link_to_a_file_outside_the_step_is_not_read(
        tmp_path: Any) -> None:
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)
    d = the_step(tmp_path, 2)
    outside = str(tmp_path / "outside.distcp")
    name = shard_link(d, "model.w", outside)
    r = st.restore(blank())
    assert r is not None and r.step == 1, events
    assert r.skipped and r.skipped[0][0] == 2 and f"missing shard {name}" in r.skipped[0][1]
    status = check_step(make_tier("nvme", os.path.dirname(d), {}), 2, deep=True)
    assert not status.ok and f"missing shard {name}" in (status.problem or "")
    st.close()


def test_4_a_step_directory_that_is_a_link_is_refused_and_retention_removes_only_the_link(
        tmp_path: Any) -> None:
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)
    st.save(3, make_state(3))
    st.wait()
    d = the_step(tmp_path, 3)
    elsewhere = str(tmp_path / "elsewhere")
    shutil.move(d, elsewhere)
    os.symlink(elsewhere, d)
    r = st.restore(blank())
    assert r is not None and r.step == 2, events
    (ev,) = [e for e in events if e["event"] == "ckpt_rejected"]
    assert ev["step"] == 3 and "link" in ev["reason"], ev
    nvme = make_tier("nvme", os.path.dirname(d), {})
    assert not check_step(nvme, 3, deep=True).ok
    st.save(4, make_state(4))  # a newer verified step: retention may delete step 3's link
    st.wait()
    st.close()
    gc_tier(nvme, keep=1, protected=set())
    assert not os.path.lexists(d)
    assert os.path.exists(os.path.join(elsewhere, "manifest.json"))  # never followed


def _link_shard(d: str, tmp: Any) -> str:
    return shard_link(d, "model.w", str(tmp / "outside.distcp"))


def _link_manifest(d: str, tmp: Any) -> str:
    os.replace(os.path.join(d, "manifest.json"), tmp / "manifest.json")
    os.symlink(tmp / "manifest.json", os.path.join(d, "manifest.json"))
    return "manifest.json"


READERS: dict[str, Callable[[Any, str, str], None]] = {
    "the step listing (restore, verify)": lambda tier, d, name: (
        None if name not in step_sizes(tier, 2) else pytest.fail(f"{name} listed")),
    "a shared tier's per-file lookup": lambda tier, d, name: (
        None if name not in StepSizes(make_tier("lustre", tier.uri, {}), 2)
        else pytest.fail(f"{name} found")),
    "peer recovery's file size": lambda tier, d, name: (
        None if recovery_size(os.path.join(d, name)) == -1 else pytest.fail("followed")),
}


@pytest.mark.parametrize("link", ["shard", "manifest"])
@pytest.mark.parametrize("reader", list(READERS))
def test_4_no_reader_follows_a_link_inside_a_step(tmp_path: Any, reader: str,
                                                  link: str) -> None:
    st = saved_store(tmp_path, [])
    st.close()
    d = the_step(tmp_path, 2)
    name = (_link_shard if link == "shard" else _link_manifest)(d, tmp_path)
    tier = make_tier("nvme", os.path.dirname(d), {})
    READERS[reader](tier, d, name)
    if link == "manifest":
        with pytest.raises(ManifestError):
            read_manifest(tier, 2)
