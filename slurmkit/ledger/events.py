"""Every event the run's ledger may hold: its name and its fields, checked at append.

The ledger is the one record an engineer reads after a bad night (``slurmkit report``, the
figures, ``status``); a misspelt name or a step written as a string would silently drop out of
every figure derived from it. So each event has one entry here: the fields every reader relies
on (required), the other fields it may carry, each with its JSON type. Events written by the
supervisor and the CLI are closed (an unknown field is an error: a typo); those the checkpoint
store and the fault injectors write are open (they carry tier-specific detail that only a human
reads), but their known fields are still typed.

A record that does not match raises :class:`EventError` in the writer, where the bug is, never
in a reader hours later.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slurmkit.ledger import names

# JSON types by name. "num" is int or float; a trailing "?" also allows null.
_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "num": (int, float), "str": (str,), "bool": (bool,),
    "list": (list, tuple), "dict": (dict,), "any": (object,),
}
RESERVED = frozenset({"t", "event", "source"})  # set by the ledger itself


class EventError(ValueError):
    """A ledger record that is not one of the events below (a bug in its writer)."""


@dataclass(frozen=True)
class EventSpec:
    required: Mapping[str, str]
    optional: Mapping[str, str] = field(default_factory=dict)
    open: bool = False  # extra fields allowed (any JSON value)

    def type_of(self, name: str) -> str | None:
        return self.required.get(name) or self.optional.get(name)


def _spec(required: str = "", optional: str = "", *, open: bool = False) -> EventSpec:
    """``"step:int generation:int"`` -> {"step": "int", "generation": "int"}."""
    def parse(text: str) -> dict[str, str]:
        return dict(item.split(":", 1) for item in text.split())
    return EventSpec(parse(required), parse(optional), open)


_STORE_COMMON = "rank:int node:str time:num uri:str? bytes:int? seconds:num? reason:any from_tier:str"

EVENTS: dict[str, EventSpec] = {
    # --- the CLI (submit, sweep, cancel)
    names.SUBMITTED: _spec("", "job_id:str executor:str name:str nodes:int ranks_per_node:int "
                               "config_hash:str array_job_id:str array_task_id:int sweep_dir:str "
                               "overrides:list resumes:str commit:str"),
    names.CANCEL_REQUESTED: _spec("", "job_id:str checkpoint:bool by:str job_state:str"),
    names.CANCEL_FORCED: _spec("", "job_id:str waited_s:num"),
    # --- node agents (the supervisor)
    names.ALLOCATION_START: _spec("", "job_id:str attempt:str restart_count:int nodes:list "
                                      "train_nodes:list spares:list executor:str predecessor:str"),
    # what ended a requeued job's previous attempt (slurmkit.supervise.exits.previous), at its next start
    names.PREVIOUS_ATTEMPT: _spec("attempt:str handled_by:str outcome:str",
                                  "nodes:list ended:num queued_s:num held_s:num failed_node:str"),
    names.CONFIG_WARNING: _spec("message:str"),
    names.STATE: _spec("old:str new:str", "why:str"),
    # warm: per rank, whether it started from a warm standby (slurmkit.launch.standby)
    names.RANKS_STARTED: _spec("generation:int", "node:str slot:int ranks:list pids:list "
                                                 "heartbeat_dir:str warm:list"),
    # metrics, total_steps: rank 0's figures and the run's length (slurmkit.userapi), on its node's samples
    names.HEARTBEAT: _spec("generation:int node:str steps:dict", "metrics:dict total_steps:int"),
    # line: the failing rank's last word, bounded (slurmkit.failures.classify.telling_line)
    names.FAILURE: _spec("cls:str", "generation:int rank:int node:str evidence:str time_of_fault:num "
                                    "ranks_affected:list slurm_view:list stack:str in_collective:bool? "
                                    "line:str"),
    # A hung generation's stacks, by the agent of each node with ranks (slurmkit.launch.stackdump):
    # per rank {rank, pid, place, source, where, wait, lines (at most 40)}.
    names.HANG_STACKS: _spec("generation:int node:str ranks:list"),
    # straggler: the figures of a straggler moved onto a spare (slurmkit.supervise.straggler_move).
    names.DECISION: _spec("action:str", "generation:int reason:str exclude:list straggler:dict"),
    names.EXCLUSION: _spec("nodes:list how:str", "train_nodes:list"),
    names.REQUEUE: _spec("reason:str", "job_id:str exclude:list"),
    # the requeue as a successor job (slurmkit.supervise.exits.successor): the run goes on in job_id
    names.SUCCESSOR: _spec("job_id:str predecessor:str", "exclude:list reason:str"),
    names.SUCCESSOR_REFUSED: _spec("reason:str", "fallback:str generation:int"),
    names.CHECKPOINTED_ON_SIGNAL: _spec("", "generation:int signal:str? step:int?"),
    names.END: _spec("status:str", "exit_code:int generation:int reason:str signal:str? job_id:str "
                                   "job_state:str"),
    names.CHANNEL_REFUSED: _spec("detail:str", "generation:int node:str"),
    names.SPARE_LOST: _spec("node:str", "why:str silent_s:num"),
    names.NODE_KEPT: _spec("node:str why:str", "generation:int slurm_state:str?"),
    # a lost agent's node kept and its agent relaunched in the allocation (slurmkit.supervise.relaunch):
    # ``generation`` is the one it joins; ``failed``: the relaunch did not bring it back (or its cap
    # was used), node 0 fell back to a spare or a requeue keeping the node
    names.AGENT_RELAUNCHED: _spec("node:str node_rank:int generation:int relaunch:int",
                                  "slot:int first_beat_s:num command:list log:str"),
    names.AGENT_RELAUNCH_FAILED: _spec("node:str why:str", "node_rank:int generation:int relaunch:int"),
    names.AGENT_ERROR: _spec("node:str error:str", "generation:int node_rank:int"),
    # a record a rank (or anything else) wrote that a reader refused: the file, and why
    names.RANK_DATA_REFUSED: _spec("file:str reason:str", "node:str count:int"),
    names.REQUEUE_REFUSED: _spec("reason:str", "generation:int failure_requeues:int max_requeues:int "
                                               "excluded:list partition:str? partition_nodes:int? needed:int"),
    names.PREFLIGHT: _spec("node:str verdict:str", "generation:int duration_s:num waited_s:num checks:list"),
    names.STRAGGLER: _spec("node:str score:num", "generation:int rank:int own_s:num job_median_s:num "
                                                 "windows:int step:int sections:dict threshold:num action:str "
                                                 "plan:str"),
    names.LEDGER_WRITE_FAILED: _spec("failures:int error:str", "errno:str? first_failure_t:num "
                                                                "held:int dropped:int node:str"),
    # --- rank 0 of the trainer
    # node, by: written by rank 0's agent for a program its adapter reads (slurmkit.launch.programwatch)
    names.TRAIN_STARTED: _spec("step:int", "generation:int world_size:int strategy:str node:str by:str"),
    names.TRAIN_RESUMED: _spec("step:int", "tier:str? generation:int", open=True),
    names.TRAIN_STOPPED: _spec("step:int", "signal:int? generation:int"),
    names.TRAIN_FINISHED: _spec("step:int", "param_sha256:str generation:int"),
    # --- the checkpoint store (forwarded by rank 0)
    names.CKPT_SAVED: _spec("step:int", "tier:str " + _STORE_COMMON, open=True),
    names.CKPT_DURABLE: _spec("step:int", "tier:str " + _STORE_COMMON, open=True),
    names.CKPT_FAILED: _spec("tier:str", "step:int? " + _STORE_COMMON, open=True),
    names.CKPT_DROPPED: _spec("step:int", "tier:str " + _STORE_COMMON, open=True),
    names.CKPT_REJECTED: _spec("step:int?", "tier:str phase:str " + _STORE_COMMON, open=True),
    names.CKPT_SKIPPED: _spec("step:int?", "tier:str phase:str " + _STORE_COMMON, open=True),
    names.CKPT_WAITED: _spec("step:int", "waited_s:num " + _STORE_COMMON, open=True),
    names.CKPT_FETCHED: _spec("step:int", "tier:str " + _STORE_COMMON, open=True),
    names.CKPT_RESTORED: _spec("step:int", "tier:str " + _STORE_COMMON, open=True),
    names.STORE_EVENT: _spec("", _STORE_COMMON, open=True),  # a store event without a name
    # --- a program's saves adopted by the agents (slurmkit.launch.adoption)
    names.CKPT_ADOPTED: _spec("step:int tier:str", "node:str files:int bytes:int seconds:num origin:str", open=True),
    names.CKPT_PUT_BACK: _spec("step:int tier:str", "generation:int node:str slot:int bytes:int seconds:num",
                               open=True),
    # --- tests and benchmarks that inject faults
    names.FAULT_INJECTED: _spec("kind:str", "time:num rank:int step:int node:str", open=True),
}


def from_store(event: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A checkpoint store event as (ledger event name, fields). The store calls the tier a copy
    came from ``source``; in the ledger ``source`` is the writer, so it becomes ``from_tier``."""
    fields = {k: v for k, v in event.items() if k not in RESERVED}
    if "source" in event:
        fields["from_tier"] = event["source"]
    return str(event.get("event") or names.STORE_EVENT), fields


def _matches(value: Any, type_name: str) -> bool:
    nullable = type_name.endswith("?")
    base = type_name.rstrip("?")
    if value is None:
        return nullable
    if base in ("int", "num") and isinstance(value, bool):
        return False  # True is an int to Python, never a step
    if isinstance(value, float) and not math.isfinite(value):
        return False  # NaN/inf are not JSON
    return isinstance(value, _TYPES[base])


def validate(event: str, fields: Mapping[str, Any]) -> None:
    """Raise EventError unless ``event`` with ``fields`` is a known, well-typed event."""
    spec = EVENTS.get(event)
    if spec is None:
        raise EventError(f"unknown ledger event {event!r} (add its name to slurmkit/ledger/names.py "
                         "and its fields here, slurmkit/ledger/events.py)")
    clash = RESERVED & set(fields)
    if clash:
        raise EventError(f"ledger event {event!r}: field(s) {sorted(clash)} are set by the ledger")
    missing = [k for k in spec.required if k not in fields]
    if missing:
        raise EventError(f"ledger event {event!r} lacks required field(s) {missing}")
    for name, value in fields.items():
        type_name = spec.type_of(name)
        if type_name is None:
            if not spec.open:
                raise EventError(f"ledger event {event!r} has no field {name!r} "
                                 f"(known: {sorted({**spec.required, **spec.optional})})")
            continue
        if not _matches(value, type_name):
            raise EventError(f"ledger event {event!r}: {name}={value!r} is not {type_name}")


def check_read(rec: Mapping[str, Any]) -> str | None:
    """Why a record read back (from the ledger, or a rank's spool) cannot be used, else None.

    Readers take ``t`` as a number and every known field as its type: a line that says
    otherwise (written by hand, by an older or hostile writer) is refused as a whole. Unknown
    events and fields pass (a later version's; no reader looks at them), and so does a missing
    field: readers ask with ``get``, and hand-written test ledgers omit them."""
    t, event = rec.get("t"), rec.get("event")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        return f"t={t!r:.40} is not a time"
    if not isinstance(event, str):
        return f"event={event!r:.40} is not a name"
    if "source" in rec and not isinstance(rec["source"], str):
        return "source is not a string"
    spec = EVENTS.get(event)
    if spec is None:
        return None
    for name, type_name in (*spec.required.items(), *spec.optional.items()):
        if name in rec and not _matches(rec[name], type_name):
            return f"{event}: {name}={rec[name]!r:.40} is not {type_name}"
    return None


def encode(record: Mapping[str, Any]) -> bytes:
    """One JSONL line. NaN/inf are refused (no JSON reader takes them); an object in an open
    event's free-form detail is written as its string, as before the schema existed."""
    try:
        return (json.dumps(record, allow_nan=False, default=str) + "\n").encode()
    except (TypeError, ValueError) as exc:
        raise EventError(f"ledger event {record.get('event')!r} is not JSON: {exc}") from exc
