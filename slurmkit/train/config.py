"""Schemas of the model, parallel layout and training loop. Owned by the train package.

The defaults live here (conf/parallel/default.yaml and conf/train/default.yaml restate none of
them); conf/model/*.yaml and conf/exp/*.yaml are presets. The dataclasses validate themselves
in ``__post_init__`` so a bad value fails where it is read, with a Detected/Requirement/Fix
message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from slurmkit.choices import check_choices
from slurmkit.errors import ConfigError

STRATEGIES = ("auto", "ddp", "fsdp")  # parallel.strategy
DTYPES = ("bf16", "fp32")  # train.dtype
DATA_KINDS = ("synthetic", "memmap")  # train.data
TOKEN_DTYPES = ("uint16", "uint32")  # train.data_dtype


def _positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(
                detected=f"{section}.{name}={value}",
                requirement=f"{section}.{name} is greater than 0",
                fix=f"set {section}.{name} to a positive value",
            )


@dataclass
class ModelConfig:
    """Shape of a Llama-3-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU, untied head)."""

    name: str = "tiny"
    dim: int = 256  # hidden size (model width)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 8  # query heads; head_dim = dim // n_heads
    n_kv_heads: int = 4  # key/value heads (grouped-query attention); divides n_heads
    ffn_dim: int = 768  # SwiGLU inner width
    vocab_size: int = 4096  # tokens; also the size of the untied output head
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 500000.0  # rotary base frequency (Llama 3)
    max_seq_len: int = 8192  # longest sequence the rotary table is built for (tokens)

    def __post_init__(self) -> None:
        _positive("model", dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                  n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim, vocab_size=self.vocab_size,
                  norm_eps=self.norm_eps, rope_theta=self.rope_theta,
                  max_seq_len=self.max_seq_len)
        if self.dim % self.n_heads:
            raise ConfigError(
                detected=f"model.dim={self.dim} with model.n_heads={self.n_heads}",
                requirement="model.dim is a multiple of model.n_heads",
                fix=f"set model.dim to a multiple of {self.n_heads}",
            )
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(
                detected=f"head dimension {self.dim // self.n_heads} (dim / n_heads)",
                requirement="an even head dimension (rotary embeddings rotate pairs)",
                fix="choose model.dim and model.n_heads so dim / n_heads is even",
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                detected=f"model.n_heads={self.n_heads} with model.n_kv_heads={self.n_kv_heads}",
                requirement="model.n_kv_heads divides model.n_heads (grouped-query attention)",
                fix="set model.n_kv_heads to a divisor of model.n_heads",
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


@dataclass
class ParallelConfig:
    """How the ranks split the work: world size = data x tensor x pipeline."""

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"strategy": STRATEGIES}

    # "ddp": replicate the model; "fsdp": shard parameters, gradients and optimizer state
    # (FSDP2 fully_shard); "auto": ddp when the replicated model fits, else fsdp.
    strategy: str = "auto"
    tensor: int = 1  # tensor-parallel degree; stays inside one node
    pipeline: int = 1  # pipeline-parallel degree (planner only; the trainer runs pipeline=1)
    # Recompute each block's activations in backward (keeps only block inputs).
    activation_checkpointing: bool = False
    # With tensor > 1, shard activations along the sequence between TP regions (Megatron SP).
    sequence_parallel: bool = True
    # FSDP2: free the gathered parameters after forward (saves memory, costs an all-gather).
    reshard_after_forward: bool = True
    pg_timeout_s: float = 600.0  # collective timeout of the process group (seconds)

    def __post_init__(self) -> None:
        check_choices("parallel", self, self.CHOICES)
        _positive("parallel", tensor=self.tensor, pipeline=self.pipeline,
                  pg_timeout_s=self.pg_timeout_s)


@dataclass
class TrainConfig:
    """The training loop: batch, optimizer, schedule, data, checkpoint cadence.

    The defaults are sized for the tiny model on CPU (conf/model/tiny.yaml); the Llama
    experiments (conf/exp/) set seq_len 8192 and their own steps, batch and warm-up.
    """

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "dtype": DTYPES, "data": DATA_KINDS, "data_dtype": TOKEN_DTYPES,
    }

    steps: int = 200  # optimizer steps of the whole run
    seed: int = 1234  # seeds the model init, the synthetic data and every RNG
    micro_batch: int = 4  # sequences per rank per forward/backward
    # Sequences per optimizer step over all ranks; 0 means micro_batch x data-parallel size.
    # Must be a multiple of micro_batch x data-parallel size (the rest is gradient accumulation).
    global_batch: int = 0
    seq_len: int = 128  # tokens per sequence
    dtype: str = "bf16"  # compute dtype on GPU; CPU runs always compute in fp32
    lr: float = 3e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr of the cosine decay as a fraction of lr
    warmup_steps: int = 20  # linear warm-up length (optimizer steps)
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    data: str = "synthetic"  # "synthetic" (seeded, regenerable) or "memmap" (token .bin file)
    data_path: str = ""  # memmap: path of the flat token file
    data_dtype: str = "uint16"  # memmap: token width in the file
    ckpt_interval_steps: int = 100  # checkpoint every N steps; 0 = only on signal / at the end
    ckpt_at_end: bool = True  # save a checkpoint after the last step
    # Rank 0 logs "step N/M loss L ... tok/s ... mfu" every this many steps (and at the first
    # and last step), into its rank log (`slurmkit logs -f RUN`); 0 = never.
    log_interval_steps: int = 10
    # Stop after this step with a durable checkpoint and exit 95 as if signalled; 0 = off.
    stop_at_step: int = 0
    # torch.use_deterministic_algorithms, and DDP gradients summed in rank order whatever the
    # bucket layout (slurmkit.train.reduce): bit-exact resume, at some speed.
    deterministic: bool = True
    # torch.compile each transformer block (in place: checkpoint keys do not change). Faster
    # steps on a GPU; the first step of every generation pays the compile.
    compile: bool = False
    cpu_peak_tflops: float = 0.5  # peak TFLOP/s of one CPU rank, for MFU on CPU runs

    def __post_init__(self) -> None:
        _positive("train", steps=self.steps, micro_batch=self.micro_batch, seq_len=self.seq_len,
                  lr=self.lr, cpu_peak_tflops=self.cpu_peak_tflops)
        check_choices("train", self, self.CHOICES)
        for name in ("global_batch", "warmup_steps", "ckpt_interval_steps", "stop_at_step",
                     "grad_clip", "weight_decay", "log_interval_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    detected=f"train.{name}={getattr(self, name)}",
                    requirement=f"train.{name} is 0 or more",
                    fix=f"set train.{name} to 0 or a positive value",
                )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(
                detected=f"train.min_lr_ratio={self.min_lr_ratio}",
                requirement="0 <= train.min_lr_ratio <= 1",
                fix="set train.min_lr_ratio between 0 and 1 (e.g. 0.1)",
            )
        if self.data == "memmap" and not self.data_path:
            raise ConfigError(
                detected="train.data=memmap with an empty train.data_path",
                requirement="a memory-mapped dataset names its token file",
                fix="set train.data_path=/path/to/tokens.bin or train.data=synthetic",
            )
