"""Host experts that the GPU computes itself, reading their int4 weights from page-locked host
memory over PCIe (zero-copy), beside the CPU computing the others.

Why: at a tight budget a MoE decode step waits for the CPU's experts, and the CPU's kernel does
not read DRAM as fast as DRAM serves: measured on the GPU host (bench/dram_share.py), the pooled
expert kernel alone read 56 GB/s and a GPU kernel reading page-locked memory alone 46; both at
once, 45 + 45 = 89. So a part of a layer's host experts (`MoEFeedForward`'s `gpu_reads`: the
first of the host's stacks) is read by these kernels while the CPU computes the rest; their
weights stay where they are, in the format the CPU reads (`cpu_attention.experts`: 4-bit codes
two a byte, a float32 scale per 64 weights).

Two kernels a layer, like the device's own experts (`gpu_ops.nf4_gemv.nf4_experts_gemv`): each
routed slot s (token s // k) whose expert e has a host index j = read_map[e] ≥ 0 among those:

    gate_up:  act[s] = silu(x · gate_jᵀ) · (x · up_jᵀ)      bf16, rounded as the device's experts' kernel
    down:     y[s] = act[s] · down_jᵀ                       float32; a zero row for every other slot

The slots' expert ids are read on the device, so a CUDA graph holds both. The host pointers pass
as `host_read`'s pointer arguments (pinned memory is mapped at the same address). `host_experts_ref`
is the torch twin.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_ops.host_read import _HostPointer

ROWS = 8  # output rows a program, each read whole (up to CHUNK weights) in one load: few, long PCIe reads
CHUNK = 2048


@triton.jit
def _rows_dot(q_ptr, s_ptr, rows, ok, xl, xh, k0, K: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr):
    """Σ over weights k0 .. k0 + BK of W[rows] · x: codes [BO, BK/2] bytes (byte c of a group: weight
    c low, weight 32 + c high; xl, xh the matching x), a scale a group."""
    c = tl.arange(0, BK // 2)
    b = tl.load(q_ptr + rows[:, None].to(tl.int64) * (K // 2) + k0 // 2 + c[None, :], mask=ok[:, None], other=0)
    lo = (b & 15).to(tl.float32) - 8.0
    hi = (b >> 4).to(tl.float32) - 8.0
    part = tl.sum(tl.reshape(lo * xl[None, :] + hi * xh[None, :], [BO, BK // 64, 32]), axis=2)
    g = tl.arange(0, BK // 64)
    s = tl.load(s_ptr + rows[:, None].to(tl.int64) * (K // 64) + k0 // 64 + g[None, :], mask=ok[:, None], other=0.0)
    return tl.sum(part * s, axis=1)


@triton.jit
def _x_pair(x_ptr, k0, BK: tl.constexpr):
    """x's weights matching a chunk's low and high nibbles, float32 [BK/2] each."""
    c = tl.arange(0, BK // 2)
    col = k0 + (c // 32) * 64 + c % 32
    return tl.load(x_ptr + col).to(tl.float32), tl.load(x_ptr + col + 32).to(tl.float32)


@triton.jit
def _gate_up_kernel(x_ptr, idx_ptr, map_ptr, q_ptr, s_ptr, act_ptr, Fi, K: tl.constexpr, XDIV: tl.constexpr,
                    BO: tl.constexpr, BK: tl.constexpr):
    pid, slot = tl.program_id(0), tl.program_id(1)
    j = tl.load(map_ptr + tl.load(idx_ptr + slot))
    if j >= 0:
        rows = pid * BO + tl.arange(0, BO)
        ok = rows < Fi
        q = q_ptr + j.to(tl.int64) * (2 * Fi) * (K // 2)
        s = s_ptr + j.to(tl.int64) * (2 * Fi) * (K // 64)
        xrow = x_ptr + (slot // XDIV).to(tl.int64) * K
        g = tl.zeros([BO], tl.float32)
        u = tl.zeros([BO], tl.float32)
        for k0 in range(0, K, BK):
            xl, xh = _x_pair(xrow, k0, BK)
            g += _rows_dot(q, s, rows, ok, xl, xh, k0, K, BO, BK)
            u += _rows_dot(q, s, rows + Fi, ok, xl, xh, k0, K, BO, BK)
        g = g.to(tl.bfloat16).to(tl.float32)  # each projection rounded to bf16, as the device's experts
        u = u.to(tl.bfloat16).to(tl.float32)
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(act_ptr + slot.to(tl.int64) * Fi + rows, act.to(tl.bfloat16), mask=ok)


@triton.jit
def _down_kernel(a_ptr, idx_ptr, map_ptr, q_ptr, s_ptr, y_ptr, H, K: tl.constexpr, BO: tl.constexpr,
                 BK: tl.constexpr):
    pid, slot = tl.program_id(0), tl.program_id(1)
    j = tl.load(map_ptr + tl.load(idx_ptr + slot))
    rows = pid * BO + tl.arange(0, BO)
    ok = rows < H
    acc = tl.zeros([BO], tl.float32)
    if j >= 0:
        q = q_ptr + j.to(tl.int64) * H * (K // 2)
        s = s_ptr + j.to(tl.int64) * H * (K // 64)
        arow = a_ptr + slot.to(tl.int64) * K
        for k0 in range(0, K, BK):
            xl, xh = _x_pair(arow, k0, BK)
            acc += _rows_dot(q, s, rows, ok, xl, xh, k0, K, BO, BK)
    tl.store(y_ptr + slot.to(tl.int64) * H + rows, acc, mask=ok)


def _chunk(K: int) -> int:
    """Weights a loop step reads of a row: the largest power of two up to CHUNK that divides K (≥ 64)."""
    b = CHUNK
    while K % b:
        b //= 2
    return b


def host_experts_gemv(x: torch.Tensor, idx: torch.Tensor, read_map: torch.Tensor, stacks: tuple[torch.Tensor, ...],
                      k: int) -> torch.Tensor:
    """x [N, H] bf16 (CUDA), idx [N, k] int32 (each slot's expert), read_map [E] int32 (an expert's
    index in the stacks, −1: not read here), stacks: the host's page-locked int4 stacks (gate/up codes
    [J, 2F, H/2] and scales [J, 2F, H/64], down codes [J, H, F/2] and scales [J, H, F/64]; at least the
    read experts) → y [N·k, H] float32: each read slot's expert output, zero rows elsewhere."""
    gu_q, gu_s, d_q, d_s = stacks
    N, H = x.shape
    Fi = d_q.shape[2] * 2
    if H % 64 or Fi % 64:
        raise ValueError(f"int4 experts need multiples of 64 weights a row, got hidden {H}, expert FFN {Fi}")
    S = idx.numel()
    x = x.to(torch.bfloat16).contiguous()
    idx = idx.reshape(-1).contiguous()
    act = torch.empty((S, Fi), dtype=torch.bfloat16, device=x.device)
    y = torch.empty((S, H), dtype=torch.float32, device=x.device)
    ptr = [_HostPointer(t) if not t.is_cuda else t for t in (gu_q, gu_s, d_q, d_s)]
    _gate_up_kernel[(triton.cdiv(Fi, ROWS), S)](x, idx, read_map, ptr[0], ptr[1], act, Fi, K=H, XDIV=k, BO=ROWS,
                                                 BK=_chunk(H), num_warps=8)
    _down_kernel[(triton.cdiv(H, ROWS), S)](act, idx, read_map, ptr[2], ptr[3], y, H, K=Fi, BO=ROWS, BK=_chunk(Fi),
                                            num_warps=8)
    return y


def host_experts_ref(x: torch.Tensor, idx: torch.Tensor, read_map: torch.Tensor, stacks: tuple[torch.Tensor, ...],
                     k: int) -> torch.Tensor:
    """The torch twin of `host_experts_gemv` (float32 math, the same bf16 roundings), on x's device."""
    from cpu_attention.experts import dequantize_int4

    gu_q, gu_s, d_q, d_s = (t.to(x.device) for t in stacks)
    idx = idx.reshape(-1)
    y = torch.zeros(idx.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    for s, e in enumerate(idx.tolist()):
        j = int(read_map[e])
        if j < 0:
            continue
        g, u = (x[s // k].float() @ dequantize_int4(gu_q[j], gu_s[j]).T).bfloat16().float().chunk(2)
        act = (F.silu(g) * u).bfloat16().float()
        y[s] = act @ dequantize_int4(d_q[j], d_s[j]).T
    return y
