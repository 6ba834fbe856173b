"""The names of the files and folders of a run directory (and of a sweep directory), once.

Part of slurmkit/rundir.py (what a run directory holds, and who may change it), in a module of
its own only because it must import nothing: slurmkit.layout (which rundir imports), the ledger
and the low packages import it as a leaf (tests/unit/test_import_contract.py).

A name here is relative to the run directory (``RUN_DIR/<name>``) unless its comment says
otherwise. Writers and readers join these names; none spells them again.
"""

from __future__ import annotations

# ---------------------------------------------------------------- frozen at submit (trusted)
CONFIG_NAME = "config.yaml"  # the composed config (job.command): what every allocation runs
LAYOUT_NAME = "layout.json"  # the resolved layout, beside config.yaml (slurmkit.layout)
CAPABILITIES_NAME = "capabilities.json"  # what the site's Slurm can do (slurmkit.slurm.capabilities)
SCRIPT_NAME = "job.sbatch"  # the batch script (a run's, or a sweep directory's for its array)
SUBMITIT_DIR = "submitit"  # submitit's pickles and its logs (slurmkit.rundir checks it)

# ---------------------------------------------------------------- written while the run runs
LEDGER_NAME = "ledger.jsonl"  # the run's event log (slurmkit.ledger)
METRICS_NAME = "metrics.jsonl"  # the reference trainer's per-step metrics (rank 0)
FINAL_NAME = "final.json"  # the reference trainer's last word: final step and loss (rank 0)
LOGS_DIR = "logs"  # rank logs (rank<N>.log), the batch log, the requeue helper's log
RDZV_DIR = "rdzv"  # the agents' rendezvous: per-attempt store address, succession claims
TOKEN_NAME = "token"  # in RDZV_DIR: the agents' shared secret (slurmkit.runtoken)
CANCEL_REQUEST_NAME = "cancel_request.json"  # slurmkit cancel --checkpoint's request
REQUEUE_MARKS = "requeues"  # one empty file per failure requeue (supervisor.max_requeues)
MARKER_DIR = "progress"  # a program's reported checkpoints (slurmkit.contract.marker_path)
MARKER_NAME = "user_checkpoint.json"  # in MARKER_DIR: rank 0's newest reported checkpoint
NCCL_TRACE_DIR = "nccl_trace"  # torch's flight recorder dumps (TORCH_FR_DUMP_TEMP_FILE)
FAULTS_DIR = "faults"  # the chaos tests' fault markers, read by the reference trainer
CKPT_DIR = "ckpt"  # the default store's tiers: ckpt/nvme, ckpt/shared (conf/store/default.yaml)
SHARED_CKPT_DIR = "shared"  # in CKPT_DIR: the default store's shared tier

# ---------------------------------------------------------------- a sweep directory's own
SWEEP_NAME = "sweep.json"  # SWEEP_DIR/sweep.json: the variants and their overrides (slurmkit.sweepdir)
RUNNER_LOG = "local_runner.log"  # SWEEP_DIR/local_runner.log: the local executor's runner

# ---------------------------------------------------------------- written by the tools
REPORT_NAME = "report.html"  # slurmkit report's page (in the run or sweep directory)
