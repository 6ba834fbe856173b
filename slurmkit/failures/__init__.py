"""The failure vocabulary, a layer of its own below everything that observes or acts on a failure
(issue 35): the node agent (slurmkit.launch), its pre-flight (slurmkit.health), the supervisor
(slurmkit.supervise), the trainer's stacks (slurmkit.train) and the chaos tests.

Modules, one concept each: ``classes`` (FailureClass and what each class means for recovery),
``classify`` (Evidence, Failure, the table-driven classifier of lines and exits, ``root_cause``),
``stacks`` (where a hung rank is, from its Python stack) and ``programs`` (whether the job runs
the reference trainer, and so what a program's silence and its clean exit after a signal mean:
whether it is known to beat and to follow the exit contract).

Pure: they import only each other and leaf modules (slurmkit.contract, slurmkit.gpufaults), never
launch, supervise, health or train (tests/unit/test_import_contract.py). Nothing is imported
here: a user imports only the module it needs.
"""
