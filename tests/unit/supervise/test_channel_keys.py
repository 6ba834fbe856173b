"""The agents' store keys come from one table, ChannelCore.KEY_* (issue 35: one source per fact)."""

from __future__ import annotations

import ast
import inspect
import string

from slurmkit.supervise import channel, channelbase
from slurmkit.supervise.channel import Channel
from slurmkit.supervise.channelbase import ChannelCore

TABLE = {k: v for k, v in vars(ChannelCore).items() if k.startswith("KEY_")}
FIELDS = {"node", "tick", "slot", "a", "b", "gen"}


def test_the_table_names_each_family_once() -> None:
    assert len(set(TABLE.values())) == len(TABLE) > 20
    for name, family in TABLE.items():
        fields = {f for _, f, _, _ in string.Formatter().parse(family) if f}
        assert fields <= FIELDS, (name, family)
        assert (name == "KEY_GENERATION") == ("gen" in fields)


def test_the_table_has_a_line_saying_who_writes_and_who_reads_each_family() -> None:
    lines = inspect.getsource(ChannelCore).splitlines()
    for name in TABLE:
        line = next(x for x in lines if x.strip().startswith(f"{name} = "))
        assert "#" in line and ("->" in line or name in ("KEY_GENERATION", "KEY_LINK_PAIR")), line


def _calls(module: object) -> list[ast.Call]:
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("_key", "_gen")]


def test_every_key_is_built_from_the_table() -> None:
    """No method spells a key: each call of _key or _gen names its family as self.KEY_... (or a
    choice between two), and no f-string of channel.py joins the prefix itself."""
    for call in _calls(channel) + _calls(channelbase):
        family = call.args[0] if call.func.attr == "_key" else call.args[1]  # type: ignore[attr-defined]
        if isinstance(family, ast.JoinedStr):  # _gen's own: <KEY_GENERATION>/<family>
            assert "KEY_GENERATION" in ast.unparse(family)
            continue
        names = [n.attr for n in ast.walk(family) if isinstance(n, ast.Attribute)]
        assert names and all(n.startswith("KEY_") for n in names), ast.unparse(call)
    source = inspect.getsource(channel)
    assert "self.prefix}" not in source and "{self.prefix" not in source


def test_keys_are_spelled_as_before() -> None:
    """The table changed where keys are spelled, not what they are."""
    ch = Channel(store=None, attempt="42-0", token=b"t" * 32, nodes=["n0", "n1", "n2"])
    p = ch.prefix
    assert ch._gen(3, ch.KEY_FAIL) == f"{p}/g3/fail"  # noqa: SLF001
    assert ch._evidence_key(3, 2) == f"{p}/g3/evidence/2"  # noqa: SLF001
    assert ch._alive(2) == f"{p}/alive/2" and ch._addr(1) == f"{p}/addr/1"  # noqa: SLF001
    assert ch._exit() == f"{p}/exit" and ch._window_key(2) == f"{p}/steps/2"  # noqa: SLF001
    assert ch._tick_key(7) == f"{p}/clock/7" and ch._rejoin_key(1) == f"{p}/rejoin/1"  # noqa: SLF001
    assert ch._link_key(3, 1) == f"{p}/g3/linkfig/1"  # noqa: SLF001
    assert ch.link_prefix(3, 0, 1) == f"{p}/g3/link/0-1/"
