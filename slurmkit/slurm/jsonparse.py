"""``sacct --json`` into the same :class:`SacctRow` records the text parser gives.

Where the site has Slurm's data_parser plugins (slurmkit.slurm.capabilities probes
``--json``), accounting is read as JSON: field names instead of column positions, and no
text to split. The text parser (``--parsable2``) stays the fallback: a site without the
plugins, or a document this module does not understand, is read as text.

One parser for the shapes Slurm's releases print (facts from SchedMD's OpenAPI plugin
documentation; the 22.05 shape is also read from the local cluster in the tests):

* data_parser v0.0.38 (22.05): numbers are plain (``"return_code": 0``), states are strings
  (``"state": {"current": "COMPLETED"}``, a step's ``"state": "FAILED"``), a step's id is its
  bare name (``"batch"``, ``"0"``), an unset time is 0.
* v0.0.39 and later (23.02-25.11): numbers are ``{"set": true, "infinite": false, "number": N}``
  (unset: ``"set": false``); from v0.0.40 (23.11) states are lists of flags
  (``"current": ["COMPLETED"]``) and ``exit_code.status`` too; a step's id is
  ``"<job>.<step>"``.

Every value is untrusted text from outside the process: a document of an unexpected shape
raises :class:`SlurmParseError` (the client then reads text), never a KeyError or TypeError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from types import MappingProxyType
from typing import Any

from slurmkit.slurm.errors import SlurmParseError
from slurmkit.slurm.records import SacctRow

__all__ = ["parse_sacct_json"]

_MAX_EPOCH = 253402300799  # 9999-12-31: beyond it a time is not a time


def _number(value: Any) -> int | None:
    """An integer in either shape; None when unset, infinite or absent."""
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite", False):
            return None
        value = value.get("number")
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise SlurmParseError("an integer (or {set, number})", repr(value)[:80])


def _states(value: Any) -> list[str]:
    """A state in either shape: "COMPLETED" or ["COMPLETED", ...]; [] when absent."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value.strip().upper()] if value.strip() else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [v.strip().upper() for v in value if v.strip()]
    raise SlurmParseError("a state (a string or a list of strings)", repr(value)[:80])


_NONE = frozenset({"", "None", "(null)", "None assigned", "N/A"})  # as the text columns print "none"


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise SlurmParseError("a string", repr(value)[:80])
    return None if value.strip() in _NONE else value


def _time(value: Any) -> datetime | None:
    """Epoch seconds (either shape) as naive local time, as the text parser reads sacct's."""
    seconds = _number(value)
    if not seconds or seconds < 0 or seconds > _MAX_EPOCH:
        return None
    return datetime.fromtimestamp(seconds)


def _exit(value: Any) -> tuple[int | None, int | None]:
    """(code, signal) as sacct's ExitCode column "code:signal" gives them."""
    if value is None:
        return None, None
    if not isinstance(value, Mapping):
        raise SlurmParseError("an exit_code object", repr(value)[:80])
    code = _number(value.get("return_code"))
    signal = value.get("signal")
    sig = _number(signal.get("signal_id")) if isinstance(signal, Mapping) else None
    status = _states(value.get("status"))
    if "SIGNALED" in status:  # the text column prints 0:<signal> for a signalled process
        return (code if code is not None else 0), (sig if sig is not None else 0)
    return code, (sig if sig is not None else (0 if code is not None else None))


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SlurmParseError(what, repr(value)[:80])
    return value


def _obj(value: Any) -> Mapping[str, Any]:
    """An optional object: {} when absent or not an object."""
    return value if isinstance(value, Mapping) else {}


def _job_id(job: Mapping[str, Any]) -> tuple[str, int | None]:
    """The id as sacct's text prints it (``123``, ``123_4``, ``123+1``) and the het offset."""
    base = _number(job.get("job_id"))
    if base is None:
        raise SlurmParseError("a job_id", repr(job.get("job_id"))[:80])
    array, het = _obj(job.get("array")), _obj(job.get("het"))
    task = _number(array.get("task_id"))
    offset = _number(het.get("job_offset"))
    if task is not None and _number(array.get("job_id")):
        return f"{_number(array.get('job_id'))}_{task}", None
    if offset is not None and _number(het.get("job_id")):
        return f"{_number(het.get('job_id'))}+{offset}", offset
    return str(base), None


_FAILED = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"})


def _row(job_id: str, base: str, step: str | None, het: int | None, name: str, states: list[str],
         reason: str | None, exit_code: Any, times: Mapping[str, Any], nodes: str | None,
         failed_node: str | None = None) -> SacctRow:
    code, sig = _exit(exit_code)
    if code == 0 and not sig and _FAILED.intersection(states):
        # 22.05's v0.0.38 prints a failed step's or job's exit code as SUCCESS/0 (the text
        # columns said 9:0, 3:0): a document that contradicts itself says nothing about the code.
        code, sig = None, None
    raw = {"JobID": job_id, "JobName": name, "State": " ".join(states), "NodeList": nodes or ""}
    return SacctRow(
        job_id=job_id, base_job_id=base, step=step, het_offset=het, name=name,
        state=states[0] if states else "UNKNOWN", by_uid=None, exit_code=code, exit_signal=sig,
        start=_time(times.get("start")), end=_time(times.get("end")),
        elapsed_s=_number(times.get("elapsed")), node_list=nodes, restarts=None, reason=reason,
        raw=MappingProxyType(raw), failed_node=failed_node or None)


def _step_rows(job: Mapping[str, Any], job_id: str, base: str, het: int | None) -> list[SacctRow]:
    rows = []
    steps = job.get("steps") or []
    if not isinstance(steps, list):
        raise SlurmParseError("a list of steps", repr(steps)[:80])
    for item in steps:
        s = _mapping(item, "a step object")
        ident = _mapping(s.get("step"), "a step's 'step' object")
        raw_id = ident.get("id")  # 22.05: "batch" or 0 (an int for numbered steps)
        sid = str(raw_id) if isinstance(raw_id, int) and not isinstance(raw_id, bool) else _text(raw_id)
        sid = sid or _text(ident.get("name"))
        if sid is None:
            raise SlurmParseError("a step id", repr(ident)[:80])
        sid = sid.split(".", 1)[1] if "." in sid else sid  # v0.0.40+: "<job>.<step>"
        nodes = s.get("nodes")
        node_list = _text(nodes.get("range")) if isinstance(nodes, Mapping) else _text(nodes)
        times = _obj(s.get("time"))
        rows.append(_row(f"{job_id}.{sid}", base, sid, het, _text(ident.get("name")) or sid,
                         _states(s.get("state")), None, s.get("exit_code"), times, node_list))
    return rows


def parse_sacct_json(text: str) -> list[SacctRow]:
    """Rows of ``sacct --json`` (each job, then its steps), as :func:`parse_sacct` gives them."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise SlurmParseError("a JSON document from sacct --json", text[:80]) from exc
    doc = _mapping(doc, "a JSON object")
    jobs = doc.get("jobs")
    if not isinstance(jobs, list):
        raise SlurmParseError("a 'jobs' list", repr(jobs)[:80])
    rows: list[SacctRow] = []
    for item in jobs:
        job = _mapping(item, "a job object")
        job_id, het = _job_id(job)
        base = job_id.partition("+")[0]
        state = job.get("state")
        current = _states(state.get("current")) if isinstance(state, Mapping) else _states(state)
        reason = _text(state.get("reason")) if isinstance(state, Mapping) else None
        times = _obj(job.get("time"))
        nodes = job.get("nodes")
        rows.append(_row(job_id, base, None, het, _text(job.get("name")) or "", current, reason,
                         job.get("exit_code"), times, _text(nodes) if not isinstance(nodes, Mapping) else None,
                         _text(job.get("failed_node"))))  # 23.02+; "" when no node failed
        rows += _step_rows(job, job_id, base, het)
    return rows
