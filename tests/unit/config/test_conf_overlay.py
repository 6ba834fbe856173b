"""A site's conf directory (SLURMKIT_CONF_DIR) overlays the packaged configs: its files win, the
packaged ones fill in the rest."""

from __future__ import annotations

import os

import pytest

from slurmkit.config import available, compose
from slurmkit.config.compose import conf_dirs
from slurmkit.errors import ConfigError
from slurmkit.resources import packaged


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMKIT_CONF_DIR", str(tmp_path))
    return tmp_path


def _write(root, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_packaged_configs_alone_without_a_site_dir(monkeypatch) -> None:
    monkeypatch.delenv("SLURMKIT_CONF_DIR", raising=False)
    assert conf_dirs() == [str(packaged("conf"))]
    cfg = compose(["+exp=tiny", "cluster=local"])
    assert (cfg.job.name, cfg.cluster.name, cfg.train.steps) == ("tiny", "local", 60)


def test_a_site_adds_a_cluster_and_the_packaged_files_fill_the_rest(site) -> None:
    _write(site, "cluster/mysite.yaml", "name: mysite\nkind: local\nkill_wait_s: 45\n")
    assert "mysite" in available("cluster") and "dgx_h100" in available("cluster")
    cfg = compose(["+exp=tiny", "cluster=mysite"])  # config.yaml and exp/tiny from the package
    assert (cfg.cluster.name, cfg.cluster.kill_wait_s, cfg.job.name, cfg.model.name) == \
        ("mysite", 45, "tiny", compose(["+exp=tiny", "cluster=local"]).model.name)


def test_a_site_file_wins_over_the_packaged_one(site) -> None:
    text = (packaged("conf") / "exp" / "tiny.yaml").read_text().replace("steps: 60", "steps: 7")
    _write(site, "exp/tiny.yaml", text)
    _write(site, "config.yaml", (packaged("conf") / "config.yaml").read_text()
           .replace("cluster: auto", "cluster: local"))
    cfg = compose(["+exp=tiny"])
    assert (cfg.train.steps, cfg.cluster.name) == (7, "local")
    assert compose(["+exp=tiny", "train.steps=9"]).train.steps == 9  # overrides still apply last


def test_an_unknown_option_names_both_directories(site) -> None:
    (site / "cluster").mkdir()
    with pytest.raises(ConfigError) as exc:
        compose(["+exp=tiny", "cluster=nowhere"])
    assert os.path.join(str(site), "cluster") in str(exc.value)
    assert os.path.join(str(packaged("conf")), "cluster") in str(exc.value)


def test_a_missing_site_dir_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLURMKIT_CONF_DIR", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="SLURMKIT_CONF_DIR=.*not a directory"):
        compose(["+exp=tiny"])
