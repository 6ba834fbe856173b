"""The Llama-3 decoder in plain torch: RMSNorm, rotary embeddings, GQA, SwiGLU, untied head.

Module names (``tok_embeddings``, ``layers.<i>.attention.wq``, ``output`` ...) follow Meta's
reference so checkpoint keys read familiar. Blocks are kept in a ``ModuleList`` so FSDP2 can
shard them one by one and activation checkpointing can wrap them one by one.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from slurmkit.train.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale; computed in fp32 for stability."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Cosines and sines of pos * theta^(-2k/d): shape (max_seq_len, head_dim // 2, 2), fp32.

    Real numbers, not complex: the same rotation, and torch.compile generates code for it
    (inductor has no complex kernels and falls back to eager ones around them).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).to(torch.float32)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by the position's angle.

    Pair (a, b) at position p becomes (a cos - b sin, a sin + b cos), computed in fp32.
    """
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rot = table[: x.shape[1]].view(1, x.shape[1], 1, -1, 2)
    cos, sin = rot[..., 0], rot[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: n_kv_heads key/value heads shared by n_heads queries."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        # Repeat KV heads explicitly: SDPA's enable_gqa is not available on every backend.
        repeat = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(repeat, dim=2)
        v = v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: ModelConfig, *, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = activation_checkpointing
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # A buffer, not a parameter: derived from the shape, never trained nor checkpointed.
        self.register_buffer(
            "rope", rotary_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights, depth-scaled output projections, unit norm scales."""
        std = 0.02
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for module in self.layers:
            block = cast(TransformerBlock, module)  # ModuleList items are typed as Module
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv,
                        block.feed_forward.w1, block.feed_forward.w3):
                nn.init.normal_(lin.weight, std=std)
            for lin in (block.attention.wo, block.feed_forward.w2):
                nn.init.normal_(lin.weight, std=std / (2 * self.cfg.n_layers) ** 0.5)
        nn.init.normal_(self.output.weight, std=self.cfg.dim ** -0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens exceeds model.max_seq_len="
                f"{self.cfg.max_seq_len}"
            )
        h = self.tok_embeddings(tokens)
        rope = cast(torch.Tensor, self.rope)
        for block in self.layers:
            if self.activation_checkpointing and self.training:
                h = checkpoint(block, h, rope, use_reentrant=False)
            else:
                h = block(h, rope)
        return self.output(self.norm(h)).float()


def compile_blocks(model: Transformer) -> None:
    """torch.compile every block in place (``Module.compile``: parameter names, and so
    checkpoint keys, stay as they are). The blocks share one code, so the compile is paid
    once per generation, at its first step."""
    for block in model.layers:
        block.compile()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
