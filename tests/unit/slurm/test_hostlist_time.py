"""Hostlist expressions and Slurm time strings: tables plus round-trip properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurmkit.errors import ConfigError
from slurmkit.slurm.parsers import (
    compress_hostlist,
    expand_hostlist,
    format_time_limit,
    parse_time_limit,
)

EXPAND_CASES = [
    ("gpu[001-004,010]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"]),
    ("node[1-3],login1", ["node1", "node2", "node3", "login1"]),
    ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("rack[1-2]-gpu[01-02],spare", ["rack1-gpu01", "rack1-gpu02", "rack2-gpu01", "rack2-gpu02",
                                    "spare"]),
    ("node1", ["node1"]),
    ("node[7]", ["node7"]),
    ("n[1-2]x", ["n1x", "n2x"]),
    ("(null)", []),
    ("None assigned", []),
    ("", []),
]


@pytest.mark.parametrize("expr,names", EXPAND_CASES)
def test_expand(expr: str, names: list[str]) -> None:
    assert expand_hostlist(expr) == names


COMPRESS_CASES = [
    (["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"], "gpu[001-004,010]"),
    (["node3", "node1", "node2", "login1"], "login1,node[1-3]"),
    (["node9", "node10", "node11"], "node[9-11]"),
    (["n08", "n09", "n10", "n9"], "n[08-10,9]"),
    (["node1", "node1"], "node1"),
    (["login"], "login"),
    ([], ""),
]


@pytest.mark.parametrize("names,expr", COMPRESS_CASES)
def test_compress(names: list[str], expr: str) -> None:
    assert compress_hostlist(names) == expr


@pytest.mark.parametrize("expr", [
    "node[1-", "node]1[", "node[a-b]", "node[3-1]", "node[[1-2]]", "node[1-2],,x",
    "node[1-2000000]", "n[1-1000]-m[1-1001]"])
def test_expand_rejects_malformed(expr: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand_hostlist(expr)
    assert "Detected:" in str(info.value) and "Fix:" in str(info.value)


def test_compress_rejects_bracketed_names() -> None:
    with pytest.raises(ConfigError):
        compress_hostlist(["node[1-2]"])


host_names = st.builds(
    lambda prefix, digits: prefix + digits,
    st.sampled_from(["node", "gpu", "a1-b", "rack2-n", "login", "x"]),
    st.one_of(st.just(""), st.integers(0, 300).map(str),
              st.integers(0, 300).map(lambda n: f"{n:03d}")),
)


@given(st.lists(host_names, max_size=40))
def test_hostlist_round_trip(names: list[str]) -> None:
    expr = compress_hostlist(names)
    expanded = expand_hostlist(expr)
    assert sorted(expanded) == sorted(set(names))
    assert compress_hostlist(expanded) == expr


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=60))
def test_compress_is_short_for_consecutive_runs(numbers: list[int]) -> None:
    names = [f"gpu{n:04d}" for n in numbers]
    expr = compress_hostlist(names)
    runs = sum(1 for n in set(numbers) if n - 1 not in set(numbers))
    assert expr.count(",") == runs - 1  # one item per maximal run of consecutive numbers


TIME_CASES = [
    ("90", 5400), ("0", 0), ("1:30", 90), ("01:00:00", 3600), ("100:00:00", 360000),
    ("2-3", 183600), ("2-03:04", 183840), ("2-03:04:05", 183845), ("0-00:00:01", 1),
    ("UNLIMITED", None), ("INFINITE", None), (" 30 ", 1800),
]


@pytest.mark.parametrize("text,seconds", TIME_CASES)
def test_parse_time(text: str, seconds: int | None) -> None:
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", [
    "", "abc", "1-", "-5", "1:2:3:4", "1:60", "1:60:00", "2-24", "2-03:60", "1.5", "1h"])
def test_parse_time_rejects(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_time_limit(text)
    message = str(info.value)
    assert "Detected:" in message and "Requirement:" in message and "Fix:" in message


@pytest.mark.parametrize("seconds,text", [
    (0, "00:00:00"), (59, "00:00:59"), (3600, "01:00:00"), (86399, "23:59:59"),
    (86400, "1-00:00:00"), (183845, "2-03:04:05"), (None, "UNLIMITED")])
def test_format_time(seconds: int | None, text: str) -> None:
    assert format_time_limit(seconds) == text


def test_format_time_rejects_negative() -> None:
    with pytest.raises(ValueError):
        format_time_limit(-1)


@given(st.one_of(st.none(), st.integers(0, 400 * 86400)))
def test_time_round_trip(seconds: int | None) -> None:
    assert parse_time_limit(format_time_limit(seconds)) == seconds
