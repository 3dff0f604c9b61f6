"""Triton paged decode attention over the GPU pool: each K/V byte read once, output + LSE.

Why: the torch path gathers every block into a contiguous copy, converts it to float32 and
then reads it again (about 4x the bytes); at batch 32 × 2k context that is most of the step.

One program per (sequence, kv head, split): its G = Hq / Hkv query heads (padded to 16 rows for
the tensor cores) walk the sequence's blocks of that split with an online softmax. Splits over
the sequence keep the GPU busy at small batch; their partial (out, lse) are merged in torch.
Shapes are static (max blocks per sequence), so a CUDA graph can hold it.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gpu_ops import pdl

from gpu_ops.kv_pool import GpuKVPool


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr,
    layer_off, head_stride, block_stride,  # element offset of the layer; strides of heads, blocks
    MB, blocks_per_split, scale, B, Hq,
    G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    b, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.arange(0, GP)
    d = tl.arange(0, D)
    t = tl.arange(0, BS)
    row_ok = rows < G
    q = tl.load(q_ptr + ((b * Hq + h * G + rows) * D)[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    n = tl.load(len_ptr + b)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    first = sp * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(n, BS))
    for i in range(first, last):
        blk = tl.load(bt_ptr + b * MB + i).to(tl.int64)
        off = layer_off + blk * block_stride + h * head_stride + (t * D)[:, None] + d[None, :]  # [BS, D]
        k = tl.load(k_ptr + off)
        v = tl.load(v_ptr + off)
        if DOT_F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)  # [GP, BS]; scale may arrive as fp64 (inductor)
        s = tl.where((i * BS + t)[None, :] < n, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = p if DOT_F32 else p.to(tl.bfloat16)
        acc = acc * alpha[:, None] + tl.dot(pv, v)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    dst = (sp * B + b) * Hq + h * G + rows  # [GP]
    tl.store(o_ptr + (dst * D)[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + dst, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(o_ptr, lse_ptr, out_ptr, out_lse_ptr, S, BH, SP: tl.constexpr, D: tl.constexpr,
                         CH: tl.constexpr, PDL: tl.constexpr = False):
    """out[r] = Σ_s e^{lse[s, r] - L} o[s, r], L = log Σ_s e^{lse[s, r]}, for row r = (b, hq)."""
    r = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    sp = tl.arange(0, SP)
    lse = tl.load(lse_ptr + sp * BH + r, mask=sp < S, other=float("-inf"))
    mx = tl.max(lse, 0)
    m_safe = tl.where(mx == float("-inf"), 0.0, mx)
    tot = tl.sum(tl.exp(lse - m_safe), 0)
    big = tl.where(tot == 0.0, float("-inf"), m_safe + tl.log(tl.where(tot == 0.0, 1.0, tot)))
    big_safe = tl.where(tot == 0.0, 0.0, big)
    d = tl.arange(0, D)
    c = tl.arange(0, CH)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, S, CH):
        ok = s0 + c < S
        w = tl.exp(tl.load(lse_ptr + (s0 + c) * BH + r, mask=ok, other=float("-inf")) - big_safe)
        o = tl.load(o_ptr + ((s0 + c) * BH + r)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    tl.store(out_ptr + r * D + d, acc.to(out_ptr.dtype.element_ty))
    tl.store(out_lse_ptr + r, big)


def split_outputs(B: int, Hq: int, Hkv: int, D: int, MB: int, device: torch.device, out_dtype: torch.dtype):
    """Splits of a sequence's MB blocks and their partial outputs → (S, blocks a split, o [S, B, Hq, D],
    lse [S, B, Hq]). About 8 programs an SM (enough loads in flight to keep HBM busy), ≥ 4 blocks a
    split from 32 blocks on; below that a block a split (short contexts at batch 1: 8 programs walking
    5 blocks in turn took 8.5 µs, the latency of a chain of dependent dots)."""
    S = max(1, min(-(-8 * _sms(device) // (B * Hkv)), MB // 4 if MB >= 32 else MB))
    o = torch.empty((S, B, Hq, D), dtype=torch.float32 if S > 1 else out_dtype, device=device)
    lse = torch.empty((S, B, Hq), dtype=torch.float32, device=device)
    return S, -(-MB // S), o, lse


def merge_splits(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partials o [S, B, Hq, D], lse [S, B, Hq] → (out [B, Hq, D] out_dtype, lse [B, Hq]);
    one split is already the answer."""
    S, B, Hq, D = o.shape
    if S == 1:
        return o[0], lse[0]
    out = torch.empty((B, Hq, D), dtype=out_dtype, device=o.device)
    total = torch.empty((B, Hq), dtype=torch.float32, device=o.device)  # -inf where every split was empty
    _merge_splits_kernel[(B * Hq,)](o, lse, out, total, S, B * Hq, SP=triton.next_power_of_2(S), D=D, CH=16,
                                    PDL=pdl.enabled(o.device), num_warps=4, **pdl.launch(o.device))
    return out, total


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def paged_decode(
    pool: GpuKVPool, layer: int, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, dot_f32: bool = False, out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gpu_ops.attention.decode_attention` → (out [B, Hq, D] out_dtype, lse [B, Hq] float32)."""
    B, Hq, D = q.shape
    Hkv, BS = pool.num_kv_heads, pool.block_size
    G = Hq // Hkv
    MB = block_tables.shape[1]
    S, per, o, lse = split_outputs(B, Hq, Hkv, D, MB, q.device, out_dtype)
    k = pool.k
    _decode_kernel[(B, Hkv, S)](
        q.to(k.dtype).contiguous(), k, pool.v, block_tables.contiguous(), seq_lens.to(torch.int32).contiguous(), o, lse,
        layer * k.stride(0), k.stride(2), k.stride(1), MB, per, scale, B, Hq,
        G=G, GP=max(16, triton.next_power_of_2(G)), BS=BS, D=D, DOT_F32=dot_f32, PDL=pdl.enabled(q.device),
        num_warps=4, num_stages=2, **pdl.launch(q.device),
    )
    return merge_splits(o, lse, out_dtype)
