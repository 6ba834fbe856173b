"""Ranks as threads on one real TCPStore, for the store's coordination tests: each rank gets its
own store client (as each process has its own), and a rank's exception fails the test."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def store_clients(n: int, prefix: str, timeout_s: float) -> tuple[Any, list[Any]]:
    """The server and ``n`` clients of a fresh TCPStore, each client under ``prefix``."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout_s),
                           wait_for_workers=False)
    clients = [dist.PrefixStore(prefix, dist.TCPStore(
        "127.0.0.1", server.port, None, False, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False)) for _ in range(n)]
    return server, clients


def run_ranks(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for ranks 0..n-1 at once, one thread each; their results in rank order."""
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
