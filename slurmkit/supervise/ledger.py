"""The run's event ledger: one JSONL file per run that survives requeues.

Every process of the run (submitter, node agents, rank 0 of the trainer) appends whole lines
with O_APPEND, so concurrent writers on one node never interleave inside a line (POSIX appends
of one write() under PIPE_BUF-ish sizes land atomically on local file systems and NFS/Lustre
with O_APPEND). Every figure about a run (goodput, MTTR, lost work) is derived from it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

LEDGER_NAME = "ledger.jsonl"


class Ledger:
    """Append-only JSONL event log at ``path``; ``clock`` returns epoch seconds."""

    def __init__(self, path: str, *, source: str = "", clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.source = source
        self._clock = clock
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"t": round(self._clock(), 6), "event": event}
        if self.source:
            record["source"] = self.source
        record.update(fields)
        line = (json.dumps(record, sort_keys=False, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record


def read_ledger(path: str) -> Iterator[dict[str, Any]]:
    """Yield the events of a ledger; a torn last line (writer killed mid-write) is skipped."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
