"""A mixture-of-experts layer's device experts for many rows (a prefill chunk) in two launches: a
grouped NF4 GEMM over every expert at once, instead of one expert's GEMMs at a time.

    sort_slots:  the chunk's slots (token n, choice s: flat n·k + s) grouped by the device expert
                 they route to, each expert's run padded to whole blocks of BLOCK_M rows, and each
                 block's expert; slots routed elsewhere (−1) in no block
    grouped_gemm: per (block, tile of output columns) program: the block's expert's codes read once
                 for its rows (x gathered by slot), dequantized in registers (as gpu_ops.nf4_triton),
                 two tensor-core dots a group of 64; gate/up with SiLU·up fused (W = [gate; up]);
                 each row stored at its slot

A layer's experts then cost their bytes once (a 512-token chunk of Qwen3-30B-A3B routes ~32 rows
to each of 128 experts), where one expert at a time paid ~85 µs of launches and gathers each
(bench/RESULTS.md, MoE prefill). Nothing is read back to the host: the grid is sized for the
most blocks any routing needs (ceil(P / BLOCK_M) + E), and the blocks past the last run exit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_ops.nf4_triton import _pair_table


@triton.jit
def _tile(w_e, a_e, rows, n_ok, k, K, lut_ptr, xe, xo, INT4: tl.constexpr, DOT_F32: tl.constexpr):
    """Σ over one group of 64 columns of x · W[rows]ᵀ, scaled: [BM, BN] float32. A group's byte j
    holds the weights that xe[:, j] and xo[:, j] multiply: NF4, elements 2j (high nibble) and 2j + 1
    (the table's bf16 values); int4, elements j (low nibble) and 32 + j, as code − 8."""
    offs_j = tl.arange(0, 32)
    wb = tl.load(w_e + rows[None, :].to(tl.int64) * (K // 2) + (k // 2 + offs_j[:, None]), mask=n_ok[None, :],
                 other=0)  # [32, BN] uint8
    if INT4:
        w_even = ((wb & 15).to(tl.int32) - 8).to(tl.float32)
        w_odd = ((wb >> 4).to(tl.int32) - 8).to(tl.float32)
    else:
        pair = tl.load(lut_ptr + wb.to(tl.int32))
        w_even = (pair & -65536).to(tl.float32, bitcast=True)
        w_odd = (pair << 16).to(tl.float32, bitcast=True)
    if DOT_F32:  # exact products: for checks (Triton's CPU interpreter mishandles bf16 dots)
        part = tl.dot(xe.to(tl.float32), w_even) + tl.dot(xo.to(tl.float32), w_odd)
    else:
        part = tl.dot(xe, w_even.to(tl.bfloat16)) + tl.dot(xo, w_odd.to(tl.bfloat16))
    sc = tl.load(a_e + rows.to(tl.int64) * (K // 64) + k // 64, mask=n_ok, other=0.0)
    return part * sc[None, :]


@triton.jit
def _grouped_kernel(x_ptr, slots_ptr, block_expert_ptr, w_ptr, absmax_ptr, lut_ptr, y_ptr,
                    K, NO, stride_x, expert_bytes, expert_groups,
                    XDIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr,
                    INT4: tl.constexpr, DOT_F32: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM], −1: padding
        m_ok = slot >= 0
        x_rows = x_ptr + tl.where(m_ok, slot // XDIV, 0).to(tl.int64)[:, None] * stride_x
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < NO
        offs_j = tl.arange(0, 32)
        # the columns the group's bytes pair with (`_tile`): int4 its two halves, NF4 even and odd
        even = offs_j if INT4 else 2 * offs_j
        odd = offs_j + 32 if INT4 else 2 * offs_j + 1
        w_e = w_ptr + e.to(tl.int64) * expert_bytes
        a_e = absmax_ptr + e.to(tl.int64) * expert_groups
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, 64):
            xe = tl.load(x_rows + (k + even[None, :]), mask=m_ok[:, None], other=0.0)  # [BM, 32]
            xo = tl.load(x_rows + (k + odd[None, :]), mask=m_ok[:, None], other=0.0)
            acc += _tile(w_e, a_e, offs_n, n_ok, k, K, lut_ptr, xe, xo, INT4, DOT_F32)
            if SWIGLU:
                up += _tile(w_e, a_e, offs_n + NO, n_ok, k, K, lut_ptr, xe, xo, INT4, DOT_F32)
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * up
        out = y_ptr + slot.to(tl.int64)[:, None] * NO + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_rows(slots: int, experts: int) -> int:
    """Rows a block: the average run of a device expert, rounded up to a tensor-core tile (16–64)."""
    mean = slots // max(1, experts)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def sort_slots(local: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """local [N, k] (each slot's device expert, −1: elsewhere) → (slots [B·bm] int32: each block's
    slots in order, −1 padding; block_expert [B] int32, −1 past the last run), B = ceil(N·k / bm) +
    experts. Torch ops on the device only: nothing syncs."""
    key = local.reshape(-1).long()
    P, dev = key.numel(), key.device
    key = torch.where(key < 0, experts, key)  # elsewhere: sorted last, in no run
    order = torch.argsort(key, stable=True)
    sk = key[order]
    counts = torch.bincount(key, minlength=experts + 1)[:experts]
    padded = (counts + bm - 1) // bm * bm
    pad_end = torch.cumsum(padded, 0)
    e = sk.clamp(max=experts - 1)
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[e]
    B = -(-P // bm) + experts
    pos = torch.where(sk < experts, (pad_end - padded)[e] + rank, B * bm)  # elsewhere: the spare last entry
    slots = torch.full((B * bm + 1,), -1, dtype=torch.int32, device=dev)
    slots.scatter_(0, pos, order.to(torch.int32))
    starts = torch.arange(B, device=dev) * bm
    blk = torch.searchsorted(pad_end, starts, right=True)
    return slots[:-1], torch.where(blk < experts, blk, -1).to(torch.int32)


def grouped_gemm(x: torch.Tensor, slots: torch.Tensor, block_expert: torch.Tensor, bm: int, packed: torch.Tensor,
                absmax: torch.Tensor, shape: tuple[int, int], xdiv: int, rows: int, swiglu: bool = False,
                zero: bool = False, dot_f32: bool = False, int4: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """y [rows, N] (N/2 for swiglu) bf16 (float32 where dot_f32): y[s] = W_e · x[s // xdiv] for each
    slot s of a block of expert e (`sort_slots`), W_e [N, K] the e-th of the NF4 stack (packed
    [E, N·K/2], absmax [E, N·K/64]; int4: the host experts' format, codes [E, N, K/2] and scales
    [E, N, K/64], cpu_attention.experts); other rows zero where `zero`, else left unwritten (or
    those of `out`, which takes y where given)."""
    N, K = shape
    if K % 64:
        raise ValueError(f"grouped_gemm needs K divisible by 64, got W {shape}")
    NO = N // 2 if swiglu else N
    x = x.to(torch.float32 if dot_f32 else torch.bfloat16)
    if x.stride(-1) != 1:
        x = x.contiguous()
    dtype = torch.float32 if dot_f32 else torch.bfloat16
    y = out if out is not None else (torch.zeros if zero else torch.empty)((rows, NO), dtype=dtype, device=x.device)
    BN = 64
    grid = (triton.cdiv(NO, BN), block_expert.numel())
    _grouped_kernel[grid](x, slots, block_expert, packed, absmax, _pair_table(x.device), y,
                          K, NO, x.stride(0), N * K // 2, N * K // 64,
                          XDIV=xdiv, BLOCK_M=bm, BLOCK_N=BN, SWIGLU=swiglu, INT4=int4, DOT_F32=dot_f32,
                          num_warps=8, num_stages=3)  # 4 warps spill at 32–64 rows with SiLU·up (ptxas, sm_90)
    return y
