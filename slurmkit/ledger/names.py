"""Every ledger event's name, once, as a constant (issue 35: event names were compared as
string literals in every reader, where a typo silently matches nothing).

Readers compare with these (``e.get("event") == FAILURE``); the schema
(slurmkit/ledger/events.py: each event's fields) is keyed by them, and ALL is the set of
names it knows (tests/unit/ledger/test_names.py: ALL is EVENTS' keys, and every literal name
passed to a ledger's append anywhere in slurmkit/ and testkit/ is one of them). A new event is
a constant here and its fields in events.py.
"""

from __future__ import annotations

from typing import Final

# --- the CLI (submit, sweep, cancel)
SUBMITTED: Final = "submitted"
CANCEL_REQUESTED: Final = "cancel_requested"
CANCEL_FORCED: Final = "cancel_forced"

# --- node agents (the supervisor)
ALLOCATION_START: Final = "allocation_start"
PREVIOUS_ATTEMPT: Final = "previous_attempt"
CONFIG_WARNING: Final = "config_warning"
STATE: Final = "state"
RANKS_STARTED: Final = "ranks_started"
HEARTBEAT: Final = "heartbeat"
FAILURE: Final = "failure"
HANG_STACKS: Final = "hang_stacks"
DECISION: Final = "decision"
EXCLUSION: Final = "exclusion"
REQUEUE: Final = "requeue"
SUCCESSOR: Final = "successor"
SUCCESSOR_REFUSED: Final = "successor_refused"
CHECKPOINTED_ON_SIGNAL: Final = "checkpointed_on_signal"
END: Final = "end"
CHANNEL_REFUSED: Final = "channel_refused"
SPARE_LOST: Final = "spare_lost"
NODE_KEPT: Final = "node_kept"
AGENT_RELAUNCHED: Final = "agent_relaunched"
AGENT_RELAUNCH_FAILED: Final = "agent_relaunch_failed"
AGENT_ERROR: Final = "agent_error"
RANK_DATA_REFUSED: Final = "rank_data_refused"
REQUEUE_REFUSED: Final = "requeue_refused"
PREFLIGHT: Final = "preflight"
STRAGGLER: Final = "straggler"
LEDGER_WRITE_FAILED: Final = "ledger_write_failed"

# --- rank 0 of the trainer
TRAIN_STARTED: Final = "train_started"
TRAIN_RESUMED: Final = "train_resumed"
TRAIN_STOPPED: Final = "train_stopped"
TRAIN_FINISHED: Final = "train_finished"

# --- the checkpoint store, forwarded by rank 0 (slurmkit.store writes these names itself: a low
# package, it imports nothing of slurmkit.ledger)
CKPT_SAVED: Final = "ckpt_saved"
CKPT_DURABLE: Final = "ckpt_durable"
CKPT_FAILED: Final = "ckpt_failed"
CKPT_DROPPED: Final = "ckpt_dropped"
CKPT_REJECTED: Final = "ckpt_rejected"
CKPT_SKIPPED: Final = "ckpt_skipped"
CKPT_WAITED: Final = "ckpt_waited"
CKPT_FETCHED: Final = "ckpt_fetched"
CKPT_RESTORED: Final = "ckpt_restored"
# --- a program's own saves adopted into the store by the node agents (slurmkit.store.adopt)
CKPT_ADOPTED: Final = "ckpt_adopted"
CKPT_PUT_BACK: Final = "ckpt_put_back"
STORE_EVENT: Final = "store_event"

# --- tests and benchmarks that inject faults
FAULT_INJECTED: Final = "fault_injected"


# every name above (a module-level constant in capitals whose value is its own name in lower case)
ALL: Final[frozenset[str]] = frozenset(
    value for key, value in dict(globals()).items() if key.isupper() and key != "ALL" and isinstance(value, str))
