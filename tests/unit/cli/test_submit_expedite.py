"""--requeue=expedite where the site probe found it enabled, and plain --requeue when sbatch
refuses it (the real refusal is tested on the local cluster: 22.05's sbatch takes no argument
to --requeue)."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from slurmkit.cli.submit import Submitted, submit_with_site
from slurmkit.config import compose
from slurmkit.errors import SubmissionError
from slurmkit.render import build_jobspec, render_standalone, render_submitit_script
from slurmkit.slurm.capabilities import SiteCapabilities

SPEC = build_jobspec(compose(["+exp=tiny", "cluster=local_slurm"]), "/shared/runs/x/1", [])
EXPEDITE = SiteCapabilities(probed_at=0.0, version="25.11.0", expedited_requeue=True)


def test_both_scripts_ask_for_expedite_only_when_told() -> None:
    fast = dataclasses.replace(SPEC, requeue_expedite=True)
    assert "#SBATCH --requeue=expedite\n" in render_submitit_script(fast, python="python3")
    assert "#SBATCH --requeue=expedite\n" in render_standalone(fast, "/shared/runs/x/1/job.sbatch")
    plain = render_submitit_script(SPEC, python="python3")
    assert "#SBATCH --requeue\n" in plain and "expedite" not in plain


def _submitter(refuse: bool):
    seen: list[bool] = []

    def submit(spec):
        seen.append(spec.requeue_expedite)
        if refuse and spec.requeue_expedite:
            raise SubmissionError("Detected: sbatch refused the job: sbatch: option '--requeue' doesn't allow "
                                  "an argument. Requirement: ... Fix: ...")
        return Submitted("7", spec.run_dir, "slurm", None)
    return submit, seen


@pytest.mark.parametrize("caps, requeue, want", [
    (None, True, [False]), (SiteCapabilities(probed_at=0.0, version="24.11.5"), True, [False]),
    (EXPEDITE, True, [True]), (EXPEDITE, False, [False])])
def test_expedite_is_asked_for_where_the_site_has_it(caps, requeue, want) -> None:
    submit, seen = _submitter(refuse=False)
    err = Console(file=io.StringIO())
    assert submit_with_site(dataclasses.replace(SPEC, requeue=requeue), caps, err, submit).job_id == "7"
    assert seen == want and err.file.getvalue() == ""


def test_a_refused_expedite_is_submitted_again_with_requeue_and_said() -> None:
    submit, seen = _submitter(refuse=True)
    err = Console(file=io.StringIO(), width=400)
    assert submit_with_site(SPEC, EXPEDITE, err, submit).job_id == "7"
    assert seen == [True, False]
    said = err.file.getvalue()
    assert "sbatch refused --requeue=expedite" in said and "doesn't allow an argument" in said


@pytest.mark.parametrize("caps", [None, EXPEDITE])
def test_another_refusal_stands(caps) -> None:
    calls = []

    def submit(spec):
        calls.append(spec.requeue_expedite)
        raise SubmissionError("Detected: sbatch refused the job: Invalid partition name specified")
    with pytest.raises(SubmissionError, match="Invalid partition"):
        submit_with_site(SPEC, caps, Console(file=io.StringIO()), submit)
    assert calls == [caps is not None]  # tried once: no second submission, no warning
