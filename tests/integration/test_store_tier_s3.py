"""The same tier suite against the real S3 server (SeaweedFS through s3fs)."""

from __future__ import annotations

import uuid

import pytest

from slurmkit.store.tier import FsspecTier, make_tier
from testkit.s3server import S3Server
from tests.unit.store.tier_suite import TierSuite

pytestmark = pytest.mark.integration


class TestS3Tier(TierSuite):
    @pytest.fixture
    def tier(self, s3_server: S3Server) -> FsspecTier:
        # credentials travel in the env mapping, never in the URI or a config file
        return make_tier("object", f"s3://{s3_server.bucket}/tiers/{uuid.uuid4().hex}",
                         env=s3_server.env())

    def test_renames_atomically_is_false(self, tier: FsspecTier) -> None:
        assert not tier.renames_atomically()
        assert tier.local_path("x") is None
