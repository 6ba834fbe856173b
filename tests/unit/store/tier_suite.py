"""One checkpoint-tier test suite that every backend passes (local path, memory://, S3).

Subclasses provide the ``tier`` fixture; tests/integration/test_store_tier_s3.py runs the very
same class against the real S3 server.
"""

from __future__ import annotations

import os

import pytest

from slurmkit.store.manifest import hash_file
from slurmkit.store.tier import Tier


class TierSuite:
    """Abstract: a subclass defines a ``tier`` fixture returning an empty Tier."""

    def test_put_get_roundtrip(self, tier: Tier, tmp_path: str) -> None:
        src = os.path.join(tmp_path, "src.bin")
        data = os.urandom(3 << 20) + b"tail"
        with open(src, "wb") as f:
            f.write(data)
        tier.put_file(src, "step_0000000001/__0_0.distcp")
        assert tier.exists("step_0000000001/__0_0.distcp")
        assert tier.size("step_0000000001/__0_0.distcp") == len(data)
        dst = os.path.join(tmp_path, "back", "dst.bin")
        tier.get_file("step_0000000001/__0_0.distcp", dst)
        with open(dst, "rb") as f:
            assert f.read() == data

    @pytest.mark.parametrize("algo", ["crc32", "sha256"])
    def test_checksum_is_of_the_stored_bytes(self, tier: Tier, tmp_path: str, algo: str
                                             ) -> None:
        """What a promotion compares after each copy: the destination's own checksum (the
        server's CRC32 on S3 where it has one, else the bytes read back)."""
        src = os.path.join(tmp_path, "src.bin")
        with open(src, "wb") as f:
            f.write(os.urandom(1 << 20))
        tier.put_file(src, "s/f.bin")
        assert tier.checksum("s/f.bin", algo) == hash_file(src, algo)[0]
        tier.write_atomic("s/f.bin", b"other bytes, same name")
        assert tier.checksum("s/f.bin", algo) != hash_file(src, algo)[0]

    def test_ls_lists_children_names(self, tier: Tier) -> None:
        assert tier.ls("") == []
        assert tier.ls("nothing/here") == []
        tier.write_atomic("a/x.json", b"1")
        tier.write_atomic("a/y.json", b"2")
        tier.write_atomic("b/z.json", b"3")
        assert tier.ls("") == ["a", "b"]
        assert tier.ls("a") == ["x.json", "y.json"]

    def test_write_atomic_replaces_content(self, tier: Tier) -> None:
        tier.write_atomic("latest.json", b'{"step": 1}')
        tier.write_atomic("latest.json", b'{"step": 2}')
        with tier.open("latest.json") as f:
            assert f.read() == b'{"step": 2}'
        assert tier.ls("") == ["latest.json"]  # no temp files left behind

    def test_open_write_then_read(self, tier: Tier) -> None:
        with tier.open("d/f.bin", "wb") as f:
            f.write(b"abc" * 1000)
        with tier.open("d/f.bin", "rb") as f:
            assert f.read() == b"abc" * 1000

    def test_rm_file_and_tree_and_missing(self, tier: Tier) -> None:
        tier.write_atomic("s/one", b"1")
        tier.write_atomic("s/sub/two", b"2")
        tier.rm("s/one")
        assert not tier.exists("s/one")
        tier.rm("s", recursive=True)
        assert not tier.exists("s/sub/two")
        tier.rm("never/was", recursive=True)  # missing is fine

    def test_commit_moves_directory(self, tier: Tier) -> None:
        tier.write_atomic(".partial/step_0000000002/a", b"A")
        tier.write_atomic(".partial/step_0000000002/b", b"B")
        tier.commit(".partial/step_0000000002", "step_0000000002")
        assert tier.exists("step_0000000002/a") and tier.exists("step_0000000002/b")
        assert not tier.exists(".partial/step_0000000002/a")
        with tier.open("step_0000000002/b") as f:
            assert f.read() == b"B"

    def test_commit_same_path_is_noop(self, tier: Tier) -> None:
        tier.write_atomic("step_0000000003/a", b"A")
        tier.commit("step_0000000003", "step_0000000003")
        assert tier.exists("step_0000000003/a")

    def test_local_path_matches_kind(self, tier: Tier) -> None:
        p = tier.local_path("x")
        if p is not None:
            assert os.path.isabs(p)
            tier.write_atomic("x", b"1")
            assert os.path.exists(p)
        else:
            assert "://" in tier.uri

    def test_sizes_lists_files_of_one_directory(self, tier: Tier) -> None:
        assert tier.sizes("step_0000000009") == {}
        tier.write_atomic("step_0000000009/a", b"12345")
        tier.write_atomic("step_0000000009/b", b"")
        tier.write_atomic("step_0000000009/sub/c", b"xyz")
        assert tier.sizes("step_0000000009") == {"a": 5, "b": 0}

    def test_get_file_hashed_matches_hash_of_content(self, tier: Tier, tmp_path: str) -> None:
        data = os.urandom((1 << 20) + 17)
        src = os.path.join(tmp_path, "src.bin")
        with open(src, "wb") as f:
            f.write(data)
        tier.put_file(src, "d/f.bin")
        for algo in ("sha256", "crc32"):
            dst = os.path.join(tmp_path, "out", f"{algo}.bin")
            got = tier.get_file_hashed("d/f.bin", dst, algo, len(data))
            assert got == hash_file(src, algo)
            with open(dst, "rb") as f:
                assert f.read() == data
        assert sorted(os.listdir(os.path.join(tmp_path, "out"))) == ["crc32.bin", "sha256.bin"]

    def test_get_file_hashed_reports_a_short_object(self, tier: Tier, tmp_path: str) -> None:
        tier.write_atomic("d/short.bin", b"abc")
        digest, size = tier.get_file_hashed("d/short.bin", os.path.join(tmp_path, "s"),
                                            "crc32", 10)
        assert size == 3
