"""Hostile input, issue 34 item 7: the remaining readers of what a rank, a peer or a file in the
shared run directory holds (layout.json, succession claims and done markers, the cancel request,
sweep.json, the site capabilities' copy, a rank's output, the node-local directory) take any bytes.

One row per reader and hostile content: a number of thousands of digits, nesting deep enough to
exhaust Python's recursion, a FIFO where a file was expected (it would block the reader for
good), a symbolic link, a value of the wrong type. Each asserts a refusal of the reader's own
error type (or a logged refusal, where the reader counts the file as absent) whose message
names the file, within a few seconds. Every row fails on the code
before the fix: a RecursionError or TypeError out of the reader, a reader that never returns
from the FIFO, a link followed, an absurd value accepted, or nothing said about the refusal.
(Rows the old code already refused, such as a FIFO as a succession claim, are not repeated here.)
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from slurmkit.errors import ConfigError
from slurmkit.launch.ranks import MAX_LINE_BYTES, _tee
from slurmkit.layout import LAYOUT_NAME, Layout, LayoutError, read_layout, write_layout
from slurmkit.slurm.capabilities import CAPABILITIES_NAME, read_run_dir_copy
from slurmkit.supervise import cancel_request
from slurmkit.supervise.exits import succession
from slurmkit.sweepdir import SWEEP_NAME, Sweep, Variant, load_sweep, variant_dir, write_sweep

T = TypeVar("T")
READ_TIMEOUT_S = 120.0  # a reader still reading by then is blocked on a FIFO (a bound for a hang, not a speed limit)
ATTEMPT = "123-0"


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# ------------------------------------------------------------------ hostile content

Plant = Callable[[Path, "list[Path]"], None]


def content(data: bytes) -> Plant:
    def plant(path: Path, fifos: list[Path]) -> None:
        path.unlink(missing_ok=True)
        path.write_bytes(data)
    return plant


def fifo(path: Path, fifos: list[Path]) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    fifos.append(path)


def link(path: Path, fifos: list[Path]) -> None:
    """A link to a copy of what was there (valid content): only the link is wrong."""
    target = path.with_name(path.name + ".elsewhere")
    os.replace(path, target)
    path.symlink_to(target)


# ------------------------------------------------------------------ the readers

def frozen_layout(tmp: Path) -> Path:
    (tmp / "config.yaml").write_text("job: {nodes: 2}\n")
    write_layout(str(tmp), Layout(nodes=2, train_nodes=2, spare_nodes=0, ranks_per_node=1, gpus_per_node=0))
    return tmp / LAYOUT_NAME


def refuse_layout(tmp: Path, caplog: pytest.LogCaptureFixture | None) -> str:
    with pytest.raises(LayoutError) as err:
        read_layout(str(tmp))
    return str(err.value)


def done_marker(tmp: Path) -> Path:
    succession.write_done(str(tmp), ATTEMPT, succession.Done("completed", 0, "n1", 0))
    return Path(succession.done_path(str(tmp), ATTEMPT))


def refuse_done(tmp: Path, caplog: pytest.LogCaptureFixture) -> str:
    with caplog.at_level(logging.ERROR):
        assert succession.read_done(str(tmp), ATTEMPT) is None  # refused: counts as absent
    return "\n".join(r.getMessage() for r in caplog.records)


def claim(tmp: Path) -> Path:
    path = Path(succession.claim_path(str(tmp), ATTEMPT))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"node_rank": 1, "node": "n1", "pid": 1, "t": 0.0}))
    return path


def refuse_claim(tmp: Path, caplog: pytest.LogCaptureFixture) -> str:
    with pytest.raises(succession.SuccessionFileError) as err:
        succession._claimant(succession.claim_path(str(tmp), ATTEMPT))
    return str(err.value)


def cancel_file(tmp: Path) -> Path:
    return Path(cancel_request.write_cancel_request(str(tmp), job_id="123", by="me", time_s=1.0))


def refuse_cancel(tmp: Path, caplog: pytest.LogCaptureFixture) -> str:
    with caplog.at_level(logging.ERROR):
        assert cancel_request.read_cancel_request(str(tmp)) is None  # refused: nobody asked
    with pytest.raises(cancel_request.CancelRequestError) as err:
        cancel_request.load_cancel_request(str(tmp))
    logged = [r.getMessage() for r in caplog.records]
    assert any(str(err.value) in m for m in logged), logged
    return str(err.value)


def sweep_file(tmp: Path) -> Path:
    d = str(tmp)
    write_sweep(Sweep(sweep_dir=d, name="s", array="0-1", executor="local", common_overrides=["+exp=tiny"],
                      variants=[Variant(i, [f"train.lr={i}"], variant_dir(d, i)) for i in range(2)]))
    return tmp / SWEEP_NAME


def refuse_sweep(tmp: Path, caplog: pytest.LogCaptureFixture) -> str:
    with pytest.raises(ConfigError) as err:
        load_sweep(str(tmp))
    return str(err.value)


def sweep_doc(**changes: Any) -> bytes:
    doc: dict[str, Any] = {"kind": "sweep", "name": "s", "array": "0-0", "executor": "local",
                           "common_overrides": [], "job_id": None, "variants": []}
    return json.dumps({**doc, **changes}).encode()


def capabilities_copy(tmp: Path) -> Path:
    path = tmp / CAPABILITIES_NAME
    path.write_text("{}")
    os.chmod(path, 0o644)
    return path


def refuse_capabilities(tmp: Path, caplog: pytest.LogCaptureFixture) -> str:
    with caplog.at_level(logging.WARNING):
        assert read_run_dir_copy(str(tmp), now=0.0) is None  # refused: node 0 probes no further
    return "\n".join(r.getMessage() for r in caplog.records)


READERS = {  # name: (write a valid file, return its path; call the reader, return its refusal;
    #         whether the refusal is a Detected/Requirement/Fix message)
    "layout": (frozen_layout, refuse_layout, True),
    "done": (done_marker, refuse_done, True),
    "claim": (claim, refuse_claim, True),
    "cancel": (cancel_file, refuse_cancel, True),
    "sweep": (sweep_file, refuse_sweep, True),
    "capabilities": (capabilities_copy, refuse_capabilities, False),
}

DIGITS = "9" * 5000
CASES = [
    # layout.json: 64 KiB at most, so 30,000 levels (the old reader: RecursionError)
    ("layout", content(b'{"nodes": ' + DIGITS.encode() + b"}"), "5000 digits"),
    ("layout", content(nested(30_000)), "nested deeper"),
    ("layout", fifo, "not a regular file"),
    ("layout", link, "cannot be read"),
    # a claim or marker holds 4 KiB at most: 2,000 levels, and 4,000 digits (an int to Python)
    ("done", content(nested(2_000)), "nested deeper"),
    ("done", content(b'{"outcome": "completed", "exit_code": 0, "node": "n1", "node_rank": '
                     + b"7" * 4000 + b"}"), "4000 digits"),
    ("claim", content(nested(2_000)), "nested deeper"),
    ("claim", content(b'{"node": "n1", "node_rank": ' + b"7" * 4000 + b"}"), "4000 digits"),
    # the cancel request: the old reader crashed, blocked, followed links, took any object
    ("cancel", content(DIGITS.encode()), "5000 digits"),
    ("cancel", content(nested(100_000)), "over 65536 bytes"),
    ("cancel", content(nested(30_000)), "nested deeper"),
    ("cancel", fifo, "not a regular file"),
    ("cancel", link, "symbolic links"),
    ("cancel", content(b'{"job_id": ["123"], "by": "me", "time": 1.0}'), "job_id=['123'], not a string"),
    ("cancel", content(b"[1, 2]"), "not an object"),
    # sweep.json: read by every task of the array and by the report
    ("sweep", content(sweep_doc(runner_pid=int("9" * 4000))), "4000 digits"),
    ("sweep", content(nested(100_000)), "nested deeper"),
    ("sweep", fifo, "not a regular file"),
    ("sweep", link, "symbolic links"),
    ("sweep", content(sweep_doc(common_overrides=5)), "common_overrides is not a list of strings"),
    ("sweep", content(sweep_doc(name={"a": 1})), "name is a dict, not a string"),
    # the run directory's copy of the site's capabilities, read by node 0's agent at start
    ("capabilities", content(nested(100_000)), "nested deeper"),
]


@pytest.fixture
def fifos() -> Iterator[list[Path]]:
    """FIFOs planted by a case; afterwards each is opened for writing once, which releases a
    reader still blocked in open() (the old code), so no thread is left waiting on it."""
    made: list[Path] = []
    yield made
    for path in made:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader: nobody is blocked
            pass


def within_timeout(fn: Callable[[], T]) -> T:
    got: dict[str, Any] = {}

    def run() -> None:
        try:
            got["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            got["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(READ_TIMEOUT_S)
    assert not t.is_alive(), f"the reader did not return within {READ_TIMEOUT_S} s (blocked on a FIFO?)"
    if "error" in got:
        raise got["error"]
    return got["value"]


@pytest.mark.parametrize("reader, plant, reason", CASES,
                         ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(CASES)])
def test_a_hostile_file_is_refused_and_named(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                             fifos: list[Path], reader: str, plant: Plant, reason: str) -> None:
    valid, refuse, actionable = READERS[reader]
    path = valid(tmp_path)
    plant(path, fifos)
    message = within_timeout(lambda: refuse(tmp_path, caplog))
    assert str(path) in message and reason in message, message
    assert not actionable or ("Detected:" in message and "Fix:" in message), message


def test_the_config_beside_a_layout_is_not_waited_on(tmp_path: Path, fifos: list[Path]) -> None:
    frozen_layout(tmp_path)
    fifo(tmp_path / "config.yaml", fifos)
    message = within_timeout(lambda: refuse_layout(tmp_path, None))
    assert str(tmp_path / "config.yaml") in message and "not a regular file" in message


# ------------------------------------------------------------------ a rank's output

class Pieces(list[tuple[int, str]]):
    def __call__(self, rank: int, line: str) -> None:
        self.append((rank, line))


def test_a_line_without_end_is_read_in_bounded_pieces(tmp_path: Path) -> None:
    """3.5 MiB without a newline (a progress bar redrawn with \\r) then a NCCL error: the log gets
    every byte, the sink pieces of at most MAX_LINE_BYTES, and still sees the error's line."""
    import io

    flood = b"\r step 1/100 " * (7 * MAX_LINE_BYTES // 26)
    data = flood + b"\nNCCL error: unhandled system error\n"
    sink, log_path = Pieces(), tmp_path / "rank0.log"
    _tee(0, io.BytesIO(data), str(log_path), sink)
    assert log_path.read_bytes() == data
    assert max(len(line.encode()) for _, line in sink) <= MAX_LINE_BYTES
    assert len(sink) == -(-len(flood) // MAX_LINE_BYTES) + 1
    assert sink[-1] == (0, "NCCL error: unhandled system error")


# ------------------------------------------------------------------ an agent that cannot start

AGENT = "import sys; from slurmkit.launch.agent import agent_main; sys.exit(agent_main(sys.argv[1]))"


def run_agent(run_dir: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SUBMITIT"))}
    full.update(SUBMITIT_LOCAL_GLOBALID="0", SUBMITIT_LOCAL_NTASKS="1", SUBMITIT_LOCAL_JOB_ID="77", **env)
    return subprocess.run([sys.executable, "-c", AGENT, run_dir], env=full, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    from slurmkit.config import compose
    from slurmkit.cli.submit import freeze
    from slurmkit.submit_checks import make_run_dir

    base = tmp_path_factory.mktemp("agent")
    run_dir = str(base / "root" / "tiny" / "run")
    make_run_dir(run_dir, str(base / "root"))
    freeze(compose(["+exp=tiny", "cluster=local_slurm"]), run_dir)
    return run_dir


def ended(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "ledger.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["event"] == "end"]


def test_an_agent_whose_layout_is_hostile_ends_with_93(frozen_run: str) -> None:
    path = os.path.join(frozen_run, LAYOUT_NAME)
    with open(path, "w") as f:  # the file is rewritten in place: its mode stays as submit made it
        f.write('{"nodes": ' + DIGITS + "}")
    done = run_agent(frozen_run)
    assert done.returncode == 93, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and path in done.stderr
    (end,) = ended(frozen_run)
    assert end["status"] == "failed" and end["exit_code"] == 93 and path in end["reason"]


@pytest.mark.skipif(os.getuid() != 0, reason="only root can be given a node-local root it cannot write")
def test_an_agent_without_a_node_local_directory_ends_with_93(tmp_path: Path) -> None:
    """/proc passes the root's writability check for root, yet nothing can be made in it: the
    squatted-directory fallback (mkdtemp) fails as well."""
    from slurmkit.config import compose
    from slurmkit.cli.submit import freeze
    from slurmkit.submit_checks import make_run_dir

    run_dir = str(tmp_path / "root" / "tiny" / "run")
    make_run_dir(run_dir, str(tmp_path / "root"))
    freeze(compose(["+exp=tiny", "cluster=local_slurm"]), run_dir)
    done = run_agent(run_dir, SLURMKIT_NODE_LOCAL_DIR="/proc")
    assert done.returncode == 93, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "/proc/slurmkit-0" in done.stderr
    (end,) = ended(run_dir)
    assert end["status"] == "failed" and "/proc/slurmkit-0" in end["reason"] and "Fix:" in end["reason"]


# ------------------------------------------------------------------ the batch script's ended steps

def test_a_fifo_swapped_in_after_the_look_does_not_hang_node_0(tmp_path: Path, fifos: list[Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader stats the file, then opens it: a FIFO put there in between (the stat still saw
    the regular file) is not waited on."""
    from slurmkit.supervise import stepsended

    regular, path = tmp_path / "regular", tmp_path / "steps_ended"
    regular.write_text("1 1 9\n")
    fifo(path, fifos)
    seen = os.stat(regular)
    monkeypatch.setattr(stepsended.os, "stat", lambda p, **kw: seen if p == str(path) else os.lstat(p))
    assert within_timeout(lambda: stepsended.StepsEnded(str(path), 4).new()) == []
