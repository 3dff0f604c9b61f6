"""Triton NF4 matmul for few rows (decode): reads each weight byte once, dequantizes in registers.

Why it exists: bitsandbytes at 1 row runs a gemv that does not reach HBM speed on every shape,
and for 2..64 rows on sm90 it mostly dequantizes the whole weight to bf16 and calls cuBLAS,
moving 2 + 2 extra bytes per weight (see bench/gpu_decode.py's per-shape table).

Same format as `gpu_ops.nf4` (high nibble = even element, absmax per 64 elements). Per group
of 64 weights of one output row the partial dot product is scaled once by that group's absmax:
    y[m, n] = Σ_g absmax[n, g] · Σ_{k in g} x[m, k] · NF4[code[n, k]]
The code lookup goes through a 256-entry int32 table (one gather a byte, both nibbles' bf16
values packed in it) instead of two gathers. K is split across programs so that small-N
shapes still fill the GPU; partials [S, M, N] in float32 are summed (deterministically).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gpu_ops.nf4_code import BLOCK, NF4_CODE


@functools.cache
def _pair_table(device: torch.device) -> torch.Tensor:
    """[256] int32: bf16 bits of NF4[byte >> 4] in the high half, of NF4[byte & 15] in the low half."""
    bits = NF4_CODE.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    b = torch.arange(256)
    return ((bits[b >> 4] << 16) | bits[b & 15]).to(torch.int32).to(device)


@triton.jit
def _nf4_mm_kernel(
    x_ptr, w_ptr, absmax_ptr, lut_ptr, part_ptr,
    M, N, K, stride_xm, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 32)  # byte j of a group holds elements 2j (high nibble) and 2j + 1
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = pid_s * k_per_split
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * (K // 2)  # [1, BN]
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BM, 1]
    for k in range(k0, k0 + k_per_split, 64):
        wb = tl.load(w_rows + (k // 2 + offs_j[:, None]), mask=n_ok[None, :], other=0)  # [32, BN] uint8
        pair = tl.load(lut_ptr + wb.to(tl.int32))  # [32, BN] int32
        w_hi = (pair & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)
        w_lo = (pair << 16).to(tl.float32, bitcast=True).to(tl.bfloat16)
        xe = tl.load(x_rows + (k + 2 * offs_j[None, :]), mask=m_ok[:, None], other=0.0)  # [BM, 32]
        xo = tl.load(x_rows + (k + 1 + 2 * offs_j[None, :]), mask=m_ok[:, None], other=0.0)
        if DOT_F32:  # exact products: for checks (Triton's CPU interpreter mishandles bf16 dots)
            xe, xo, w_hi, w_lo = xe.to(tl.float32), xo.to(tl.float32), w_hi.to(tl.float32), w_lo.to(tl.float32)
        part = tl.dot(xe, w_hi) + tl.dot(xo, w_lo)  # [BM, BN] float32
        sc = tl.load(absmax_ptr + offs_n.to(tl.int64) * (K // 64) + k // 64, mask=n_ok, other=0.0)  # [BN]
        acc += part * sc[None, :]
    out = part_ptr + pid_s * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _nf4_gemv_kernel(
    x32_ptr, w_ptr, absmax_ptr, lut_ptr, part_ptr, N, K, k_per_split,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
):
    """One row of x: FMAs on the CUDA cores, tiles [BLOCK_N, GROUPS, 32 bytes], no tensor cores."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    g = tl.arange(0, GROUPS)
    j = tl.arange(0, 32)
    rows = w_ptr + offs_n.to(tl.int64) * (K // 2)  # [BN]
    scales = absmax_ptr + offs_n.to(tl.int64) * (K // 64)  # [BN]
    acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
    k0 = pid_s * k_per_split
    for k in range(k0, k0 + k_per_split, 64 * GROUPS):
        byte = k // 2 + g[:, None] * 32 + j[None, :]  # [G, 32]
        wb = tl.load(rows[:, None, None] + byte[None, :, :], mask=n_ok[:, None, None], other=0)  # [BN, G, 32]
        pair = tl.load(lut_ptr + wb.to(tl.int32))
        xv = tl.load(x32_ptr + byte)  # [G, 32] int32: x[2b] in the low half, x[2b + 1] in the high
        xe = (xv << 16).to(tl.float32, bitcast=True)
        xo = (xv & -65536).to(tl.float32, bitcast=True)
        w_hi = (pair & -65536).to(tl.float32, bitcast=True)
        w_lo = (pair << 16).to(tl.float32, bitcast=True)
        part = tl.sum(w_hi * xe[None, :, :] + w_lo * xo[None, :, :], axis=2)  # [BN, G]
        sc = tl.load(scales[:, None] + (k // 64 + g)[None, :], mask=n_ok[:, None], other=0.0)
        acc += part * sc
    tl.store(part_ptr + pid_s * N + offs_n, tl.sum(acc, axis=1), mask=n_ok)


def _splits(n_tiles: int, steps: int, programs: int) -> int:
    """Largest divisor of `steps` (K-steps of a program) that brings the grid near `programs`."""
    want = max(1, -(-programs // n_tiles))
    return max(d for d in range(1, min(want, steps) + 1) if steps % d == 0)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def nf4_gemv(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int],
             block_n: int = 64, groups: int = 4, warps: int = 8) -> torch.Tensor:
    """x [1, K] bf16, W [N, K] as NF4 → y [1, N] bf16 (K divisible by 64 * groups)."""
    N, K = shape
    G, BN = groups, block_n
    if K % (64 * G) or x.shape[0] != 1:
        raise ValueError(f"nf4_gemv takes one row and K divisible by {64 * G}, got {tuple(x.shape)}")
    x32 = x.contiguous().view(torch.int32)  # bf16 pairs
    n_tiles = triton.cdiv(N, BN)
    S = _splits(n_tiles, K // (64 * G), 16 * _sms(x.device))  # ~16 programs an SM keep HBM busy
    part = torch.empty((S, N), dtype=torch.float32, device=x.device)
    _nf4_gemv_kernel[(n_tiles, S)](x32, packed, absmax, _pair_table(x.device), part, N, K, K // S,
                                   BLOCK_N=BN, GROUPS=G, num_warps=warps)
    y = part[0] if S == 1 else part.sum(0)
    return y.to(torch.bfloat16)[None]


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int],
               dot_f32: bool = False) -> torch.Tensor:
    """x [M, K] bf16 (M ≤ 64 is where it pays), W [N, K] as NF4 → y [M, N] bf16 (float32 if dot_f32)."""
    N, K = shape
    if K % BLOCK:
        raise ValueError(f"the Triton NF4 kernel needs in_features divisible by {BLOCK}, got {K}")
    x = x.contiguous()
    M = x.shape[0]
    BM = 16 if M <= 16 else 32 if M <= 32 else 64
    BN = 128 if N >= 8192 else 64
    n_tiles = triton.cdiv(N, BN)
    S = _splits(n_tiles * triton.cdiv(M, BM), K // 64, 4 * _sms(x.device))
    part = torch.empty((S, M, N), dtype=torch.float32, device=x.device)
    grid = (n_tiles, S, triton.cdiv(M, BM))
    _nf4_mm_kernel[grid](
        x, packed, absmax, _pair_table(x.device), part, M, N, K, x.stride(0), K // S,
        BLOCK_M=BM, BLOCK_N=BN, DOT_F32=dot_f32, num_warps=4, num_stages=4,
    )
    y = part[0] if S == 1 else part.sum(0)
    return y if dot_f32 else y.to(torch.bfloat16)
