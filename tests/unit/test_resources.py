"""The configs and templates are those of the slurmkit that is imported: package data inside an
installed package, the top-level directories of a source tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurmkit.resources import packaged

REPO = Path(__file__).resolve().parents[2]
PROBE = ("import json, slurmkit.resources as r; from slurmkit.config import compose; "
         "print(json.dumps([str(r.packaged('conf')), str(r.packaged('sbatch_templates')), "
         "compose(['+exp=tiny', 'cluster=local']).train.steps]))")


def _probe(pythonpath: Path, cwd: Path) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SLURMKIT_CONF_DIR")}
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=str(cwd), capture_output=True, text=True,
                         timeout=300, env={**env, "PYTHONPATH": str(pythonpath)})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _copy_code(dest: Path) -> None:
    shutil.copytree(REPO / "slurmkit", dest / "slurmkit", ignore=shutil.ignore_patterns("__pycache__"))


def test_the_running_slurmkit_has_its_configs_and_templates() -> None:
    assert (packaged("conf") / "config.yaml").is_file()
    assert (packaged("sbatch_templates") / "setup.sh.j2").is_file()
    with pytest.raises(ValueError):
        packaged("tests")


def test_a_copy_of_the_source_tree_uses_its_own_configs(tmp_path) -> None:
    tree = tmp_path / "tree"
    _copy_code(tree)
    for d in ("conf", "sbatch_templates"):
        shutil.copytree(REPO / d, tree / d, ignore=shutil.ignore_patterns("__pycache__"))
    tiny = tree / "conf" / "exp" / "tiny.yaml"
    tiny.write_text(tiny.read_text().replace("steps: 60", "steps: 5"))
    (tmp_path / "elsewhere").mkdir()
    conf, templates, steps = _probe(tree, tmp_path / "elsewhere")
    assert (conf, templates, steps) == (str(tree / "conf"), str(tree / "sbatch_templates"), 5)


def test_an_installed_layout_reads_package_data(tmp_path) -> None:
    site = tmp_path / "site"  # what a wheel unpacks: the data inside the package directory
    _copy_code(site)
    for d in ("conf", "sbatch_templates"):
        shutil.copytree(REPO / d, site / "slurmkit" / d, ignore=shutil.ignore_patterns("__pycache__"))
    conf, templates, steps = _probe(site, tmp_path)
    assert (conf, templates, steps) == (str(site / "slurmkit" / "conf"),
                                        str(site / "slurmkit" / "sbatch_templates"), 60)
