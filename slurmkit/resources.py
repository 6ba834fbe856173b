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
    """The shipped directory ``name`` (one of SHIPPED) as a real directory on disk.

    Hydra and jinja read directories, and an installed wheel is unpacked, so the resource is a
    plain path. A checkout imported without installing it (``python -m slurmkit.submit`` with
    the checkout as working directory, or an editable install made before these directories
    became package data) has no ``slurmkit.conf`` module; its top-level directory is the same
    data, recognised by the ``__init__.py`` that marks it as the package.
    """
    if name not in SHIPPED:
        raise ValueError(f"{name!r} is not shipped data; one of {SHIPPED}")
    try:
        root = importlib.resources.files(f"slurmkit.{name}")
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parent.parent / name
        if (checkout / "__init__.py").is_file():
            return checkout
        raise
    if not isinstance(root, Path):  # a zipped install: nothing here can read from a zip
        raise RuntimeError(f"slurmkit.{name} is not a directory on disk ({root!r}); install "
                           "slurmkit unpacked (pip install does)")
    return root
