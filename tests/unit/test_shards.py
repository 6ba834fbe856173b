"""``pytest --shard K/N`` (tests/conftest.py): whole files spread by weight, complementary shards."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import shard_of_files


def test_heaviest_first_onto_the_least_loaded_shard() -> None:
    weights = {"a.py": 100.0, "b.py": 60.0, "c.py": 50.0, "d.py": 10.0}
    where = shard_of_files(weights, 2, {})
    assert where == {"a.py": 1, "b.py": 2, "c.py": 2, "d.py": 1}
    # a shard that starts late (its head start) gets less
    late = shard_of_files(weights, 2, {1: 200.0})
    assert [f for f, k in late.items() if k == 1] == ["d.py"]


def test_shards_of_a_real_collection_are_complementary(tmp_path) -> None:
    def collected(*extra: str) -> set[str]:
        res = subprocess.run([sys.executable, "-m", "pytest", "tests/unit", "-q", "--collect-only",
                              "-p", "no:cacheprovider", "-k", "shards or runfiles or atomic", *extra],
                             capture_output=True, text=True, check=True)
        return {ln for ln in res.stdout.splitlines() if "::" in ln}

    whole = collected()
    one, two = collected("--shard", "1/2"), collected("--shard", "2/2")
    assert one and two and not one & two and one | two == whole


def test_a_bad_shard_is_refused_with_the_fix() -> None:
    res = subprocess.run([sys.executable, "-m", "pytest", "tests/unit/test_shards.py", "--collect-only",
                          "-p", "no:cacheprovider", "--shard", "3/2"], capture_output=True, text=True)
    assert res.returncode != 0 and "Fix: pass --shard K/N" in res.stderr + res.stdout
