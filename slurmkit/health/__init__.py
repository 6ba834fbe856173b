"""Node health before training: pre-flight checks on every node before its ranks start.

A node with a lost GPU, a fresh Xid, a full or dying NVMe or a site-specific fault is found here,
in seconds, before the generation's ranks start on it, and goes the way of any bad node (a spare
takes its place, or the job is requeued without it). A shared file system that does not answer is
not the node's fault: its verdict is ``wait``, never ``bad_node``.

Modules, one concept each: ``result`` (verdicts and results), ``runner`` (every check at once,
each with its own deadline), one module per check (``gpus``, ``kernel_log``, ``storage``,
``extra``; ``clock`` and ``links`` measure against the job's other agents), ``preflight`` (the checks of one node of a run, the ledger record and the evidence
the supervisor acts on) and ``__main__`` (the operator's CLI).
"""
