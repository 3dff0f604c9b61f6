"""The int8 CPU kernels against their torch twins, and the twins against float math.

Tolerances: the kernels compute in float32 with sums reassociated across SIMD lanes, the
twins in float64 over the same dequantized weights, so they agree to float32 rounding of
dot products of length ≤ 1536 (relative 1e-5 of the output's scale). Quantization itself
(the twin against the unquantized weight) is bounded by half a step per weight: 0.5/127 of
the row's max |w|, which for random rows is ~1% of the output's scale.
"""
from __future__ import annotations

import pytest
import torch

from cpu_attention import linear as cl
from hetero.config import Arch, ModelConfig
from hetero.model import LayerWeights, Model, rms_norm


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    err = (a.double() - b.double()).abs().max().item()
    assert err <= rel * b.double().abs().max().item(), f"max error {err:.3g}, scale {b.abs().max().item():.3g}"


@pytest.mark.parametrize("shape", [(1, 7), (37, 13), (576, 1536), (131, 64)])
def test_quantize_rows_error_is_half_a_step(shape):
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    q, s = cl.quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.allclose(s, w.abs().amax(1) / 127)
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] * 0.5 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 3, 8, 33])  # 33: above GEMV_MAX_ROWS, the dequantize + GEMM path
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_twin(rows, bias):
    torch.manual_seed(rows)
    w, b = torch.randn(97, 131), torch.randn(97) if bias else None
    lin = cl.Int8Linear(w, b)
    x = torch.randn(rows, 131)
    y = lin(x)
    assert y.shape == (rows, 97) and y.dtype == torch.float32
    _close(y, cl.int8_linear_ref(x.double(), lin.q, lin.scale, lin.bias), 1e-5)
    _close(cl.int8_linear_ref(x.double(), lin.q, lin.scale, lin.bias), torch.nn.functional.linear(x, w, b), 0.05)


def test_int8_linear_gemm_in_pieces(monkeypatch):
    """Past GEMV_MAX_ROWS the weights are dequantized DEQUANT_ROWS rows at a time: pieces and a
    short last one give the twin's output."""
    monkeypatch.setattr(cl, "DEQUANT_ROWS", 40)
    torch.manual_seed(5)
    lin = cl.Int8Linear(torch.randn(97, 64), torch.randn(97))
    x = torch.randn(cl.GEMV_MAX_ROWS + 3, 64)
    _close(lin(x), cl.int8_linear_ref(x.double(), lin.q, lin.scale, lin.bias), 1e-5)


@pytest.mark.parametrize("rows", [2, 5, cl.ROW_BY_ROW])
def test_int8_gemv_row_is_the_same_bits_beside_any_rows(rows):
    """Up to ROW_BY_ROW rows, a row's output is the same bits alone and at any place among others
    (a speculative step's rows must score as a plain step's row does)."""
    torch.manual_seed(rows)
    lin = cl.Int8Linear(torch.randn(61, 200))
    x = torch.randn(rows, 200)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(lin(x), alone)
    assert torch.equal(lin(x.flip(0)), alone.flip(0))


@pytest.mark.parametrize("rows", [cl.ROW_BY_ROW + 1, 14, cl.GEMV_MAX_ROWS])
def test_int8_gemv_in_groups_of_four_rows(rows):
    """Past ROW_BY_ROW rows the GEMV takes four rows a weight conversion (and the rest one by
    one): the twin's output."""
    torch.manual_seed(rows)
    lin = cl.Int8Linear(torch.randn(61, 200), torch.randn(61))
    x = torch.randn(rows, 200)
    _close(lin(x), cl.int8_linear_ref(x.double(), lin.q, lin.scale, lin.bias), 1e-5)


def test_int8_linear_accepts_other_dtypes_and_strides():
    lin = cl.Int8Linear(torch.randn(33, 20))
    x = torch.randn(20, 2, dtype=torch.float64).t()  # [2, 20], not contiguous
    _close(lin(x), cl.int8_linear_ref(x, lin.q, lin.scale, None), 1e-5)


def _rope_tables(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    f = torch.outer(torch.arange(n, dtype=torch.float64) * 7 + 3, 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat([f, f], -1)
    return emb.cos().float(), emb.sin().float()


@pytest.mark.parametrize("rows", [1, 2, 5, 14])  # 14: past ROW_BY_ROW, four rows a weight conversion
@pytest.mark.parametrize("bias", [False, True])
def test_attn_in_matches_twin(rows, bias):
    torch.manual_seed(rows)
    hq, hkv, d, h = 5, 1, 16, 48
    lin = cl.Int8Linear(torch.randn((hq + 2 * hkv) * d, h), torch.randn((hq + 2 * hkv) * d) if bias else None)
    x, nw = torch.randn(rows, h) * 3, torch.rand(h) + 0.5
    cos, sin = _rope_tables(40, d)
    pos = torch.randperm(40)[:rows]
    got = cl.attn_in(x, pos, nw, 1e-5, lin, cos, sin, hq, hkv)
    ref = cl.attn_in_ref(x.double(), pos, nw, 1e-5, lin, cos, sin, hq, hkv)
    for a, b, shape in zip(got, ref, [(rows, hq, d), (rows, hkv, d), (rows, hkv, d)]):
        assert a.shape == shape
        _close(a, b, 1e-5)
    # v is the model's own unfused math over the dequantized weight
    unfused = cl.int8_linear_ref(rms_norm(x, nw, 1e-5), lin.q, lin.scale, lin.bias)
    _close(ref[2].reshape(rows, -1), unfused[:, (hq + hkv) * d:], 1e-5)


@pytest.mark.parametrize("rows", [1, 4, 14])
def test_mlp_block_matches_twin(rows):
    torch.manual_seed(rows)
    h, f, a = 40, 72, 56  # odd sizes: hidden, intermediate, attention width
    o, gu, dn = cl.Int8Linear(torch.randn(h, a)), cl.Int8Linear(torch.randn(2 * f, h)), cl.Int8Linear(torch.randn(h, f))
    x, attn, nw = torch.randn(rows, h), torch.randn(rows, a), torch.rand(h) + 0.5
    y = cl.mlp_block(x, attn, o, nw, 1e-6, gu, dn)
    _close(y, cl.mlp_block_ref(x.double(), attn.double(), o, nw, 1e-6, gu, dn), 1e-5)


def test_fused_decode_matches_unfused_model_math():
    """A layer through Model's fused decode path equals the same layer through the torch path."""
    torch.manual_seed(0)
    cfg = ModelConfig(Arch.LLAMA, vocab_size=50, hidden_size=24, intermediate_size=40, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    lw = LayerWeights(attn_norm=torch.rand(24) + 0.5, qkv=cl.Int8Linear(torch.randn(64, 24)),
                      o=cl.Int8Linear(torch.randn(24, 32)), mlp_norm=torch.rand(24) + 0.5,
                      gate_up=cl.Int8Linear(torch.randn(2 * 40, 24)), down=cl.Int8Linear(torch.randn(24, 40)))
    m = Model(cfg, torch.randn(50, 24), torch.ones(24), cl.Int8Linear(torch.randn(50, 24)), [lw], torch.device("cpu"))
    m.use_kernels(cl.Int8Layers, None)
    x, pos = torch.randn(3, 24), torch.tensor([0, 5, 300])
    q, k, v = m.pre_attention(0, x, pos)
    attn = torch.randn(3, 4, 8)
    y = m.post_attention(0, x, attn)
    m.use_kernels(None, None)  # the torch path, same weights
    q2, k2, v2 = m.pre_attention(0, x, pos)
    for a, b in ((q, q2), (k, k2), (v, v2), (y, m.post_attention(0, x, attn))):
        _close(a, b, 1e-5)
