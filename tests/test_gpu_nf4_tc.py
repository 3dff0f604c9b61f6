"""gpu_ops.nf4_tc: the tensor-core NF4 GEMV (CUDA C++ through NVRTC) against the dequantized
float64 product, its epilogues against torch's, and its experts' form against the Triton kernel's."""
from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from gpu_ops import nf4_tc
from gpu_ops.nf4 import dequantize_nf4, quantize_nf4

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# bf16(bf16(code) · bf16(absmax)) weights (two roundings of ≤ 2^-9 beyond bitsandbytes' one) and
# the bf16 output: ‖Δy‖/‖y‖ ≈ 2-3e-3 on random sums (as gpu_ops.nf4_mma's Scale.WEIGHT)
TC_ERR = 6e-3


def test_block_shapes_fill_the_gpu_before_splitting_k():
    assert nf4_tc.tc_config(tiles=384, chunks=32, sms=132) == nf4_tc.TcConfig(1, 8, 1)  # qkv: 6144 rows
    assert nf4_tc.tc_config(tiles=256, chunks=112, sms=132) == nf4_tc.TcConfig(1, 8, 2)  # down: K 14336
    assert nf4_tc.tc_config(tiles=1792, chunks=32, sms=132) == nf4_tc.TcConfig(2, 2, 4)  # gate_up
    assert nf4_tc.tc_config(tiles=7, chunks=2, sms=132) == nf4_tc.TcConfig(1, 2, 1)  # K of 256 codes: 2 ways


def test_cpu_tensors_never_take_the_cuda_kernel():
    assert not nf4_tc.enabled(torch.device("cpu"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("shape,config", [
    ((97, 4160), None),  # K = 64 · 65: the last chunk half full; N not a multiple of 16
    ((1000, 576), None),  # SmolLM2's hidden size
    ((4096, 1024), nf4_tc.TcConfig(1, 8, 1)),
    ((333, 2048), nf4_tc.TcConfig(2, 4, 4)),
    ((600, 4096), nf4_tc.TcConfig(8, 1, 2)),
    ((64, 14336), nf4_tc.TcConfig(1, 8, 2)),
    ((97, 4160), nf4_tc.TcConfig(1, 8, 1)),
])
def test_gpu_nf4_tc_gemv_matches_dequantized_reference(rows, shape, config):
    torch.manual_seed(rows + shape[0])
    w = torch.randn(shape, device="cuda") * 0.02
    packed, absmax = quantize_nf4(w)
    ref_w = dequantize_nf4(packed, absmax, shape).double()
    x = torch.randn(rows, shape[1], device="cuda").bfloat16()
    y = nf4_tc.nf4_tc_gemv(x, packed, absmax, shape, config=config)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, shape[0]) and torch.isfinite(y).all()
    assert rel_err(y, x.double() @ ref_w.T) < TC_ERR
    # each row of x alone gives its row of the batch: the other MMA columns do not leak in
    assert torch.equal(nf4_tc.nf4_tc_gemv(x[-1:], packed, absmax, shape, config=config), y[-1:])


@gpu
@pytest.mark.gpu
def test_gpu_nf4_tc_reads_strided_rows_of_x():
    torch.manual_seed(3)
    packed, absmax = quantize_nf4(torch.randn(512, 1024, device="cuda") * 0.02)
    big = torch.randn(3, 1024 + 64, device="cuda").bfloat16()
    x = big[:, 64:]  # rows 16-byte aligned, stride K + 64
    assert torch.equal(nf4_tc.nf4_tc_gemv(x, packed, absmax, (512, 1024)),
                       nf4_tc.nf4_tc_gemv(x.contiguous(), packed, absmax, (512, 1024)))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
def test_gpu_nf4_tc_epilogues_are_torchs(rows):
    """residual: bf16(bf16(y) + res), as torch adds; swiglu: silu(gate)·up of the bf16 halves."""
    from gpu_ops import fused

    torch.manual_seed(rows)
    F, K = 1000, 2048
    packed, absmax = quantize_nf4(torch.randn(2 * F, K, device="cuda") * 0.05)
    x = torch.randn(rows, K, device="cuda").bfloat16()
    y = nf4_tc.nf4_tc_gemv(x, packed, absmax, (2 * F, K))
    res = torch.randn(rows, 2 * F, device="cuda").bfloat16()
    assert torch.equal(nf4_tc.nf4_tc_gemv(x, packed, absmax, (2 * F, K), residual=res), res + y)
    got = nf4_tc.nf4_tc_gemv(x, packed, absmax, (2 * F, K), swiglu=True)
    assert got.shape == (rows, F) and rel_err(got, fused.silu_mul(y)) < 4e-3


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("xdiv,swiglu", [(1, False), (3, True), (2, False)])
def test_gpu_nf4_tc_experts_match_the_triton_kernel(xdiv, swiglu):
    from gpu_ops.nf4_gemv import Decode, nf4_experts_gemv

    torch.manual_seed(xdiv)
    E, N, K, R = 6, 1536, 2048, 3
    qs = [quantize_nf4(torch.randn(N, K, device="cuda") * 0.05) for _ in range(E)]
    packed, absmax = torch.stack([q[0] for q in qs]), torch.stack([q[1] for q in qs])
    x = torch.randn(R, K, device="cuda").bfloat16()
    eids = torch.randint(-1, E, (R * xdiv,), dtype=torch.int32, device="cuda")
    eids[0] = -1
    got = nf4_tc.nf4_tc_experts_gemv(x, eids, packed, absmax, (N, K), xdiv, swiglu=swiglu)
    nf4_tc.use(False)
    try:
        want = nf4_experts_gemv(x, eids, packed, absmax, (N, K), xdiv, swiglu=swiglu, decode=Decode.PRMT)
    finally:
        nf4_tc.use(True)
    assert got.shape == want.shape and got[0].abs().max() == 0
    assert rel_err(got.float(), want.float()) < (2e-2 if swiglu else TC_ERR)


@gpu
@pytest.mark.gpu
def test_gpu_nf4_tc_runs_inside_a_cuda_graph():
    torch.manual_seed(0)
    packed, absmax = quantize_nf4(torch.randn(4096, 4096, device="cuda") * 0.02)
    x = torch.randn(2, 4096, device="cuda").bfloat16()
    want = nf4_tc.nf4_tc_gemv(x, packed, absmax, (4096, 4096))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        nf4_tc.nf4_tc_gemv(x, packed, absmax, (4096, 4096))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            y = nf4_tc.nf4_tc_gemv(x, packed, absmax, (4096, 4096))
    x.copy_(torch.randn_like(x))
    want = nf4_tc.nf4_tc_gemv(x, packed, absmax, (4096, 4096))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape,config", [((97, 4160), None), ((1000, 576), None), ((600, 4096), nf4_tc.TcConfig(2, 2, 4))])
def test_gpu_q4_tc_gemv_matches_its_reference(rows, shape, config):
    """The linear format's weights come out of the kernel bit for bit as `dequantize_q4` gives them:
    only the bf16 output's rounding and the sums' order differ."""
    from gpu_ops.q4 import dequantize_q4, quantize_q4

    torch.manual_seed(rows + shape[0])
    packed, sz = quantize_q4(torch.randn(shape, device="cuda") * 0.02)
    x = torch.randn(rows, shape[1], device="cuda").bfloat16()
    y = nf4_tc.q4_tc_gemv(x, packed, sz, shape, config=config)
    assert y.shape == (rows, shape[0]) and torch.isfinite(y).all()
    assert rel_err(y, x.double() @ dequantize_q4(packed, sz, torch.float64).T) < 4e-3
    res = torch.randn(rows, shape[0], device="cuda").bfloat16()
    assert torch.equal(nf4_tc.q4_tc_gemv(x, packed, sz, shape, residual=res, config=config), res + y)
