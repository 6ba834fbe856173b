"""SubprocessRunner against real child processes, and the retry table/policy."""

from __future__ import annotations

import sys

import pytest

from slurmkit.errors import SlurmkitError
from slurmkit.slurm import (
    ERROR_PATTERNS,
    CommandRunner,
    Disposition,
    RetryingRunner,
    RetryPolicy,
    SlurmCommandError,
    SlurmCommandTimeout,
    SlurmNotInstalled,
    SubprocessRunner,
    classify,
)
from slurmkit.slurm.retry import should_retry
from testkit.fakeslurm import FakeSlurm

PY = sys.executable


# --- SubprocessRunner ---------------------------------------------------------------------------

def test_runner_returns_output_and_feeds_stdin() -> None:
    result = SubprocessRunner().run(
        [PY, "-c", "import sys; print(sys.stdin.read().upper())"], input="job 42")
    assert (result.returncode, result.stdout.strip()) == (0, "JOB 42")
    assert isinstance(SubprocessRunner(), CommandRunner)


def test_runner_nonzero_exit_keeps_command_and_stderr() -> None:
    args = [PY, "-c", "import sys; sys.stderr.write('sbatch: error: Invalid partition'); sys.exit(3)"]
    with pytest.raises(SlurmCommandError) as info:
        SubprocessRunner().run(args)
    err = info.value
    assert isinstance(err, SlurmkitError)
    assert (err.cmd, err.returncode, err.stderr) == (args, 3, "sbatch: error: Invalid partition")
    assert "Invalid partition" in str(err) and "exited with status 3" in str(err)
    assert type(err.__cause__).__name__ == "CalledProcessError"


def test_runner_timeout_reports_what_was_printed() -> None:
    args = [PY, "-c", "import time; print('partial line', flush=True); time.sleep(30)"]
    with pytest.raises(SlurmCommandTimeout) as info:
        SubprocessRunner().run(args, timeout_s=1.5)
    assert info.value.returncode is None
    assert "partial line" in str(info.value) and "1.5 s" in str(info.value)


def test_runner_missing_binary_gives_install_hint() -> None:
    with pytest.raises(SlurmNotInstalled) as info:
        SubprocessRunner().run(["sbatch-does-not-exist-xyz", "--version"])
    message = str(info.value)
    assert "Detected:" in message and "sbatch-does-not-exist-xyz" in message and "Fix:" in message


def test_runner_environment_base_plus_extra() -> None:
    runner = SubprocessRunner(env={"PATH": "/usr/bin:/bin", "BASE": "1"})
    code = "import os; print(os.environ.get('BASE'), os.environ.get('EXTRA'), 'HOME' in os.environ)"
    assert runner.run([PY, "-c", code]).stdout.split() == ["1", "None", "False"]
    assert runner.run([PY, "-c", code], env={"EXTRA": "2"}).stdout.split() == ["1", "2", "False"]


def test_runner_rejects_empty_command() -> None:
    with pytest.raises(ValueError):
        SubprocessRunner().run([])


# --- the error table ----------------------------------------------------------------------------

RETRYABLE = {Disposition.NOT_DELIVERED, Disposition.AMBIGUOUS}


@pytest.mark.parametrize("fragment,disposition", ERROR_PATTERNS)
def test_classify_every_table_row(fragment: str, disposition: Disposition) -> None:
    err = SlurmCommandError(["squeue"], 1, f"squeue: error: {fragment} (extra detail)")
    assert classify(err) is disposition
    assert should_retry(err, ["squeue"]) is (disposition in RETRYABLE)
    # A submission is retried only when the controller surely never saw it.
    assert should_retry(err, ["sbatch", "x.sh"]) is (disposition is Disposition.NOT_DELIVERED)


@pytest.mark.parametrize("fragment,disposition", ERROR_PATTERNS)
def test_retrying_runner_follows_the_table(fragment: str, disposition: Disposition) -> None:
    fake = FakeSlurm()
    fake.fail_next(1, f"scontrol: error: {fragment}")
    sleeps: list[float] = []
    runner = RetryingRunner(fake, RetryPolicy(sleep=sleeps.append))
    if disposition in RETRYABLE:
        assert "is UP" in runner.run(["scontrol", "ping"]).stdout
        assert len(fake.calls) == 2 and len(sleeps) == 1
    else:
        with pytest.raises(SlurmCommandError):
            runner.run(["scontrol", "ping"])
        assert len(fake.calls) == 1 and sleeps == []


@pytest.mark.parametrize("line", [
    "squeue: error: Socket timed out on send/recv operation",
    "scontrol: error: Unable to contact slurm controller (connect failure)",
    "sacct: error: Transport endpoint is not connected",
    "slurm_load_jobs error: Socket timed out on send/recv operation",
    "scontrol: error: Zero Bytes were transmitted or received",
])
def test_brief_transient_messages_are_retried(line: str) -> None:
    assert should_retry(SlurmCommandError(["squeue"], 1, line), ["squeue"])


@pytest.mark.parametrize("line", [
    "slurm_load_jobs error: Invalid job id specified",
    "sbatch: error: Batch job submission failed: Invalid partition name specified",
    "sbatch: error: Batch job submission failed: Requested node configuration is not available",
    "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)",
    # Permanent wins even when a transient fragment appears in the same output.
    "Socket timed out on send/recv operation\nslurm_load_jobs error: Invalid job id specified",
])
def test_brief_permanent_messages_are_not_retried(line: str) -> None:
    err = SlurmCommandError(["squeue"], 1, line)
    assert classify(err) is Disposition.PERMANENT
    assert not should_retry(err, ["squeue"])


def test_unknown_errors_and_non_slurm_errors_are_not_retried() -> None:
    assert not should_retry(SlurmCommandError(["squeue"], 1, "something new"), ["squeue"])
    assert not should_retry(ValueError("x"), ["squeue"])


def test_command_timeout_is_ambiguous() -> None:
    err = SlurmCommandTimeout(["squeue"], 30, "")
    assert classify(err) is Disposition.AMBIGUOUS
    assert should_retry(err, ["squeue"])
    assert not should_retry(err, ["sbatch", "x.sh"])
    assert not should_retry(err, ["scontrol", "requeue", "5"])


# --- the policy ---------------------------------------------------------------------------------

def test_backoff_grows_exponentially_with_bounded_jitter() -> None:
    fake = FakeSlurm()
    fake.fail_next(5)
    sleeps: list[float] = []
    policy = RetryPolicy(max_attempts=6, initial_wait_s=1.0, max_wait_s=5.0, jitter_s=0.5,
                         sleep=sleeps.append)
    RetryingRunner(fake, policy).run(["squeue"])
    assert len(fake.calls) == 6
    for wait, base in zip(sleeps, [1.0, 2.0, 4.0, 5.0, 5.0]):
        assert base <= wait <= base + 0.5


def test_stops_after_max_attempts_with_last_error() -> None:
    fake = FakeSlurm()
    fake.fail_next(10)
    sleeps: list[float] = []
    with pytest.raises(SlurmCommandError) as info:
        RetryingRunner(fake, RetryPolicy(max_attempts=3, sleep=sleeps.append)).run(["squeue"])
    assert "Socket timed out" in str(info.value)
    assert len(fake.calls) == 3 and len(sleeps) == 2


def test_stops_after_max_delay() -> None:
    fake = FakeSlurm()
    fake.fail_next(10)
    sleeps: list[float] = []
    with pytest.raises(SlurmCommandError):
        RetryingRunner(fake, RetryPolicy(max_attempts=10, max_delay_s=0.0,
                                         sleep=sleeps.append)).run(["squeue"])
    assert len(fake.calls) == 1 and sleeps == []


def test_timeouts_retried_for_queries_only() -> None:
    fake = FakeSlurm()
    fake.fail_next(1, None)
    sleeps: list[float] = []
    runner = RetryingRunner(fake, RetryPolicy(sleep=sleeps.append))
    runner.run(["squeue"])
    assert len(fake.calls) == 2
    fake.fail_next(1, None, command="sbatch")
    with pytest.raises(SlurmCommandTimeout):
        runner.run(["sbatch", "--parsable", "/nonexistent.sh"])
    assert len(fake.calls) == 3


@pytest.mark.parametrize("kwargs", [{"max_attempts": 0}, {"initial_wait_s": -1.0}])
def test_policy_validates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
