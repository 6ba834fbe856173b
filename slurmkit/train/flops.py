"""Parameter count and training FLOPs of the Llama-3 architecture, from its shape alone.

Pure arithmetic (no torch) so the planner and the submitter can use it without building a
model. The counts match ``slurmkit.train.model.Transformer`` exactly (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

from slurmkit.train.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the model by part (counts, not bytes)."""

    embedding: int  # input token embedding table
    per_layer: int  # one transformer block (attention + feed-forward + two norms)
    layers: int  # all blocks
    final_norm: int
    output: int  # untied output head

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.output

    @property
    def non_embedding(self) -> int:
        """Parameters that take part in matrix multiplies (everything but the lookup table)."""
        return self.total - self.embedding


def layer_params(m: ModelConfig) -> int:
    """Parameters of one block: wq, wk, wv, wo, w1, w2, w3 and two RMSNorm weights."""
    kv_dim = m.n_kv_heads * m.head_dim
    attention = m.dim * m.dim * 2 + m.dim * kv_dim * 2
    feed_forward = 3 * m.dim * m.ffn_dim
    return attention + feed_forward + 2 * m.dim


def param_count(m: ModelConfig) -> ParamCount:
    """Exact parameter count of the architecture described by ``m``."""
    per_layer = layer_params(m)
    return ParamCount(
        embedding=m.vocab_size * m.dim,
        per_layer=per_layer,
        layers=per_layer * m.n_layers,
        final_norm=m.dim,
        output=m.vocab_size * m.dim,
    )


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6N + 12 * L * d * s.

    N counts the non-embedding parameters (the embedding is a lookup, not a matmul); the
    attention term is the score and value matmuls (2 * 2 * d * s per layer forward, tripled
    for backward), counted over the full sequence as PaLM's MFU definition does.
    """
    n = param_count(m).non_embedding
    return 6.0 * n + 12.0 * m.n_layers * m.dim * seq_len


def mfu(tokens_per_s_per_device: float, flops_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak (0..1)."""
    if peak_tflops <= 0:
        return 0.0
    return tokens_per_s_per_device * flops_token / (peak_tflops * 1e12)
