"""sacct --json read into the same records as the text columns (slurmkit.slurm.jsonparse).

The 22.05 pair is one real capture of the same jobs both ways (tests/data/slurm/README.md): the
JSON rows must equal the text rows field by field, except where 22.05's JSON contradicts itself
(a FAILED step with exit code SUCCESS/0, text 9:0): there the code is unknown, never a wrong 0.
The v0.0.40 document has the shape SchedMD documents for 23.11 and later (numbers as
{set, infinite, number}, states as lists, step ids "<job>.<step>")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmkit.slurm.capabilities import SiteCapabilities
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmParseError
from slurmkit.slurm.jsonparse import parse_sacct_json
from slurmkit.slurm.parsers import SACCT_FIELDS, parse_sacct
from slurmkit.slurm.runner import CommandResult

DATA = Path(__file__).resolve().parents[2] / "data" / "slurm"
FIELDS = ("job_id", "base_job_id", "step", "het_offset", "name", "state", "exit_code", "exit_signal", "start",
          "end", "elapsed_s", "node_list", "reason")


def test_json_rows_equal_the_text_rows_of_the_same_jobs() -> None:
    text = parse_sacct((DATA / "sacct_22.05.txt").read_text(), SACCT_FIELDS)
    rows = parse_sacct_json((DATA / "sacct_22.05.json").read_text())
    # sacct orders the two forms differently: rows are matched by (id, start)
    by_key = {(r.job_id, r.start): r for r in rows}
    assert len(by_key) == len(rows) == len(text) and set(by_key) == {(r.job_id, r.start) for r in text}
    contradicted = []
    for t in text:
        j = by_key[(t.job_id, t.start)]
        for f in FIELDS:
            if getattr(t, f) != getattr(j, f):
                assert f in ("exit_code", "exit_signal") and getattr(j, f) is None, (t.job_id, f)
                contradicted.append(t.job_id)
    assert sorted(set(contradicted)) == ["3.batch", "8.0"]  # FAILED steps, JSON code SUCCESS/0
    runs = sorted((r for r in rows if r.job_id == "3"), key=lambda r: r.start)
    assert [r.state for r in runs] == ["REQUEUED", "COMPLETED"]  # --duplicates: both runs of job 3
    cancelled = next(r for r in rows if r.job_id == "10")  # cancelled while pending: "None assigned"
    assert cancelled.state == "CANCELLED" and cancelled.node_list is None and cancelled.by_uid is None


def _v40(state: list[str], code: int, signal: int | None = None) -> str:
    def num(n: int | None) -> dict:
        return {"set": n is not None, "infinite": False, "number": n or 0}
    step = {"step": {"id": "77.batch", "name": "batch"}, "state": state, "nodes": {"range": "gpu[001-002]"},
            "exit_code": {"status": ["SIGNALED"] if signal else (["SUCCESS"] if code == 0 else ["ERROR"]),
                          "return_code": num(code), "signal": {"id": num(signal), "name": "KILL"} if signal else {}},
            "time": {"elapsed": 30, "start": num(1800000000), "end": num(1800000030)}}
    job = {"job_id": 77, "name": "llama", "state": {"current": state, "reason": "None"}, "nodes": "gpu[001-002]",
           "exit_code": {"status": ["ERROR"], "return_code": num(code)},
           "array": {"job_id": 0, "task_id": {"set": False, "infinite": False, "number": 0}},
           "het": {"job_id": 0, "job_offset": {"set": False, "infinite": False, "number": 0}},
           "time": {"elapsed": 30, "start": 1800000000, "end": 1800000030}, "steps": [step]}
    return json.dumps({"meta": {"plugin": {"type": "openapi/v0.0.40"}}, "jobs": [job]})


def test_the_23_11_shape_numbers_lists_and_step_ids() -> None:
    job, step = parse_sacct_json(_v40(["NODE_FAIL", "REQUEUED"], 1))
    assert (job.job_id, job.state, job.exit_code, job.node_list, job.elapsed_s) == ("77", "NODE_FAIL", 1, "gpu[001-002]", 30)
    assert job.nodes == ["gpu001", "gpu002"] and job.raw["State"] == "NODE_FAIL REQUEUED"
    assert (step.job_id, step.step, step.base_job_id, step.state, step.exit_code) == ("77.batch", "batch", "77", "NODE_FAIL", 1)
    assert step.start is not None and (step.end - step.start).total_seconds() == 30


def test_array_tasks_and_het_components_are_named_as_the_text_prints_them() -> None:
    doc = json.loads(_v40(["COMPLETED"], 0))
    doc["jobs"][0]["array"] = {"job_id": 70, "task_id": {"set": True, "infinite": False, "number": 4}}
    assert parse_sacct_json(json.dumps(doc))[0].job_id == "70_4"
    doc["jobs"][0]["array"] = {"job_id": 0, "task_id": None}
    doc["jobs"][0]["het"] = {"job_id": 75, "job_offset": 1}
    row = parse_sacct_json(json.dumps(doc))[0]
    assert (row.job_id, row.het_offset, row.base_job_id) == ("75+1", 1, "75")


@pytest.mark.parametrize("doc", [
    "not json", "[]", '{"jobs": {}}', '{"jobs": [7]}', '{"jobs": [{"name": "x"}]}',
    '{"jobs": [{"job_id": "x"}]}', '{"jobs": [{"job_id": 1, "state": {"current": 5}}]}',
    '{"jobs": [{"job_id": 1, "steps": [{"step": 3}]}]}', '{"jobs": [{"job_id": 1, "name": ["a"]}]}',
    '{"jobs": [{"job_id": 1, "exit_code": {"return_code": "0"}}]}',
])
def test_a_document_of_another_shape_is_a_parse_error_not_a_crash(doc: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_sacct_json(doc)


class _Runner:
    """Answers sacct as the given JSON and text; records the argument lists."""

    def __init__(self, json_out: str, text_out: str) -> None:
        self.json_out, self.text_out, self.calls = json_out, text_out, []

    def run(self, args, *, timeout_s=None, input=None, env=None) -> CommandResult:
        self.calls.append(list(args))
        return CommandResult(list(args), 0, self.json_out if "--json" in args else self.text_out, "")


def test_client_reads_json_where_told_and_falls_back_to_text_for_good() -> None:
    text = (DATA / "sacct_22.05.txt").read_text()
    good = _Runner((DATA / "sacct_22.05.json").read_text(), text)
    rows = SlurmClient(good, json_accounting=True).sacct("3", duplicates=True)
    assert good.calls == [["sacct", "--json", "-j", "3", "--duplicates"]] and rows
    bad = _Runner('{"jobs": "nope"}', text)
    client = SlurmClient(bad, json_accounting=True)
    assert [r.job_id for r in client.sacct("3")] == [r.job_id for r in parse_sacct(text)]
    client.sacct("3")
    assert [c[1] for c in bad.calls] == ["--json", "--parsable2", "--parsable2"]  # JSON asked once


@pytest.mark.parametrize("version, json_output, want", [
    ("22.05.8", True, False), ("23.02.7", True, True), ("24.11.5", True, True), ("24.11.5", False, False),
    (None, True, False)])
def test_json_accounting_only_where_it_is_there_and_right(version, json_output, want) -> None:
    assert SiteCapabilities(probed_at=0.0, version=version, json_output=json_output).json_accounting is want


def test_failed_node_is_read_from_both_forms_where_sacct_has_it() -> None:
    # 24.11 (data_parser v0.0.42) and the text column of 23.02+: the node Slurm blamed for a
    # NODE_FAIL; "" on a run without one; 22.05's documents have no such key.
    doc = json.loads(_v40(["NODE_FAIL"], 0))
    doc["jobs"][0]["failed_node"] = "gpu002"
    (job, _) = parse_sacct_json(json.dumps(doc))
    assert job.state == "NODE_FAIL" and job.failed_node == "gpu002"
    doc["jobs"][0]["failed_node"] = ""
    assert parse_sacct_json(json.dumps(doc))[0].failed_node is None
    assert all(r.failed_node is None for r in parse_sacct_json((DATA / "sacct_22.05.json").read_text()))
    fields = (*SACCT_FIELDS, "FailedNode")
    text = ("77|llama|NODE_FAIL|0:0|2026-12-05T12:30:00|2026-12-05T12:30:30|00:00:30|gpu[001-002]|None|gpu002\n"
            "77|llama|COMPLETED|0:0|2026-12-05T12:33:00|2026-12-05T12:34:00|00:01:00|gpu[003-004]|None|\n")
    rows = parse_sacct(text, fields)
    assert [(r.state, r.failed_node) for r in rows] == [("NODE_FAIL", "gpu002"), ("COMPLETED", None)]
    assert all(r.failed_node is None for r in parse_sacct((DATA / "sacct_22.05.txt").read_text(), SACCT_FIELDS))
