"""The run's event log (RUN_DIR/ledger.jsonl), a layer of its own below everything that writes
or reads it (issue 35): the supervisor, the CLI, the trainer's ranks, the reports.

Modules, one concept each: ``names`` (every event's name, once, as a constant), ``events``
(each event's fields and their types, checked at append and at read), ``ledger`` (the writer,
``read_ledger``, ``parse_record``), ``spool`` (a rank's events, spooled for its node's agent to
forward) and ``summary`` (figures about one run, derived from its events: pure functions).

They import only slurmkit.untrusted, slurmkit.runfiles (the run directory's names) and each
other, so that a rank (slurmkit.train) and the config can use the ledger without importing the
supervisor. Nothing is imported here: a rank imports only the module it needs.
"""
