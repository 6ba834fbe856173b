"""``python -m slurmkit.train``: the reference trainer's entry point, one process per rank.

Reads the torchrun-style environment set by the node agent (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the SLURMKIT_* variables (RUN_DIR, CONFIG,
GENERATION, NODE, LEDGER, HEARTBEAT_FILE, DEVICE, FAULT, STEP_DELAY_S). Exit codes
(slurmkit.contract): 0 finished, 95 checkpointed on a stop signal (requeue), 2 configuration
error, 1 anything else.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, TypeVar

from slurmkit.runfiles import FAULTS_DIR
from slurmkit.train.signals import StopRequest, register_stack_dump

# Installed before torch is imported (seconds on a shared file system, longer with thousands of
# ranks importing at once): a time-limit warning or SIGTERM that comes while the rank starts up
# is kept for the first step boundary (checkpoint, exit 95, requeue) instead of killing the rank
# (SIGUSR1's default action), which the supervisor would have to read as a crash. Only when run
# as the rank's program: importing this module (tests, tools) leaves the importer's signals alone.
_EARLY_STOP = StopRequest().install() if __name__ == "__main__" else None
# The stack dump the agent asks a hung rank for (STACK_SIGNAL): early too, so that a rank stuck
# anywhere after this line (importing torch on a hung file system included) can say where.
_STACK_DUMP = register_stack_dump(os.environ) if __name__ == "__main__" else None

import torch  # noqa: E402 - after the stop handlers, on purpose
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slurmkit.contract import CONFIG_ERROR_MARKER, EXIT_CHECKPOINTED_ON_SIGNAL, EXIT_CONFIG_ERROR, device_of
from slurmkit.errors import ConfigError
from slurmkit.procexit import leave
from slurmkit.store.config import StoreConfig
from slurmkit.train import flightrec
from slurmkit.train.config import ModelConfig, ParallelConfig, TrainConfig
from slurmkit.train.faults import FaultInjector, parse_faults
from slurmkit.train.heartbeat import Heartbeat
from slurmkit.train.parallel import init_distributed, select_runtime
from slurmkit.train.planner import Hardware, estimate_on
from slurmkit.train.trainer import RankContext, Store, Trainer

log = logging.getLogger("slurmkit.train")
T = TypeVar("T")
H100_BF16_DENSE_TFLOPS = 989.0


def section(raw: DictConfig, key: str, schema: type[T]) -> T:
    """Typed, validated config section: unknown keys and bad values are ConfigErrors."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw.get(key) or {})
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(detected=f"config section {key!r}: {exc}".replace("\n", " "),
                          requirement=f"the fields of {schema.__name__}",
                          fix=f"fix the {key} section of the frozen config") from exc
    if not isinstance(obj, schema):
        raise ConfigError(detected=f"{key} composed to {type(obj).__name__}",
                          requirement=f"a {schema.__name__}", fix=f"fix the {key} section")
    return obj


def resolve_strategy(m: ModelConfig, p: ParallelConfig, t: TrainConfig, *, world: int,
                     local_world: int, on_gpu: bool) -> str:
    """``auto`` -> ddp when the replicated model fits this machine's memory, else fsdp."""
    if p.strategy != "auto":
        return p.strategy
    if on_gpu:
        mem_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    else:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    hw = Hardware(nodes=max(1, world // local_world), gpus_per_node=local_world if on_gpu else 0,
                  mem_gb=mem_gb, ranks_per_node=local_world)
    try:
        return estimate_on(m, p, t, hw).strategy
    except ConfigError:
        return "fsdp"  # an odd layout (uneven nodes): sharding is the safe choice


def _open_store(raw: DictConfig, env: Mapping[str, str], rank: int, world: int,
                config_hash: str, ledger: Any) -> Store | None:
    if not raw.get("store"):
        log.warning("no store section in the config: training without checkpoints")
        return None
    from slurmkit.ledger.events import from_store
    from slurmkit.store import CheckpointStore  # the store imports fsspec/s3fs: only if used

    def forward(event: dict[str, Any]) -> None:
        if ledger is not None:
            name, fields = from_store(event)
            ledger.append(name, **fields)

    store: Store = CheckpointStore.from_config(
        section(raw, "store", StoreConfig), rank=rank, world_size=world,
        node=env.get("SLURMKIT_NODE", os.uname().nodename), env=env,
        config_hash=config_hash, on_event=forward)
    return store


def _ledger(env: Mapping[str, str], rank: int) -> Any:
    """Rank 0's event sink. Under a node agent ($SLURMKIT_EVENTS_FILE): a node-local spool the
    agent writes into the ledger (one ledger writer per node, no shared file system here).
    Started alone with $SLURMKIT_LEDGER: the ledger itself (then this process is its writer)."""
    if rank != 0:
        return None
    if env.get("SLURMKIT_EVENTS_FILE"):
        from slurmkit.ledger.spool import SpoolWriter
        return SpoolWriter(env["SLURMKIT_EVENTS_FILE"], source="rank0")
    if env.get("SLURMKIT_LEDGER"):
        from slurmkit.ledger.ledger import Ledger
        return Ledger(env["SLURMKIT_LEDGER"], source="rank0")
    return None


def run(env: Mapping[str, str], early_stop: StopRequest | None = None) -> int:
    """Everything between reading the environment and the exit code."""
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    path = env.get("SLURMKIT_CONFIG")
    if not path:
        raise ConfigError(detected="SLURMKIT_CONFIG is not set",
                          requirement="the path of the run's frozen config YAML",
                          fix="start ranks through the node agent or export SLURMKIT_CONFIG")
    with open(path, "rb") as f:
        config_hash = hashlib.sha256(f.read()).hexdigest()[:16]
    raw = OmegaConf.load(path)
    if not isinstance(raw, DictConfig):
        raise ConfigError(detected=f"{path} is not a mapping", requirement="a YAML mapping",
                          fix="resubmit to write a fresh frozen config")
    m, p = section(raw, "model", ModelConfig), section(raw, "parallel", ParallelConfig)
    t = section(raw, "train", TrainConfig)
    chosen = device_of(env)
    runtime = select_runtime(t, local_rank, device=chosen)  # SLURMKIT_DEVICE, the agent's choice
    if chosen is not None and chosen.kind == "cuda" and runtime.device.type != "cuda":
        # By design on an emulated GPU cluster (no CUDA here); anywhere else a setup error
        # that would otherwise show only as a very slow run.
        print(f"slurmkit.train: the agent chose cuda:{chosen.index} but CUDA is not available "
              f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')!r}): computing on the CPU",
              file=sys.stderr, flush=True)
    on_gpu = runtime.device.type == "cuda"
    peak = float(OmegaConf.select(raw, "cluster.gpu_peak_tflops", default=0) or 0)
    ctx = RankContext(
        rank=rank, world_size=world, generation=int(env.get("SLURMKIT_GENERATION", "0")),
        run_dir=env.get("SLURMKIT_RUN_DIR"),
        peak_tflops=(peak or H100_BF16_DENSE_TFLOPS) if on_gpu else t.cpu_peak_tflops,
        step_delay_s=float(env.get("SLURMKIT_STEP_DELAY_S", "0") or 0))
    if t.deterministic:
        if on_gpu:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # Strict on GPU: only then does cuDNN attention pick its deterministic backward.
        # Lenient on CPU, where every op the model uses is deterministic anyway.
        torch.use_deterministic_algorithms(True, warn_only=not on_gpu)
    stop = early_stop or _EARLY_STOP or StopRequest().install()
    faults = FaultInjector(parse_faults(env.get("SLURMKIT_FAULT", "")), rank=rank,
                           marker_dir=os.path.join(ctx.run_dir, FAULTS_DIR) if ctx.run_dir else None)
    init_distributed(runtime, p)
    flightrec.serve(runtime.backend, env)  # the recorder's trace when a hang is examined
    store = None
    try:
        ledger = _ledger(env, rank)
        store = _open_store(raw, env, rank, world, config_hash, ledger)
        strategy = resolve_strategy(m, p, t, world=world, local_world=local_world,
                                    on_gpu=on_gpu)
        trainer = Trainer(m, p, t, ctx=ctx, runtime=runtime, strategy=strategy, store=store,
                          stop=stop, ledger=ledger, heartbeat=Heartbeat.from_env(env, rank),
                          faults=faults)
        code = trainer.run()
        if world > 1 and code in (0, EXIT_CHECKPOINTED_ON_SIGNAL):
            # The ranks' last exchange went through the TCPStore rank 0 serves: rank 0 leaving
            # right after writing a result would reset the connection of a rank still reading
            # it (seen: "waiting for '8/r' ... Connection reset by peer" after a stop). A
            # barrier over the process group, which every rank enters after its last read.
            dist.barrier()
        return code
    finally:
        if store is not None:
            store.close()
        dist.destroy_process_group()


def main(early_stop: StopRequest | None = None) -> int:
    """The rank's life; ``early_stop``: the stop handler a warm standby (slurmkit.launch.standby)
    installed before its imports, as this module does when run as ``python -m``."""
    logging.basicConfig(level=os.environ.get("SLURMKIT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s rank" + os.environ.get("RANK", "0")
                               + " %(name)s %(levelname)s %(message)s")
    try:
        return run(os.environ, early_stop)
    except ConfigError as exc:
        # One line, the stable marker first: the supervisor stops on it instead of restarting a
        # configuration that cannot work (the message quotes user input: kept to one clean line).
        message = "".join(c if c.isprintable() else " " for c in str(exc))
        print(f"{CONFIG_ERROR_MARKER}{message}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR


def exit_now(code: int) -> None:
    """Leave without interpreter finalization: every file, the store and the process groups
    are closed by now (see slurmkit.procexit)."""
    leave(code)

if __name__ == "__main__":
    exit_now(main())
