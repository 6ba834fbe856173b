"""``slurmkit VERB ARGS``: one command for the daily loop, the same as ``python -m slurmkit.VERB ARGS``.

The verbs live here, one module each (``slurmkit/cli/submit.py``, ``status.py``, ...), except
those that are packages of their own (``slurmkit.report``, ``store``, ``supervise``). :data:`VERBS`
names the one module each verb runs; ``python -m slurmkit.VERB`` reaches the same module through a
tiny module at the package's root (``slurmkit/submit.py``). The library never imports this
package (tests/unit/test_import_contract.py).

The dispatcher runs the verb's module as ``__main__`` (runpy) with ``sys.argv[1:] = ARGS`` and,
as ``python -m`` sets it, ``sys.argv[0]`` = the module's file; every verb keeps its own parser,
help and exit codes, so the two spellings cannot drift apart. It imports nothing but the standard
library, so ``slurmkit submit`` starts as fast as ``python -m slurmkit.submit``.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

# verb -> (the module it runs, one line for `slurmkit --help`), in the order of a day's work.
VERBS: dict[str, tuple[str, str]] = {
    "submit": ("slurmkit.cli.submit",
               "compose a config (+exp=NAME key=value ...), validate it and submit the job or sweep"),
    "status": ("slurmkit.cli.status",
               "state, step, loss, tokens/s and checkpoints of a run, job or sweep (--watch)"),
    "runs": ("slurmkit.cli.runs", "list recent runs under a run root"),
    "logs": ("slurmkit.cli.logs", "show or follow (-f) a run's rank and agent logs"),
    "cancel": ("slurmkit.cli.cancel", "cancel a run cleanly (--checkpoint: a final checkpoint first)"),
    "resume": ("slurmkit.cli.resume", "continue a run that ended from its newest checkpoint, under a new job"),
    "clean": ("slurmkit.cli.clean", "remove finished runs of yours below a run root (lists first; --yes)"),
    "report": ("slurmkit.report", "write a run's report.html with plots and checkpoint interval advice"),
    "plan": ("slurmkit.cli.plan",
             "memory estimate of an experiment's parallel layout on a cluster, before submit"),
    "topo": ("slurmkit.cli.topo", "this node's topology and the rank pinning plan (show|plan)"),
    "store": ("slurmkit.store",
              "list, verify, promote and prune checkpoints on a tier (ls|verify|promote|gc)"),
    "supervise": ("slurmkit.supervise", "a finished run's failures and goodput from its ledger"),
}

USAGE = "usage: slurmkit VERB [ARGS ...]    (the same as: python -m slurmkit.VERB [ARGS ...])"


def usage() -> str:
    width = max(map(len, VERBS))
    lines = [USAGE, "", "verbs:"]
    lines += [f"  {verb:<{width}}  {line}" for verb, (_, line) in VERBS.items()]
    lines += ["", "`slurmkit VERB --help` (or `slurmkit help VERB`) describes one verb."]
    return "\n".join(lines)


def _runnable(module: str) -> bool:
    """True when ``module`` exists as a module, or as a package with a __main__."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent package is missing
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:
        return importlib.util.find_spec(f"{module}.__main__") is not None
    return True


def _fail(message: str) -> int:
    print(f"slurmkit: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        from slurmkit import __version__

        print(f"slurmkit {__version__}")
        return 0
    if args[0] == "help" and len(args) > 1:
        args = [args[1], "--help"]
    verb, rest = args[0], args[1:]
    if verb not in VERBS:
        return _fail(f"Detected: unknown verb {verb!r}. Requirement: one of {', '.join(VERBS)}. "
                     "Fix: run `slurmkit --help` for what each does.")
    module = VERBS[verb][0]
    if not _runnable(module):
        return _fail(f"Detected: this installation of slurmkit has no module {module}. "
                     f"Requirement: a slurmkit release that provides `{verb}`. "
                     "Fix: upgrade slurmkit, or use the verbs it has (`slurmkit --help`).")
    sys.argv = [verb, *rest]
    # The verb exits through sys.exit(...) like `python -m` would; one that just returns succeeded.
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def run(argv: list[str] | None = None) -> int:
    """The console script: ``main`` plus a quiet end when the reader of stdout went away.

    ``slurmkit runs | head`` closes the pipe early; without this the interpreter's last flush
    prints a BrokenPipeError traceback to the terminal.
    """
    try:
        try:
            code = main(argv)
        except SystemExit:  # a verb's own sys.exit: flush what it printed first
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Point stdout at /dev/null so the flush at interpreter exit has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # what a shell reports for a command ended by SIGPIPE
