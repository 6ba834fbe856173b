"""The tier suite on a local path and on memory://, plus URI handling."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from slurmkit.errors import ConfigError
from slurmkit.store.tier import FsspecTier, expand_env, make_tier
from tests.unit.store.tier_suite import TierSuite


class TestLocalTier(TierSuite):
    @pytest.fixture
    def tier(self, tmp_path: str) -> FsspecTier:
        return make_tier("lustre", f"{tmp_path}/tier", env={})


class TestMemoryTier(TierSuite):
    @pytest.fixture
    def tier(self) -> FsspecTier:
        return make_tier("object", f"memory://tiers/{uuid.uuid4().hex}", env={})


def test_expand_env_uses_injected_mapping() -> None:
    env = {"USER": "ada", "SLURM_JOB_ID": "42"}
    assert expand_env("/nvme/$USER/${SLURM_JOB_ID}/ck", env) == "/nvme/ada/42/ck"


def test_expand_env_unset_is_config_error() -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_ID"):
        expand_env("/nvme/$SLURM_JOB_ID", {})


def test_s3_tier_takes_credentials_from_env_only() -> None:
    env = {"AWS_ACCESS_KEY_ID": "k1", "AWS_SECRET_ACCESS_KEY": "s1",
           "SLURMKIT_S3_ENDPOINT": "http://127.0.0.1:1", "USER": "ada"}
    t = make_tier("object", "s3://bucket/$USER/ck", env)
    assert t.uri == "s3://bucket/ada/ck"
    assert t.fs.key == "k1" and t.fs.secret == "s1"
    assert t.fs.client_kwargs["endpoint_url"] == "http://127.0.0.1:1"
    assert "s1" not in repr(t)


def test_unknown_protocol_is_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot be opened"):
        make_tier("object", "nosuchproto://x/y", {})


def test_sizes_leaves_out_a_file_that_vanishes_while_listing(tmp_path: Any,
                                                             monkeypatch: Any) -> None:
    """Another rank renaming its temporary manifest into place between our listing and our
    stat must not make the whole directory look empty (it once did: 'missing shard')."""
    d = tmp_path / "t" / "step"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * 5)
    (d / "manifest.json.tmp-1").write_bytes(b"{}")
    real_scandir = os.scandir

    class Listing:
        def __init__(self, path: str | int) -> None:  # the local tier lists through an fd
            with real_scandir(path) as it:
                self.entries = list(it)
            os.remove(d / "manifest.json.tmp-1")  # renamed away meanwhile

        def __enter__(self) -> list[Any]:
            return self.entries

        def __exit__(self, *exc: Any) -> None:
            return None

    monkeypatch.setattr(os, "scandir", Listing)
    tier = make_tier("nvme", str(tmp_path / "t"), {})
    assert tier.sizes("step") == {"__0_0.distcp": 5}
    assert tier.sizes("absent") == {}
