"""Seeded fault campaigns against real jobs on the local cluster (``tools/chaos``).

Each fault class has a test of its own (tests/integration/test_faults.py); real runs meet
faults in sequences, and a second fault is where a recovery turns into a stopped run or a lost
checkpoint. A campaign draws, per seed, a sequence of 3-6 faults from a menu, times each one
on the run's own events (the n-th checkpoint since the last recovery, the restart window after
the previous fault), drives them into a real ``+exp=tiny`` job, and checks invariants on the
ledger and the final parameters after every run.

Modules, one concept each:

- :mod:`.menu`: the fault kinds and the moments they can be placed at (which are real, which
  are not built yet and why);
- :mod:`.plan`: seed -> plan (pure, reproducible), and the command that replays a seed;
- :mod:`.invariants`: the checks, pure functions over the ledger and what the driver observed;
- :mod:`.procs`: finding a run's processes on the emulated nodes (ranks, agents, batch shell);
- :mod:`.driver`: one run on the real cluster: submit, wait for the trigger, inject, restore;
- :mod:`.campaign`: many seeds, the per-run report and the ``RESULT`` line; the CLI.
"""
