"""Memory and layout planner: will this model, layout and batch fit, before anything is submitted.

Pure arithmetic over the configs. Bytes per parameter follow mixed-precision training as the
trainer does it: fp32 master weights (4 B), fp32 gradients (4 B), AdamW moments (8 B); FSDP
shards all three over the data-parallel ranks, tensor and pipeline parallel split the model.
Activations follow what autograd saves in ``slurmkit.train.model`` (SDPA/flash attention, no
score matrix; KV heads repeated before SDPA), with Megatron-style sequence parallelism when
tensor > 1, 1F1B pipelining (the first stage holds ``pipeline`` micro-batches in flight) and
full per-block recomputation under activation checkpointing.

CPU runs (``gpus_per_node == 0``) use ``ranks_per_node`` ranks and share the node's host
memory (``gpu_mem_gb`` is then the node's memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

from slurmkit.errors import ConfigError
from slurmkit.layout import Layout, resolve_layout
from slurmkit.train.config import ModelConfig, ParallelConfig, TrainConfig
from slurmkit.train.flops import flops_per_token, param_count

GB = 1e9
MODEL_STATE_BYTES = {"params": 4, "grads": 4, "optimizer": 8}  # per parameter
GPU_OVERHEAD_GB = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
CPU_OVERHEAD_GB = 1.0  # python + torch runtime per process
MAX_SUGGESTED_NODES = 4096


@dataclass(frozen=True)
class Hardware:
    """Where the job runs: ``mem_gb`` is per GPU, or per node's host memory on CPU."""

    nodes: int
    gpus_per_node: int  # 0 = CPU ranks
    mem_gb: float
    ranks_per_node: int = 1  # CPU only
    margin: float = 0.1  # fraction of memory kept free

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def per_node(self) -> int:
        return self.gpus_per_node if self.on_gpu else self.ranks_per_node

    @property
    def capacity_gb(self) -> float:
        return self.mem_gb if self.on_gpu else self.mem_gb / max(1, self.ranks_per_node)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device memory of one layout (GB = 1e9 bytes) and the layout it assumes."""

    model: str
    nodes: int
    devices_per_node: int  # GPUs per node, or ranks per node on CPU
    on_gpu: bool
    world_size: int
    data_parallel: int
    tensor: int
    pipeline: int
    strategy: str  # resolved: "ddp" or "fsdp"
    activation_checkpointing: bool
    micro_batch: int
    global_batch: int
    grad_accum: int
    seq_len: int
    params_total: int
    flops_per_token: float
    params_gb: float
    grads_gb: float
    optimizer_gb: float
    gathered_params_gb: float  # FSDP: unsharded blocks alive during forward/backward
    activations_gb: float
    overhead_gb: float
    capacity_gb: float  # memory of one device (GPU) or one rank's share of the host
    margin: float  # fraction of capacity kept free

    @property
    def total_gb(self) -> float:
        return (self.params_gb + self.grads_gb + self.optimizer_gb + self.gathered_params_gb
                + self.activations_gb + self.overhead_gb)

    @property
    def usable_gb(self) -> float:
        return self.capacity_gb * (1.0 - self.margin)

    @property
    def fits(self) -> bool:
        return self.total_gb <= self.usable_gb

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for a table; the presentation layer renders them."""
        return [
            ("model", f"{self.model} ({self.params_total / 1e9:.2f} B params)"),
            ("layout", f"{self.nodes} nodes x {self.devices_per_node} = {self.world_size} "
                       f"(dp {self.data_parallel} x tp {self.tensor} x pp {self.pipeline})"),
            ("strategy", f"{self.strategy}, activation checkpointing "
                         f"{'on' if self.activation_checkpointing else 'off'}"),
            ("batch", f"global {self.global_batch} = micro {self.micro_batch} x dp "
                      f"{self.data_parallel} x accum {self.grad_accum}, seq {self.seq_len}"),
            ("parameters", f"{self.params_gb:.2f} GB"),
            ("gradients", f"{self.grads_gb:.2f} GB"),
            ("optimizer state", f"{self.optimizer_gb:.2f} GB"),
            ("gathered params", f"{self.gathered_params_gb:.2f} GB"),
            ("activations", f"{self.activations_gb:.2f} GB"),
            ("overhead", f"{self.overhead_gb:.2f} GB"),
            ("total / usable", f"{self.total_gb:.2f} / {self.usable_gb:.2f} GB "
                               f"({self.capacity_gb:.0f} GB, margin {self.margin:.0%})"),
            ("fits", "yes" if self.fits else "NO"),
            ("model FLOPs/token", f"{self.flops_per_token / 1e9:.1f} GFLOP"),
        ]


def _activation_bytes(m: ModelConfig, p: ParallelConfig, t: TrainConfig, cb: int,
                      grad_accum: int) -> float:
    """Bytes of saved activations on the busiest rank for one optimizer step."""
    tokens = t.micro_batch * t.seq_len
    kv = m.n_kv_heads * m.head_dim
    sp = p.tensor if p.sequence_parallel else 1
    # Norm inputs/outputs and the residual (sequence-parallel) + the TP-split interior:
    # q/k before rope, q/k/v (KV repeated) for SDPA, its output, wo input, 4 SwiGLU tensors.
    per_token_layer = cb * (4 * m.dim / sp + (6 * m.dim + kv + 4 * m.ffn_dim) / p.tensor)
    layers_on_stage = math.ceil(m.n_layers / p.pipeline)
    in_flight = min(p.pipeline, grad_accum) if p.pipeline > 1 else 1
    if p.activation_checkpointing:
        kept = cb * m.dim / sp * layers_on_stage * in_flight
        stored = tokens * (kept + per_token_layer)  # + one block recomputed in backward
    else:
        stored = tokens * per_token_layer * layers_on_stage * in_flight
    # Logits in compute dtype, their fp32 copy for the loss and its gradient.
    logits = tokens * m.vocab_size / p.tensor * (cb + 4 + 4)
    embedding = tokens * m.dim * cb
    return stored + logits + embedding


def _global_batch(t: TrainConfig, dp: int) -> int:
    return t.global_batch or t.micro_batch * dp


def _layout_errors(m: ModelConfig, p: ParallelConfig, t: TrainConfig, *, nodes: int,
                   per_node: int, on_gpu: bool) -> ConfigError | None:
    world = nodes * per_node
    model_split = p.tensor * p.pipeline
    if nodes < 1 or per_node < 1:
        return ConfigError(detected=f"{nodes} nodes x {per_node} devices per node",
                           requirement="at least one node with one device or rank",
                           fix="set job.nodes and cluster.gpus_per_node (or ranks_per_node)")
    if m.n_heads % p.tensor or m.n_kv_heads % p.tensor:
        return ConfigError(
            detected=f"parallel.tensor={p.tensor} with {m.n_heads} heads and "
                     f"{m.n_kv_heads} KV heads",
            requirement="tensor parallel divides the number of heads and of KV heads",
            fix=f"set parallel.tensor to a divisor of {math.gcd(m.n_heads, m.n_kv_heads)}",
        )
    if on_gpu and (p.tensor > per_node or per_node % p.tensor):
        return ConfigError(
            detected=f"parallel.tensor={p.tensor} with {per_node} GPUs per node",
            requirement="tensor parallel stays inside one node (NVLink) and divides its GPUs",
            fix=f"set parallel.tensor={math.gcd(per_node, p.tensor)} or fewer",
        )
    if world % model_split:
        return ConfigError(
            detected=f"world size {world} with tensor={p.tensor} x pipeline={p.pipeline}",
            requirement="world size = data x tensor x pipeline (divisible by tensor x pipeline)",
            fix=f"use a node count that makes {nodes} x {per_node} a multiple of {model_split}",
        )
    if p.pipeline > m.n_layers:
        return ConfigError(
            detected=f"parallel.pipeline={p.pipeline} with {m.n_layers} layers",
            requirement="at least one layer per pipeline stage",
            fix=f"set parallel.pipeline to {m.n_layers} or fewer",
        )
    if t.seq_len > m.max_seq_len:
        return ConfigError(
            detected=f"train.seq_len={t.seq_len} with model.max_seq_len={m.max_seq_len}",
            requirement="sequences no longer than the rotary table",
            fix=f"set train.seq_len <= {m.max_seq_len} or raise model.max_seq_len",
        )
    dp = world // model_split
    if _global_batch(t, dp) % (t.micro_batch * dp):
        return ConfigError(
            detected=f"train.global_batch={t.global_batch} with micro_batch={t.micro_batch} "
                     f"and data parallel {dp}",
            requirement="the global batch is a multiple of micro_batch x data-parallel size",
            fix=f"set train.global_batch to a multiple of {t.micro_batch * dp}",
        )
    return None


def _estimate(m: ModelConfig, p: ParallelConfig, t: TrainConfig, strategy: str,
              hw: Hardware) -> MemoryEstimate:
    world = hw.nodes * hw.per_node
    dp = world // (p.tensor * p.pipeline)
    counts = param_count(m)
    local_params = counts.total / (p.tensor * p.pipeline)
    shard = dp if strategy == "fsdp" else 1
    cb = 2 if (hw.on_gpu and t.dtype == "bf16") else 4
    gb = _global_batch(t, dp)
    accum = gb // (t.micro_batch * dp)
    gathered = 0.0
    if strategy == "fsdp":
        block = counts.per_layer / p.tensor
        # Current block + prefetched next one in compute dtype, one block of full gradients.
        gathered = block * (2 * cb + 4)
        if not p.reshard_after_forward:
            gathered += block * cb * math.ceil(m.n_layers / p.pipeline)
    elif cb == 2:
        gathered = local_params * cb  # autocast's low-precision weight copies
    return MemoryEstimate(
        model=m.name, nodes=hw.nodes, devices_per_node=hw.per_node, on_gpu=hw.on_gpu,
        world_size=world, data_parallel=dp, tensor=p.tensor, pipeline=p.pipeline,
        strategy=strategy, activation_checkpointing=p.activation_checkpointing,
        micro_batch=t.micro_batch, global_batch=gb, grad_accum=accum, seq_len=t.seq_len,
        params_total=counts.total, flops_per_token=flops_per_token(m, t.seq_len),
        params_gb=local_params / shard * MODEL_STATE_BYTES["params"] / GB,
        grads_gb=local_params / shard * MODEL_STATE_BYTES["grads"] / GB,
        optimizer_gb=local_params / shard * MODEL_STATE_BYTES["optimizer"] / GB,
        gathered_params_gb=gathered / GB,
        activations_gb=_activation_bytes(m, p, t, cb, accum) / GB,
        overhead_gb=GPU_OVERHEAD_GB if hw.on_gpu else CPU_OVERHEAD_GB,
        capacity_gb=hw.capacity_gb, margin=hw.margin,
    )


def estimate_on(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                hw: Hardware) -> MemoryEstimate:
    """``estimate`` for a ``Hardware`` value."""
    error = _layout_errors(model, parallel, train, nodes=hw.nodes, per_node=hw.per_node,
                           on_gpu=hw.on_gpu)
    if error is not None:
        raise error
    if parallel.strategy != "auto":
        return _estimate(model, parallel, train, parallel.strategy, hw)
    replicated = _estimate(model, parallel, train, "ddp", hw)
    return replicated if replicated.fits else _estimate(model, parallel, train, "fsdp", hw)


def estimate(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, *, nodes: int,
             gpus_per_node: int, gpu_mem_gb: float, ranks_per_node: int = 1,
             margin: float = 0.1) -> MemoryEstimate:
    """Memory per device of the layout; ``strategy=auto`` resolves to ddp if that fits.

    Raises ConfigError only for a layout that is structurally impossible (divisibility,
    tensor parallel across nodes); a layout that is merely too big is returned with
    ``fits == False`` (``check`` turns that into an error with a suggested fix).
    """
    hw = Hardware(nodes, gpus_per_node, gpu_mem_gb, ranks_per_node, margin)
    return estimate_on(model, parallel, train, hw)


def _fits(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
          hw: Hardware) -> bool:
    try:
        return estimate_on(model, parallel, train, hw).fits
    except ConfigError:
        return False


def suggest_fixes(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                  hw: Hardware) -> list[str]:
    """Smallest changes that make a too-big layout fit, most direct first."""
    fixes = []
    if parallel.strategy == "ddp" and _fits(model, replace(parallel, strategy="fsdp"), train,
                                            hw):
        fixes.append("set parallel.strategy=fsdp (shard parameters, gradients, optimizer)")
    if not parallel.activation_checkpointing and _fits(
            model, replace(parallel, activation_checkpointing=True), train, hw):
        fixes.append("set parallel.activation_checkpointing=true")
    tp_limit = hw.gpus_per_node if hw.on_gpu else 1
    for tp in (2, 4, 8, 16):
        if parallel.tensor < tp <= tp_limit and _fits(model, replace(parallel, tensor=tp),
                                                      train, hw):
            fixes.append(f"set parallel.tensor={tp}")
            break
    for n in range(hw.nodes + 1, MAX_SUGGESTED_NODES + 1):
        if _fits(model, parallel, train, replace(hw, nodes=n)):
            fixes.append(f"use at least {n} nodes (job.nodes={n})")
            break
    if train.micro_batch > 1 and _fits(model, parallel, replace(train, micro_batch=1), hw):
        fixes.append("set train.micro_batch=1 (raise gradient accumulation instead)")
    return fixes or _combined_fix(model, parallel, train, hw)


def _combined_fix(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                  hw: Hardware) -> list[str]:
    """No single change suffices: shard + recompute, then add tensor parallel, then nodes."""
    steps: list[str] = []
    p = parallel
    if p.strategy == "ddp":
        p, steps = replace(p, strategy="fsdp"), [*steps, "parallel.strategy=fsdp"]
    if not p.activation_checkpointing:
        p = replace(p, activation_checkpointing=True)
        steps.append("parallel.activation_checkpointing=true")
    if _fits(model, p, train, hw):
        return ["set " + " and ".join(steps)]
    tp_limit = hw.gpus_per_node if hw.on_gpu else 1
    for tp in (2, 4, 8, 16):
        if p.tensor < tp <= tp_limit and _fits(model, replace(p, tensor=tp), train, hw):
            return ["set " + " and ".join([*steps, f"parallel.tensor={tp}"])]
    for n in range(hw.nodes + 1, MAX_SUGGESTED_NODES + 1):
        if _fits(model, p, train, replace(hw, nodes=n)):
            return ["set " + " and ".join([*steps, f"job.nodes={n}"])]
    return []


def check(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, *, nodes: int,
          gpus_per_node: int, gpu_mem_gb: float, margin: float = 0.1,
          ranks_per_node: int = 1) -> MemoryEstimate:
    """The estimate of a layout that works; ConfigError (with a suggested fix) otherwise."""
    hw = Hardware(nodes, gpus_per_node, gpu_mem_gb, ranks_per_node, margin)
    est = estimate_on(model, parallel, train, hw)
    if est.fits:
        return est
    fixes = suggest_fixes(model, parallel, train, hw)
    device = "GPU" if est.on_gpu else "rank (its share of host memory)"
    raise ConfigError(
        detected=f"{model.name} needs about {est.total_gb:.1f} GB per {device} with "
                 f"{est.strategy}, dp={est.data_parallel}, tp={est.tensor}, "
                 f"pp={est.pipeline} on {hw.nodes} nodes (parameters {est.params_gb:.1f}, "
                 f"gradients {est.grads_gb:.1f}, optimizer {est.optimizer_gb:.1f}, "
                 f"activations {est.activations_gb:.1f} GB)",
        requirement=f"at most {est.usable_gb:.1f} GB ({est.capacity_gb:.0f} GB minus a "
                    f"{hw.margin:.0%} margin)",
        fix=" or ".join(fixes) if fixes else "use devices with more memory or a smaller model",
    )


class _Cluster(Protocol):
    name: str
    gpus_per_node: int
    gpu_mem_gb: float
    mem_gb_per_node: float


class _Job(Protocol):
    nodes: int
    ranks_per_node: int | None
    gpus_per_node: int | None
    mem_gb: float | None


class _Supervisor(Protocol):
    spare_nodes: int


class _RunConfig(Protocol):
    """The parts of slurmkit.config.SlurmkitConfig the planner reads."""

    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig

    @property
    def cluster(self) -> _Cluster: ...

    @property
    def job(self) -> _Job: ...

    @property
    def supervisor(self) -> _Supervisor: ...


def hardware_of(cfg: _RunConfig, *, host_mem_gb: float | None = None,
                margin: float = 0.1, layout: Layout | None = None) -> Hardware:
    """The job's hardware: GPUs (one rank each) or CPU ranks sharing the node's memory.

    Nodes, ranks and GPUs per node come from the run's layout (``slurmkit.layout``, resolved
    from ``cfg`` when not given), the same the batch script and the node agent use.
    An unknown GPU memory (``cluster.gpu_mem_gb == 0``) is taken as unlimited: the layout is
    still checked, the memory is not. CPU memory: ``job.mem_gb``, else the cluster's
    ``mem_gb_per_node``, else ``host_mem_gb`` (this machine's, for local runs).
    """
    lay = resolve_layout(cfg) if layout is None else layout
    ranks = lay.ranks_per_node
    if lay.on_gpu:
        mem = cfg.cluster.gpu_mem_gb or math.inf
        return Hardware(lay.train_nodes, ranks, mem, ranks, margin)
    mem = cfg.job.mem_gb or cfg.cluster.mem_gb_per_node or host_mem_gb or math.inf
    return Hardware(lay.train_nodes, 0, mem, ranks, margin)


def check_config(cfg: _RunConfig, *, host_mem_gb: float | None = None,
                 margin: float = 0.1, layout: Layout | None = None) -> MemoryEstimate:
    """``check`` for a composed run config (what submit calls before anything is queued)."""
    hw = hardware_of(cfg, host_mem_gb=host_mem_gb, margin=margin, layout=layout)
    return check(cfg.model, cfg.parallel, cfg.train, nodes=hw.nodes,
                 gpus_per_node=hw.gpus_per_node, gpu_mem_gb=hw.mem_gb, margin=hw.margin,
                 ranks_per_node=hw.ranks_per_node)
