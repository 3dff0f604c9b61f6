"""gpu_ops.q4, the linear 4-bit format: its quantizer and reference twin (the tensor-core kernel
over it: tests/test_gpu_nf4_tc.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_ops.nf4 import dequantize_nf4, quantize_nf4
from gpu_ops.q4 import dequantize_q4, quantize_q4


def test_q4_is_as_close_as_nf4_on_gaussian_weights():
    torch.manual_seed(0)
    w = torch.randn(96, 1024) * 0.02
    q4 = dequantize_q4(*quantize_q4(w))
    nf4 = dequantize_nf4(*quantize_nf4(w), w.shape)
    e_q4, e_nf4 = ((q4 - w).norm() / w.norm()).item(), ((nf4 - w).norm() / w.norm()).item()
    assert e_q4 < 0.1 and e_q4 < 1.05 * e_nf4


def test_q4_keeps_values_on_its_grid_and_zero_groups():
    s = 0.25  # a bf16 scale: the 16 levels (c − 3) · s, zero among them
    levels = (torch.arange(16.0) - 3) * s
    w = levels[torch.randint(0, 16, (8, 128))]
    w[:, :64] = levels[torch.randperm(16).repeat(4)]  # every level in the first group: its min and max
    w[:, 64:] = levels[torch.arange(64) % 16]
    w[3] = 0.0  # an all-zero row
    got = dequantize_q4(*quantize_q4(w))
    assert torch.equal(got, w)


def test_q4_packs_elements_2i_and_2i_plus_1_in_nibbles_i_and_i_plus_4():
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 1], w[0, 2] = 1.0, -1.0, 0.5
    packed, sz = quantize_q4(w)
    word = int(packed[0, 0])
    s = float((sz[0, 0] >> 16).to(torch.int16).view(torch.bfloat16))
    z = float((sz[0, 0] & 0xFFFF).to(torch.int16).view(torch.bfloat16)) - 128
    code = lambda nibble: (word >> (4 * nibble)) & 15  # noqa: E731
    assert (code(0) - z) * s == pytest.approx(1.0, abs=s / 2)  # element 0: nibble 0
    assert (code(4) - z) * s == pytest.approx(-1.0, abs=s / 2)  # element 1: nibble 4
    assert (code(1) - z) * s == pytest.approx(0.5, abs=s / 2)  # element 2: nibble 1
    assert code(5) == code(2) == z  # elements 3 and 4 are zero


def test_q4_keeps_each_groups_largest_magnitude_on_a_code():
    """The group's extreme (its largest |w|, often an outlier that matters) comes back within the
    bf16 rounding of its scale, not up to half a step off as with a rounded zero point."""
    torch.manual_seed(1)
    w = torch.randn(64, 512) * torch.rand(64, 1) + 0.3 * torch.randn(64, 1)  # groups off-centre, of any spread
    w[::3, 7] *= 6  # outliers
    packed, sz = quantize_q4(w)
    back, g = dequantize_q4(packed, sz).reshape(64, 8, 64), w.reshape(64, 8, 64)
    i = g.abs().argmax(-1, keepdim=True)
    assert torch.allclose(back.gather(-1, i), g.gather(-1, i), rtol=2**-7, atol=0)  # bf16 scale: 8 mantissa bits
    # the other end may clip by less than a step (the zero code is whole), plus half a step's rounding
    step = ((sz >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()
    assert ((back - g).abs().amax(-1) < 2 * step).all()


def test_the_planner_takes_q4_only_where_its_gemv_measured_faster():
    from planner import Budget, HardwareProfile, Overrides, Workload, plan
    from planner.tensors import WDtype
    from hetero.config import LLAMA3_8B

    hw = HardwareProfile.synthetic(80, pcie_gbps=55, dram_gbps=73, host_gib=128, cores=16, hbm_gbps=4000)
    args = (Budget(6 * 2**30, 100 * 2**30), Workload(8192))
    fast_q4 = dataclasses.replace(hw, gpu_gemv_gbps=1800.0, gpu_gemv_q4_gbps=2500.0, gpu_gemm_gbps=800.0,
                                  gpu_gemm_q4_gbps=500.0)  # the H200's shape: q4 faster at 1 row, slower at 32
    slow_q4 = dataclasses.replace(hw, gpu_gemv_gbps=1800.0, gpu_gemv_q4_gbps=1500.0)
    p = plan(LLAMA3_8B, fast_q4, *args)
    assert p.weights is WDtype.Q4 and any(c.setting == "--weights" and c.value == "q4" and "2500" in c.reason for c in p.choices)
    assert plan(LLAMA3_8B, slow_q4, *args).weights is WDtype.NF4
    assert plan(LLAMA3_8B, fast_q4, args[0], Workload(2048, batch=32)).weights is WDtype.NF4  # 32 rows: NF4's 800
    assert plan(LLAMA3_8B, hw, *args).weights is WDtype.NF4  # unmeasured: NF4
    assert plan(LLAMA3_8B, fast_q4, *args, Overrides(weights=WDtype.NF4)).weights is WDtype.NF4
    nf4 = plan(LLAMA3_8B, dataclasses.replace(fast_q4, gpu_gemv_q4_gbps=0.0), *args)
    assert p.prediction.decode_tok_s > nf4.prediction.decode_tok_s  # priced at q4's own rate


def test_q4_refuses_a_k_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="divisible by 64"):
        quantize_q4(torch.zeros(4, 100))


def test_q4_plans_keep_a_moe_layers_experts_in_nf4():
    """--weights q4: the dense matrices in q4, the experts NF4 (the grouped expert kernels' format),
    the host's experts int4 as with 4bit; the bytes are NF4's, so the placement is the same."""
    from planner import Budget, HardwareProfile, Overrides, Workload, plan
    from planner.tensors import Kind, WDtype
    from test_planner import QWEN3_30B_A3B

    hw = HardwareProfile.synthetic(80, pcie_gbps=55, dram_gbps=73, host_gib=128, cores=16, hbm_gbps=2900)
    args = (QWEN3_30B_A3B, hw, Budget(8 * 2**30, 100 * 2**30), Workload(4096))
    q4, nf4 = plan(*args, Overrides(weights=WDtype.Q4)), plan(*args)
    dt = {(p.kind, p.on_gpu, p.dtype) for p in q4.placements}
    assert (Kind.ATTN, True, WDtype.Q4) in dt and (Kind.EXPERTS, True, WDtype.NF4) in dt
    assert (Kind.EXPERTS, False, WDtype.INT4) in dt
    assert [(p.name, p.on_gpu, p.nbytes) for p in q4.placements] == [(p.name, p.on_gpu, p.nbytes) for p in nf4.placements]


def test_q4_groups_streamed_by_a_gpu_plan_give_the_resident_tokens(tiny):
    """A GPU plan on the CPU stand-in: streamed q4 groups are the resident ones' bytes."""
    import hetero
    from conftest import forced_plan
    from planner.plan import Mode
    from planner.tensors import Kind, WDtype

    folder, _ = tiny("llama_4l")
    prompt = [3, 17, 42, 99, 5]
    runs = []
    for force in ({}, {(i, Kind.MLP): Mode.STREAM for i in range(4)}):
        e = hetero.load(folder, device="cpu", plan=forced_plan(folder, force, weights=WDtype.Q4), tokenizer=False,
                        ctx_size=64)
        assert e.model.layers[0].gate_up.codes.value == "q4"
        runs.append([c.token for c in e.generate(prompt, max_new_tokens=8, temperature=0.0)])
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 5, 32, 100])
def test_gpu_q4_linear_matches_its_reference(rows):
    """Each row count's kernel (the tensor-core GEMV, nf4_mma's linear decode, the bf16
    dequantization and matmul) against x · dequantize_q4ᵀ + b in float64."""
    from conftest import rel_err
    from gpu_ops.nf4 import Codes, nf4_linear

    torch.manual_seed(rows)
    N, K = 1000, 2048
    w, b = torch.randn(N, K, device="cuda") * 0.02, torch.randn(N, device="cuda")
    lin = nf4_linear(w, b, torch.device("cuda"), codes=Codes.Q4)
    x = torch.randn(rows, K, device="cuda").bfloat16()
    y = lin(x)
    ref = x.double() @ dequantize_q4(*lin.q4_words(), torch.float64).T + b.bfloat16().double()
    assert y.dtype == torch.bfloat16 and y.shape == (rows, N) and rel_err(y, ref) < 6e-3
