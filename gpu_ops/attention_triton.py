"""Triton paged decode attention over the GPU pool: each K/V byte read once, output + LSE.

Why: the torch path gathers every block into a contiguous copy, converts it to float32 and
then reads it again (about 4x the bytes); at batch 32 × 2k context that is most of the step.

One program per (sequence, kv head, split): its G = Hq / Hkv query heads (padded to 16 rows for
the tensor cores) walk the sequence's blocks of that split, up to STEP_TOKENS tokens of whole blocks
a step, with an online softmax. Splits over the sequence keep the GPU busy at small batch; their
partial (out, lse) are merged by a second kernel.
Shapes are static (max blocks per sequence), so a CUDA graph can hold it.

Runs (a speculative step's rows: `RunRows`): R consecutive batch rows of one sequence at
consecutive positions share its block table and differ only in length. A program takes TR =
GP / G of the run's rows as its GP query rows, each masked at its own length, so a KV block is
read once for every TR rows (runs of up to 4 rows at Llama's G = 4: once a run); the program of
the run's row j takes rows j·TR .., and those past the run's end find nothing to do. GP stays
16: at 32 rows the quantized kernels took 255 registers, and an int8 run of 5 rows took 5.2×
one row's time, against 3.7× for the rows one by one. The runs are a tensor, so one captured
graph serves any grouping.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gpu_ops import pdl
from gpu_ops.runs import ROWS, RunRows, programs_per_run
from gpu_ops.kv_pool import GpuKVPool


@triton.jit
def _query_rows(run_ptr, len_ptr, b, h, Hq, G: tl.constexpr, GP: tl.constexpr, RUNS: tl.constexpr):
    """The program's query rows, (run row r, head g) = (j·TR + row // G, row % G) for the program
    of its run's row j → (row_ok, tokens each row sees n_row (0 where not ok), the row's index in
    [B, Hq], the longest n_row)."""
    rows = tl.arange(0, GP)
    TR: tl.constexpr = GP // G
    if RUNS:
        code = tl.load(run_ptr + b)  # `run_codes`: j << 16 | R
        j = code >> 16
        first = b - j
        r = j * TR + rows // G
        row_ok = (r < (code & 0xFFFF)) & (rows < TR * G)
    else:
        first = b
        r = rows // G
        row_ok = r < 1
    n_row = tl.load(len_ptr + first + r, mask=row_ok, other=0)
    return row_ok, n_row, (first + r) * Hq + h * G + rows % G, tl.max(n_row, 0)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, run_ptr, o_ptr, lse_ptr,
    layer_off, head_stride, block_stride,  # element offset of the layer; strides of heads, blocks
    MB, blocks_per_split, scale, B, Hq,
    G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr,
    RUNS: tl.constexpr = False, PDL: tl.constexpr = False, TB: tl.constexpr = 1,
):
    b, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    d = tl.arange(0, D)
    t = tl.arange(0, TB * BS)  # TB blocks a step: their tokens in one tile
    row_ok, n_row, head, n = _query_rows(run_ptr, len_ptr, b, h, Hq, G, GP, RUNS)
    q = tl.load(q_ptr + (head * D)[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    first = sp * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(n, BS))
    for i0 in range(first, last, TB):
        i = i0 + t // BS  # each token's block
        ok = i < last
        blk = tl.load(bt_ptr + b * MB + i, mask=ok, other=0).to(tl.int64)
        off = layer_off + (blk * block_stride + h * head_stride + (t % BS) * D)[:, None] + d[None, :]  # [TB·BS, D]
        k = tl.load(k_ptr + off, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=ok[:, None], other=0.0)
        if DOT_F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)  # [GP, TB·BS]; scale may arrive as fp64 (inductor)
        s = tl.where(ok[None, :] & ((i0 * BS + t)[None, :] < n_row[:, None]), s, float("-inf"))
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
    dst = sp * B * Hq + head  # [GP]
    tl.store(o_ptr + (dst * D)[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + dst, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(o_ptr, lse_ptr, out_ptr, out_lse_ptr, S, BH, SP: tl.constexpr, D: tl.constexpr,
                         DB: tl.constexpr, CH: tl.constexpr, PDL: tl.constexpr = False):
    """out[r, d] = Σ_s e^{lse[s, r] - L} o[s, r, d], L = log Σ_s e^{lse[s, r]}, for row r = (b, hq) and
    the DB columns d of this program's slice. Each program computes L itself (SP loads); the sum over
    splits is kept as a [CH, DB] tile and reduced once at the end, so a chunk's loads wait on nothing."""
    r = tl.program_id(0)
    j = tl.program_id(1)
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
    d = j * DB + tl.arange(0, DB)
    c = tl.arange(0, CH)
    acc = tl.zeros([CH, DB], tl.float32)
    for s0 in range(0, S, CH):
        ok = s0 + c < S
        w = tl.exp(tl.load(lse_ptr + (s0 + c) * BH + r, mask=ok, other=float("-inf")) - big_safe)
        o = tl.load(o_ptr + ((s0 + c) * BH + r)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        acc += w[:, None] * o
    tl.store(out_ptr + r * D + d, tl.sum(acc, 0).to(out_ptr.dtype.element_ty))
    if j == 0:
        tl.store(out_lse_ptr + r, big)


def split_outputs(B: int, Hq: int, Hkv: int, D: int, MB: int, device: torch.device, out_dtype: torch.dtype,
                  runs: RunRows | None = None, extra: int = 0):
    """Splits of a sequence's MB blocks and their partial outputs → (S, blocks a split, o [S + extra, B,
    Hq, D], lse [S + extra, B, Hq]); `extra` splits after them are the caller's (the quantized
    kernels' tails). About 8 working programs an SM (enough loads in flight to keep HBM busy; with
    runs, about B / most of the rows' programs work), ≥ 4 blocks a split from 32 blocks on; below
    that a block a split (short contexts at batch 1: 8 programs walking 5 blocks in turn took 8.5 µs,
    the latency of a chain of dependent dots)."""
    working = max(1, B * programs_per_run(runs.most, Hq // Hkv) // runs.most) if runs is not None else B
    S = max(1, min(-(-8 * _sms(device) // (working * Hkv)), MB // 4 if MB >= 32 else MB))
    n = S + extra
    o = torch.empty((n, B, Hq, D), dtype=torch.float32 if n > 1 else out_dtype, device=device)
    lse = torch.empty((n, B, Hq), dtype=torch.float32, device=device)
    return S, -(-MB // S), o, lse


# The merge's program: DB columns of one (sequence, query head) row, CH splits a load. One program a
# row (all D columns, 16 splits a load, a cross-thread sum each load) showed 29 µs a layer at 1 × 8k
# bf16 (64 splits) and 39 at 1 × 32k int4 (133) in torch.profiler (H200, bench.budget --trace),
# against 15 / 68 µs for the attention kernel: 32 programs, each a chain of dependent loads and
# reductions. Those times include waiting for the attention (the merge starts early under PDL).
MERGE_COLUMNS = 16
MERGE_SPLITS = 64


def merge_splits(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partials o [S, B, Hq, D], lse [S, B, Hq] → (out [B, Hq, D] out_dtype, lse [B, Hq]);
    one split is already the answer."""
    S, B, Hq, D = o.shape
    if S == 1:
        return o[0], lse[0]
    out = torch.empty((B, Hq, D), dtype=out_dtype, device=o.device)
    total = torch.empty((B, Hq), dtype=torch.float32, device=o.device)  # -inf where every split was empty
    DB = min(D, MERGE_COLUMNS)
    _merge_splits_kernel[(B * Hq, D // DB)](o, lse, out, total, S, B * Hq, SP=triton.next_power_of_2(S), D=D, DB=DB,
                                            CH=MERGE_SPLITS, PDL=pdl.enabled(o.device), num_warps=2,
                                            **pdl.launch(o.device))
    return out, total


# Tokens a program of the bf16 kernel reads a step, as whole blocks (`step_blocks`): a split of a
# few blocks read a block a step is a chain of dependent loads and dots; read together, one step.
STEP_TOKENS = 128
STEP_WARPS = 4


def step_blocks(per: int, BS: int, dot_f32: bool = False) -> int:
    """Blocks the bf16 kernel reads a step for splits of `per` blocks: up to STEP_TOKENS tokens, a
    power of two (one where the dots are float32: their tiles would take twice the registers)."""
    if dot_f32:
        return 1
    tb = 1
    while tb * 2 <= per and tb * 2 * BS <= STEP_TOKENS:
        tb *= 2
    return tb


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def query_rows(G: int, runs: RunRows | None) -> dict:
    """The kernels' compile-time row arguments: G, GP (a program's query rows) and RUNS."""
    return dict(G=G, GP=max(ROWS, triton.next_power_of_2(G)), RUNS=runs is not None)


def paged_decode(
    pool: GpuKVPool, layer: int, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, dot_f32: bool = False, out_dtype: torch.dtype = torch.float32, runs: RunRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gpu_ops.attention.decode_attention` → (out [B, Hq, D] out_dtype, lse [B, Hq] float32)."""
    B, Hq, D = q.shape
    Hkv, BS = pool.num_kv_heads, pool.block_size
    MB = block_tables.shape[1]
    S, per, o, lse = split_outputs(B, Hq, Hkv, D, MB, q.device, out_dtype, runs)
    k = pool.k
    lens = seq_lens.to(torch.int32).contiguous()
    tb = step_blocks(per, BS, dot_f32)
    _decode_kernel[(B, Hkv, S)](
        q.to(k.dtype).contiguous(), k, pool.v, block_tables.contiguous(), lens,
        runs.codes if runs is not None else lens, o, lse,
        layer * k.stride(0), k.stride(2), k.stride(1), MB, per, scale, B, Hq,
        **query_rows(Hq // Hkv, runs), BS=BS, D=D, DOT_F32=dot_f32, PDL=pdl.enabled(q.device), TB=tb,
        num_warps=STEP_WARPS if tb > 1 else 4, num_stages=2, **pdl.launch(q.device),
    )
    return merge_splits(o, lse, out_dtype)
