"""Schema of the checkpoint store config (conf/store/). Owned by the store package."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StoreConfig:
    # fsspec URIs; "" disables a tier. Environment variables ($SLURM_JOB_ID, $USER) expand.
    nvme_uri: str = ""
    lustre_uri: str = ""
    object_uri: str = ""
