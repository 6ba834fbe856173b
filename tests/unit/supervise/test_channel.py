"""The typed channel: the run token's file, keys nobody can guess, values nobody can forge,
validation of what is read, and a store that listens on node 0's address only."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from slurmkit.launch.rendezvous import listen_socket
from slurmkit.supervise.channel import Channel, ChannelError, load_token, token_path
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence
from slurmkit.supervise.policy import Action, Decision

NODES = ("node1", "node2", "node3")


def channel(store=None, token: bytes = b"k" * 32, attempt: str = "42-0") -> Channel:  # noqa: ANN001
    return Channel(store if store is not None else dist.HashStore(), attempt, token, NODES)


# ------------------------------------------------------------------ the token file
def test_the_first_agent_creates_a_0600_token_and_the_others_read_the_same(tmp_path: Path) -> None:
    t = load_token(str(tmp_path), create=True)
    st = os.stat(token_path(str(tmp_path)))
    assert st.st_mode & 0o777 == 0o600 and len(t) == 32
    assert load_token(str(tmp_path), create=False) == t
    assert load_token(str(tmp_path), create=True) == t  # a requeued job keeps the run's token
    assert load_token(str(tmp_path / "other"), create=True) != t


def test_a_token_others_can_read_is_refused(tmp_path: Path) -> None:
    load_token(str(tmp_path), create=True)
    os.chmod(token_path(str(tmp_path)), 0o644)
    with pytest.raises(ChannelError, match="mode 0644") as e:
        load_token(str(tmp_path), create=False)
    assert "Requirement:" in str(e.value) and "Fix:" in str(e.value)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_token_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    load_token(str(tmp_path), create=True)
    os.chown(token_path(str(tmp_path)), 4321, 4321)
    with pytest.raises(ChannelError, match="owned by uid 4321"):
        load_token(str(tmp_path), create=False)


def test_a_symlinked_or_garbled_token_is_refused(tmp_path: Path) -> None:
    (tmp_path / "rdzv").mkdir()
    (tmp_path / "elsewhere").write_text("aa" * 32)
    os.symlink(tmp_path / "elsewhere", token_path(str(tmp_path)))
    with pytest.raises(ChannelError):
        load_token(str(tmp_path), create=False)
    os.unlink(token_path(str(tmp_path)))
    fd = os.open(token_path(str(tmp_path)), os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"not hex")
    os.close(fd)
    with pytest.raises(ChannelError, match="32-byte hex token"):
        load_token(str(tmp_path), create=False)


def test_a_missing_token_says_where_it_should_be(tmp_path: Path) -> None:
    with pytest.raises(ChannelError, match="no agents' token"):
        load_token(str(tmp_path), create=False)


# ------------------------------------------------------------------ keys and values
def test_keys_depend_on_token_and_attempt_and_hold_neither() -> None:
    a, b, c = channel(token=b"a" * 32), channel(token=b"b" * 32), channel(token=b"a" * 32, attempt="42-1")
    assert len({a.prefix, b.prefix, c.prefix}) == 3
    assert "42-0" not in a.prefix and (b"a" * 32).hex() not in a.prefix and "a" * 8 not in a.prefix


def test_messages_round_trip() -> None:
    ch = channel()
    assert ch.failure(0) is None and ch.decision(0) is None
    ch.post_failure(0, "node2", 5, FailureClass.NCCL_TIMEOUT)
    ch.post_failure(0, "node3", 7, FailureClass.RANK_CRASH)  # the first failure stands
    f = ch.failure(0)
    assert f is not None and (f.node, f.rank, f.cls) == ("node2", 5, FailureClass.NCCL_TIMEOUT)
    ev = [Evidence(1.5, "node2", 5, "line", FailureClass.NCCL_TIMEOUT, "Watchdog caught collective timeout")]
    ch.post_evidence(0, 1, ev)
    assert ch.evidence(0, 1) == ev and ch.has_evidence(0, 1) and not ch.has_evidence(0, 2)
    d = Decision(Action.REPLACE_NODE, "node2 twice", ("node2",))
    ch.post_decision(0, d)
    ch.post_decision(0, Decision(Action.STOP, "a second decider"))  # set once
    assert ch.decision(0) == d
    ch.post_port(3, 29511)
    assert ch.wait_port(3, 5) == 29511
    ch.post_addr(2, "10.0.0.3")
    assert ch.addr(2) == "10.0.0.3"
    ch.post_finished(0, "completed")
    ch.post_finished(0, "signalled")
    assert ch.finished(0) == (1, 1) and ch.finished(1) == (0, 0)
    ch.seed_beats(range(3))
    ch.beat(1, 9)
    assert ch.beats([0, 1, 2]) == {0: 0, 1: 9, 2: 0}
    assert ch.arrive_exit() == 1 and ch.arrive_exit() == 2 and ch.exited() == 2


def test_a_value_signed_with_another_token_is_refused_and_removed() -> None:
    store = dist.HashStore()
    ours, theirs = channel(store), channel(store, token=b"x" * 32)
    key = ours._gen(0, "decision")  # noqa: SLF001 - the stranger learned the key name
    store.set(key, theirs._seal(key, {"action": "stop", "reason": "forged", "exclude": []}))  # noqa: SLF001
    with pytest.raises(ChannelError, match="wrong HMAC"):
        ours.decision(0)
    assert ours.decision(0) is None  # cleared: node 0's own decision can still land
    ours.post_decision(0, Decision(Action.RESTART, "real"))
    assert ours.decision(0) == Decision(Action.RESTART, "real")


def test_a_value_moved_to_another_key_is_refused() -> None:
    store = dist.HashStore()
    ch = channel(store)
    ch.post_failure(0, "node2", 1, FailureClass.USER_ERROR)
    store.set(ch._gen(1, "fail"), store.get(ch._gen(0, "fail")))  # noqa: SLF001 - replayed into gen 1
    with pytest.raises(ChannelError, match="wrong HMAC"):
        ch.failure(1)


@pytest.mark.parametrize("raw", [b"n1:0:gpu_oom", b"{}", b'{"p": 1, "mac": 2}', b"x" * (1 << 21)])
def test_unsealed_values_are_refused(raw: bytes) -> None:
    store = dist.HashStore()
    ch = channel(store)
    store.set(ch._gen(0, "fail"), raw)  # noqa: SLF001
    with pytest.raises(ChannelError):
        ch.failure(0)


def test_signed_but_malformed_messages_are_refused() -> None:
    store = dist.HashStore()
    ch = channel(store)

    def put(name: str, value: object) -> None:
        key = ch._gen(0, name)  # noqa: SLF001 - a buggy agent, with the token
        store.set(key, ch._seal(key, value))  # noqa: SLF001

    put("decision", {"action": "stop", "reason": "x", "exclude": ["node9"]})
    with pytest.raises(ChannelError, match="node9"):
        ch.decision(0)
    put("decision", {"action": "reboot", "reason": "x", "exclude": []})
    with pytest.raises(ChannelError, match="malformed decision"):
        ch.decision(0)
    put("evidence/1", [{"time": 0, "node": "node1", "rank": "x", "kind": "line", "cls": "hang", "detail": ""}])
    with pytest.raises(ChannelError, match="malformed evidence"):
        ch.evidence(0, 1)
    put("port", 70000)
    with pytest.raises(ChannelError, match="port 70000"):
        ch.wait_port(0, 1)
    store.set(ch._alive(2), "lots")  # noqa: SLF001
    with pytest.raises(ChannelError, match="beat counter"):
        ch.beats([2])


# ------------------------------------------------------------------ the store's address
def test_the_store_listens_on_the_given_address_only() -> None:
    sock = listen_socket("127.0.0.1")
    port = sock.getsockname()[1]
    assert sock.getsockname()[0] == "127.0.0.1"
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10),
                          wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10), use_libuv=True)
    channel(store).post_port(0, 1234)
    assert channel(client).wait_port(0, 5) == 1234
    # 127.0.0.2 is this host too, but not the address the store was bound to.
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.2", port))
    sock.close()


# ------------------------------------------------------------------ O(1) per agent: waits, counters, one read
class Recorder:
    """A store that logs each round trip (method, keys); ``fail`` makes every call raise."""

    def __init__(self, store: object) -> None:
        self.store, self.calls, self.fail = store, [], False
        self.in_wait = threading.Event()

    def __getattr__(self, name: str):  # noqa: ANN204
        attr = getattr(self.store, name)

        def call(*args: object, **kw: object) -> object:
            keys = args[0] if args and isinstance(args[0], list) else [args[0]] if args else []
            self.calls.append((name, tuple(keys)))
            if self.fail:
                raise RuntimeError("Connection reset by peer")  # as torch's DistNetworkError says it
            if name == "wait":
                self.in_wait.set()
            return attr(*args, **kw)

        return call


def test_a_follower_blocks_on_the_decision_and_reads_it_once_when_posted() -> None:
    store = dist.HashStore()
    rec = Recorder(store)
    follower, node0 = channel(rec), channel(store)
    got: list[Decision | None] = []
    t = threading.Thread(target=lambda: got.append(follower.wait_decision(0, 3600)))
    t.start()
    rec.in_wait.wait()  # blocked in the store's wait, not polling
    node0.post_decision(0, Decision(Action.REPLACE_NODE, "spare", ("node2",)))
    t.join()
    assert got == [Decision(Action.REPLACE_NODE, "spare", ("node2",))]
    key = follower._gen(0, "decision")  # noqa: SLF001
    # Two round trips in all, whatever N: the wait, and one read that cannot block.
    assert rec.calls == [("wait", (key,)), ("compare_set", (key,))]


def test_a_decision_wait_that_times_out_is_none_and_a_broken_store_raises() -> None:
    rec = Recorder(dist.HashStore())
    ch = channel(rec)
    assert ch.wait_decision(0, 0.01) is None
    key = ch._gen(0, "decision")  # noqa: SLF001
    assert rec.calls == [("wait", (key,)), ("check", (key,))]  # the timeout told from a broken store
    rec.fail = True
    with pytest.raises(RuntimeError, match="reset by peer"):
        ch.wait_decision(0, 0.01)


def test_a_forged_decision_under_the_wait_is_refused_deleted_and_the_real_one_still_lands() -> None:
    store = dist.HashStore()
    ours, theirs = channel(store), channel(store, token=b"x" * 32)
    key = ours._gen(0, "decision")  # noqa: SLF001
    store.set(key, theirs._seal(key, {"action": "stop", "reason": "forged", "exclude": []}))  # noqa: SLF001
    with pytest.raises(ChannelError, match="wrong HMAC"):
        ours.wait_decision(0, 1)
    assert store.get(key) == b""  # cleared (compare-and-clear: never another agent's value)
    assert ours.wait_decision(0, 0.2) is None  # a cleared value is no decision, and no hot loop
    ours.post_decision(0, Decision(Action.RESTART, "real"))
    assert ours.wait_decision(0, 1) == Decision(Action.RESTART, "real")


@pytest.mark.parametrize("name", ["fail", "evidence/1", "decision"])
def test_a_squatter_who_wrote_a_set_once_key_first_does_not_block_the_agents_message(name: str) -> None:
    store = dist.HashStore()
    ours, theirs = channel(store), channel(store, token=b"x" * 32)
    key = ours._gen(0, name)  # noqa: SLF001
    store.set(key, theirs._seal(key, {"node": "node1", "rank": 0, "cls": "gpu_oom"}))  # noqa: SLF001
    ours.post_failure(0, "node2", 3, FailureClass.RANK_CRASH)
    ours.post_evidence(0, 1, [Evidence(1.0, "node1", 0, "exit", FailureClass.RANK_CRASH, "rc 1")])
    ours.post_decision(0, Decision(Action.RESTART, "real"))
    assert ours.failure(0).node == "node2"  # type: ignore[union-attr]
    assert ours.evidence(0, 1)[0].detail == "rc 1"  # type: ignore[index]
    assert ours.decision(0) == Decision(Action.RESTART, "real")


def test_a_legitimate_first_message_stands_against_a_second_agent() -> None:
    store = dist.HashStore()
    a, b = channel(store), channel(store)
    a.post_decision(0, Decision(Action.RESTART, "first"))
    b.post_decision(0, Decision(Action.STOP, "second"))
    assert b.decision(0) == Decision(Action.RESTART, "first")


def test_failures_and_finishes_move_one_change_counter() -> None:
    ch = channel()
    assert ch.changes(0) == 0
    ch.post_finished(0, "completed")
    ch.post_failure(0, "node2", 5, FailureClass.NCCL_TIMEOUT)
    assert ch.changes(0) == 2 and ch.changes(1) == 0


def test_all_evidence_is_one_read_and_a_forged_value_comes_back_refused_and_removed() -> None:
    store = dist.HashStore()
    rec = Recorder(store)
    ch, theirs = channel(rec), channel(store, token=b"x" * 32)
    for nr in (0, 1):
        ch.post_evidence(0, nr, [Evidence(1.0, NODES[nr], nr, "exit", FailureClass.RANK_CRASH, f"rc {nr}")])
    assert not ch.has_all_evidence(0, [0, 1, 2])
    key = ch._gen(0, "evidence/2")  # noqa: SLF001
    store.set(key, theirs._seal(key, []))  # noqa: SLF001
    assert ch.has_all_evidence(0, [0, 1, 2]) and ch.has_all_evidence(0, [])
    rec.calls.clear()
    got = ch.all_evidence(0, [0, 1, 2])
    assert [e.detail for e in got[0]] == ["rc 0"] and [e.detail for e in got[1]] == ["rc 1"]  # type: ignore[union-attr]
    assert isinstance(got[2], ChannelError) and "wrong HMAC" in str(got[2])
    assert [c[0] for c in rec.calls] == ["multi_get", "compare_set"]  # one read for every node
    assert ch.evidence(0, 2) is None and not ch.has_all_evidence(0, [0, 1, 2])  # cleared: not a report


def test_a_forged_value_cleared_by_one_agent_never_blocks_another_reading_it() -> None:
    """Two agents read a forged failure; the first clears it. The second's read must not wait
    for the key (check-then-get did: the get then blocked for the store's whole timeout)."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=600))
    a, b, theirs = channel(store), channel(store), channel(store, token=b"x" * 32)
    key = a._gen(0, "fail")  # noqa: SLF001
    store.set(key, theirs._seal(key, {"node": "node1", "rank": 0, "cls": "gpu_oom"}))  # noqa: SLF001
    real_check = store.check

    class ClearsBetween:  # the other agent clears the key right after this one's check
        def __getattr__(self, name: str) -> object:
            return getattr(store, name)

        def check(self, keys: list[str]) -> bool:
            found = real_check(keys)
            with pytest.raises(ChannelError):
                a.failure(0)
            return bool(found)

    b.store = ClearsBetween()
    done = threading.Event()
    got: list[object] = []

    def read() -> None:
        try:
            got.append(b.failure(0))
        except ChannelError as exc:  # it saw the forged value itself: refused, as it should be
            got.append(exc)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(60), "the read blocked on a key another agent cleared"
    assert got[0] is None or isinstance(got[0], ChannelError)
    b.store = store
    a.post_failure(0, "node2", 3, FailureClass.RANK_CRASH)
    assert b.failure(0).node == "node2"  # type: ignore[union-attr]


# ------------------------------------------------------------------ a hang's stacks
def test_no_agent_passes_the_stacks_barrier_before_the_last_one_took_its_stacks() -> None:
    """On a hang every node takes its ranks' stacks, then kills them: a node that killed its
    ranks while another still read its own made that node's ranks crash out of the collective
    (their stacks showed the exit handlers: a CI failure on the local cluster)."""
    store = dist.HashStore()
    passed: list[int] = []
    gate = threading.Event()

    def agent(nr: int) -> None:
        if nr == 2:
            gate.wait(30)  # the slow node, still taking its stacks
        assert channel(store).stacks_taken(0, 3, 30)
        passed.append(nr)

    threads = [threading.Thread(target=agent, args=(nr,)) for nr in range(3)]
    for t in threads:
        t.start()
    ch = channel(store)
    deadline = time.monotonic() + 30
    while ch._count(ch._gen(0, "stacks")) < 2:  # noqa: SLF001 - the two fast ones arrived
        assert time.monotonic() < deadline
        threads[0].join(0.01)
    assert passed == []  # both wait for the slow one
    gate.set()
    for t in threads:
        t.join(30)
    assert sorted(passed) == [0, 1, 2]


def test_a_lost_agent_costs_the_stacks_barrier_its_timeout_only() -> None:
    ch = channel(dist.HashStore())
    assert ch.stacks_taken(0, 2, 0.05) is False  # the other never comes: the stop goes ahead
