"""The Llama-3 model in plain torch: shapes, counts, causality, rotary, checkpointing."""

from __future__ import annotations

import torch

from slurmkit.train.config import ModelConfig
from slurmkit.train.flops import param_count
from slurmkit.train.model import Transformer, apply_rotary, compile_blocks, loss_fn, rotary_table

CFG = ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                  vocab_size=128, max_seq_len=32)


def model(ac: bool = False) -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG, activation_checkpointing=ac)


def test_parameter_count_matches_the_formula_and_head_is_untied() -> None:
    m = model()
    assert sum(p.numel() for p in m.parameters()) == param_count(CFG).total
    assert m.output.weight.data_ptr() != m.tok_embeddings.weight.data_ptr()
    attn = m.layers[0].attention
    assert attn.wk.weight.shape == (CFG.n_kv_heads * CFG.head_dim, CFG.dim)  # GQA
    assert "rope" not in m.state_dict()  # derived, never checkpointed


def test_forward_shape_and_loss_near_uniform_at_init() -> None:
    tokens = torch.randint(0, CFG.vocab_size, (2, 17))
    logits = model()(tokens[:, :-1])
    assert logits.shape == (2, 16, CFG.vocab_size) and logits.dtype == torch.float32
    loss = loss_fn(logits, tokens[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(128.0)).item()) < 1.0


def test_attention_is_causal() -> None:
    m = model().eval()
    a = torch.randint(0, CFG.vocab_size, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % CFG.vocab_size
    with torch.no_grad():
        la, lb = m(a), m(b)
    assert torch.equal(la[:, :8], lb[:, :8])
    assert not torch.allclose(la[:, 8:], lb[:, 8:])


def test_rotary_preserves_norm_and_relative_positions() -> None:
    table = rotary_table(8, 16, 500000.0)
    x = torch.randn(1, 16, 1, 8)
    rotated = apply_rotary(x, table)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rotated[:, 0], x[:, 0])  # position 0 is not rotated
    q = torch.randn(8).expand(1, 16, 1, 8)
    k = torch.randn(8).expand(1, 16, 1, 8)
    rq, rk = apply_rotary(q, table)[0, :, 0], apply_rotary(k, table)[0, :, 0]
    # The score depends on the distance only: <q_i, k_j> == <q_{i+3}, k_{j+3}>.
    assert torch.allclose(rq[2] @ rk[5], rq[7] @ rk[10], atol=1e-4)


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    tokens = torch.randint(0, CFG.vocab_size, (2, 17))
    grads = []
    for ac in (False, True):
        m = model(ac)
        loss_fn(m(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) == len(list(model().parameters()))
    for g0, g1 in zip(grads[0], grads[1]):
        assert torch.allclose(g0, g1, atol=1e-6)


def test_a_few_steps_fit_a_fixed_batch() -> None:
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    tokens = torch.randint(0, CFG.vocab_size, (4, 17))
    losses = []
    for _ in range(15):
        loss = loss_fn(m(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_rotary_matches_the_complex_rotation() -> None:
    # The real (cos, sin) form is the complex product (a + ib) * e^{i pos theta_k} written out.
    table = rotary_table(8, 16, 10000.0)
    x = torch.randn(2, 16, 3, 8)
    pairs = torch.view_as_complex(x.reshape(2, 16, 3, 4, 2).contiguous())
    angles = torch.view_as_complex(table.contiguous()).view(1, 16, 1, 4)
    expected = torch.view_as_real(pairs * angles).flatten(-2)
    assert torch.allclose(apply_rotary(x, table), expected, atol=1e-6)


def test_compiled_blocks_keep_parameter_names_and_outputs() -> None:
    torch.manual_seed(0)
    eager = Transformer(CFG)
    compiled = Transformer(CFG)
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoint keys unchanged
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.allclose(compiled(tokens), eager(tokens), atol=1e-4)
