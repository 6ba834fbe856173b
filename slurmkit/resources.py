"""Where the data that ships with slurmkit lives: the Hydra configs and the sbatch templates.

In the repository they stay at the top level (``conf/``, ``sbatch_templates/``); setup.py maps
them into the package as ``slurmkit.conf`` and ``slurmkit.sbatch_templates``, so a wheel carries
them and an installed slurmkit reads them through importlib.resources, wherever it is installed
and whatever the working directory.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

SHIPPED = ("conf", "sbatch_templates")


def packaged(name: str) -> Path:
    """The shipped directory ``name`` (one of SHIPPED) of the slurmkit that is imported, as a real
    directory on disk (Hydra and jinja read directories; pip unpacks wheels).

    Installed from a wheel, it is package data inside slurmkit/, found through importlib.resources.
    Imported from a source tree (a checkout, or an exported copy of one put first on PYTHONPATH)
    there is no slurmkit/conf/: the data is that tree's top-level directory, marked as the package
    by its ``__init__.py``. It is taken from the tree the code came from, so a copy never mixes its
    code with the configs of the checkout an editable install points at.
    """
    if name not in SHIPPED:
        raise ValueError(f"{name!r} is not shipped data; one of {SHIPPED}")
    package_dir = Path(__file__).resolve().parent
    source_tree = package_dir.parent / name
    if not (package_dir / name).is_dir() and (source_tree / "__init__.py").is_file():
        return source_tree
    root = importlib.resources.files(f"slurmkit.{name}")
    if not isinstance(root, Path):  # a zipped install: nothing here can read from a zip
        raise RuntimeError(f"slurmkit.{name} is not a directory on disk ({root!r}); install "
                           "slurmkit unpacked (pip install does)")
    return root
