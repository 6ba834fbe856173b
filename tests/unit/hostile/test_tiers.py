"""Hostile tier directories (issue 34, item 5): a tier path another user controls is refused
before anything is written, and what the store writes is 0700/0600 whatever the umask.

The tests run as root (chown to another uid works); as another user the cases that need
chown are skipped."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.store.tiertrust import UnsafeTierError, check_tier_path

STRANGER = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _stranger_dir(p: Path, mode: int = 0o755) -> None:
    p.mkdir(parents=True)
    os.chown(p, STRANGER, STRANGER)
    p.chmod(mode)


def _mode(p: Path, mode: int) -> None:
    p.mkdir(parents=True)
    p.chmod(mode)  # explicit: mkdir's mode is filtered by the umask


def _stranger_link(p: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    p.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, p)
    os.lchown(p, STRANGER, STRANGER)


def _own_link(p: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    p.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, p)


# (case id, layout under tmp_path, store.nvme_uri relative to tmp_path, tier kind, expected:
#  a fragment of the refusal, or None when the tier is accepted)
Layout = Callable[[Path], None]
CASES: list[tuple[str, Layout, str, str, str | None]] = [
    # item 5: the victim's directory pre-created by another user in a sticky shared NVMe
    ("item5-precreated-by-stranger",
     lambda r: (_mode(r / "nvme", 0o1777), _stranger_dir(r / "nvme" / "victim", 0o777)),
     "nvme/victim/ckpt", "nvme", f"is owned by uid {STRANGER}"),
    ("item5-world-writable-parent", lambda r: _mode(r / "open", 0o777),
     "open/ckpt", "nvme", "writable by anyone"),
    ("item5-group-writable-parent-local", lambda r: _mode(r / "team", 0o775),
     "team/ckpt", "nvme", "writable by its group"),
    # the tier's own directory sticky and open: others could create the step names first
    ("item5-sticky-tier-root", lambda r: _mode(r / "tmpish", 0o1777),
     "tmpish", "lustre", "writable by anyone"),
    ("item5-strangers-symlink", lambda r: _stranger_link(r / "nvme" / "victim", r / "elsewhere"),
     "nvme/victim/ckpt", "nvme", f"symbolic link owned by uid {STRANGER}"),
    ("item5-tier-root-not-a-directory", lambda r: (r / "file").write_bytes(b"x"),
     "file", "nvme", "is not a directory"),
    # accepted: a sticky shared parent, a link of one's own, a group-writable shared tier
    ("item5-sticky-parent-ok", lambda r: _mode(r / "shared-nvme", 0o1777),
     "shared-nvme/me/ckpt", "nvme", None),
    ("item5-own-symlink-ok", lambda r: _own_link(r / "link", r / "real"),
     "link/ckpt", "nvme", None),
    ("item5-group-writable-lustre-warns", lambda r: _mode(r / "project", 0o2775),
     "project/ckpt", "lustre", None),
    # a shared tier below a colleague's team directory warns; the tier's own must be yours
    ("item5-colleagues-project-lustre-warns", lambda r: _stranger_dir(r / "project", 0o2770),
     "project/ckpt", "lustre", None),
    ("item5-lustre-tier-owned-by-stranger", lambda r: _stranger_dir(r / "theirs", 0o755),
     "theirs", "lustre", f"is owned by uid {STRANGER}"),
]


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    tmp_path.chmod(0o755)  # pytest's own directories are the test user's: trusted
    yield tmp_path


def _open(root: Path, rel: str, kind: str) -> CheckpointStore:
    uri = str(root / rel)
    cfg = StoreConfig(nvme_uri=uri) if kind == "nvme" else StoreConfig(lustre_uri=uri)
    return CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                       sleep=lambda s: None)


def _tree(p: Path) -> set[str]:
    return {str(x) for x in p.rglob("*")} if p.is_dir() else set()


@as_root
@pytest.mark.parametrize("case,layout,rel,kind,refusal", CASES, ids=[c[0] for c in CASES])
def test_hostile_tier_directory(root: Path, case: str, layout: Layout, rel: str, kind: str,
                                refusal: str | None, caplog: pytest.LogCaptureFixture) -> None:
    layout(root)
    before = _tree(root)
    if refusal is not None:
        with pytest.raises(UnsafeTierError) as err:
            _open(root, rel, kind)
        text = str(err.value)
        assert refusal in text and "Detected:" in text and "Fix:" in text
        assert _tree(root) == before  # refused before anything was written
        return
    store = _open(root, rel, kind)
    try:
        store.save(1, {"w": torch.ones(4)})
        store.wait()
    finally:
        store.close()
    tier = Path(os.path.realpath(root / rel))
    assert any(p.name.startswith("step_") for p in tier.rglob("*"))
    if kind == "lustre":
        assert "group-writable" in caplog.text and str(root / "project") in caplog.text


def test_store_writes_private_modes_whatever_the_umask(tmp_path: Path) -> None:
    """Every directory the store creates is 0700 and every file 0600, even under umask 000
    (before: 0777/0666 minus the umask, i.e. world-readable shards)."""
    old = os.umask(0)
    try:
        cfg = StoreConfig(nvme_uri=f"{tmp_path}/nvme", lustre_uri=f"{tmp_path}/lustre",
                          lustre_every_saves=1)
        store = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                            sleep=lambda s: None)
        try:
            store.save(1, {"w": torch.ones(64), "b": b"x"}, final=True)
            store.wait()
        finally:
            store.close()
    finally:
        os.umask(old)
    made = [p for t in ("nvme", "lustre") for p in (tmp_path / t).rglob("*")]
    made += [tmp_path / "nvme", tmp_path / "lustre", tmp_path / "nvme" / "n0"]
    assert any(p.name.endswith(".distcp") for p in made)
    assert any(p.parent.name == "lustre" or "lustre" in p.parts for p in made if p.is_file())
    wrong = {str(p): oct(stat.S_IMODE(p.lstat().st_mode)) for p in made
             if stat.S_IMODE(p.lstat().st_mode) != (0o700 if p.is_dir() else 0o600)}
    assert wrong == {}


def test_check_reports_warnings_not_refusals_for_a_shared_group_tier(tmp_path: Path) -> None:
    _mode(tmp_path / "proj", 0o2770)
    warnings = check_tier_path("lustre", str(tmp_path / "proj" / "ckpt"), shared=True)
    assert len(warnings) == 1 and str(tmp_path / "proj") in warnings[0]
    with pytest.raises(UnsafeTierError, match="writable by its group"):
        check_tier_path("nvme", str(tmp_path / "proj" / "ckpt"), shared=False)


def test_scratch_tier_of_another_user_is_refused(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The scratch tier (no local tier configured) under a node-local base: a stranger's
    directory at the base is refused, not written into."""
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    _stranger_dir(tmp_path / "scratch", 0o777)
    cfg = StoreConfig(object_uri="memory://hostile-scratch", scratch_dir=str(tmp_path / "scratch"))
    with pytest.raises(UnsafeTierError, match=f"owned by uid {STRANGER}"):
        CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                    sleep=lambda s: None)
    assert list((tmp_path / "scratch").iterdir()) == []


def test_a_group_writable_directory_of_the_users_private_group_is_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """umask 002 sites: a 0775 directory whose group is the user's private group (named after
    the user, no other member) is writable by the user alone; any other group is refused."""
    import grp
    import pwd

    from slurmkit.store import tiertrust

    if os.geteuid() != 0:
        pytest.skip("chgrp to an arbitrary group needs root")
    _mode(tmp_path / "mine", 0o775)
    os.chown(tmp_path / "mine", -1, 4242)
    me = pwd.getpwuid(os.geteuid()).pw_name
    members: list[str] = []
    monkeypatch.setattr(tiertrust.grp, "getgrgid",
                        lambda g: grp.struct_group((me, "x", g, members)))
    assert check_tier_path("nvme", str(tmp_path / "mine" / "ckpt")) == []
    members.append("someone-else")
    with pytest.raises(UnsafeTierError, match="writable by its group"):
        check_tier_path("nvme", str(tmp_path / "mine" / "ckpt"))
