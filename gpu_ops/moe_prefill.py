"""A mixture-of-experts layer's device experts for many rows (a prefill chunk) in two launches: a
grouped NF4 GEMM over every expert at once, instead of one expert's GEMMs at a time.

    sort_slots:  the chunk's slots (token n, choice s: flat n·k + s) grouped by the device expert
                 they route to, each expert's run padded to whole blocks of BLOCK_M rows, and each
                 block's expert; slots routed elsewhere (−1) in no block (one Triton program, or
                 two passes of a program a tile of slots for many: in torch ops it took ~17
                 launches, ~0.3 ms of the host's time a call)
    grouped_gemm: per (block, tile of output features) program: the block's expert's codes read
                 once for its rows (x gathered by slot), a word at a time, decoded and scaled in
                 registers as gpu_ops.nf4_mma does (NF4 by PRMT; the host's int4 by shifts), one
                 tensor-core dot a step; gate/up with SiLU·up fused (W = [gate; up]); each row
                 stored at its slot

A layer's experts then cost their bytes once (a 512-token chunk of Qwen3-30B-A3B routes ~32 rows
to each of 128 experts), where one expert at a time paid ~85 µs of launches and gathers each
(bench/RESULTS.md, MoE prefill). The block count is not read back to the host: the grid is sized
for the most blocks any routing needs (ceil(P / BLOCK_M) + E), and the blocks past the last run
exit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_ops.nf4_gemv import Decode, _book, _decode_gather
from gpu_ops.nf4_mma import _decode_tile, _join8, _load_scales, _mma, _tile, _tile_mask


@triton.jit
def _decode_int4(q, s, DOT_F32: tl.constexpr):
    """The host's int4 words q [BN, W] → [BN, 8W] (code − 8) · s in bf16 (float32 where DOT_F32),
    s [BN, W] each word's group scale; a word's 8 columns in the order `_columns` gives their K positions."""
    e0 = ((q & 15) - 8).to(tl.float32) * s
    e1 = (((q >> 8) & 15) - 8).to(tl.float32) * s
    e2 = (((q >> 16) & 15) - 8).to(tl.float32) * s
    e3 = (((q >> 24) & 15) - 8).to(tl.float32) * s
    e4 = (((q >> 4) & 15) - 8).to(tl.float32) * s
    e5 = (((q >> 12) & 15) - 8).to(tl.float32) * s
    e6 = (((q >> 20) & 15) - 8).to(tl.float32) * s
    e7 = (((q >> 28) & 15) - 8).to(tl.float32) * s
    w = _join8(e0, e1, e2, e3, e4, e5, e6, e7)
    if not DOT_F32:
        w = w.to(tl.bfloat16)
    return w


@triton.jit
def _decode_nf4_f32(q, s, book_ptr):
    """NF4 words → [BN, 8W] float32 code · absmax, unrounded: the exact check's decoder (no PTX)."""
    f0, f1, f2, f3, f4, f5, f6, f7 = _decode_gather(q, book_ptr)
    return _join8(f0 * s, f1 * s, f2 * s, f3 * s, f4 * s, f5 * s, f6 * s, f7 * s)


@triton.jit
def _columns(c, INT4: tl.constexpr):
    """The K position (from the step's start) of decoded column c: NF4 in K order; int4 byte b of a
    group holds elements b (low nibble) and 32 + b (high), so column 8w + j (word w, `_decode_int4`'s
    element j) is element 4·(w % 8) + j % 4 + 32·(j // 4) of group w // 8."""
    if INT4:
        w, j = c // 8, c % 8
        c = 64 * (w // 8) + 4 * (w % 8) + j % 4 + 32 * (j // 4)
    return c


@triton.jit
def _step(rows_ptr, ab_ptr, k, words, xk, acc, t0, t1, t2, t3, t4, t5, t6, t7, book_ptr,
          INT4: tl.constexpr, DECODE: tl.constexpr, DOT_F32: tl.constexpr, SWAP: tl.constexpr):
    """acc + one BLOCK_K step of the expert's rows (their words at rows_ptr [BN, 1], scales at ab_ptr)
    against xk: the codes decoded and scaled in registers (as gpu_ops.nf4_mma), one tensor-core dot."""
    q = tl.load(rows_ptr + (k // 8 + words)[None, :])  # [BN, W] int32
    s = _load_scales(ab_ptr, k, words, 0, DECODE)
    if INT4:
        w = _decode_int4(q, s, DOT_F32)
    elif DOT_F32:
        w = _decode_nf4_f32(q, s, book_ptr)
    else:
        w = _decode_tile(q, s, t0, t1, t2, t3, t4, t5, t6, t7, book_ptr, DECODE, True)
    return _mma(w, xk, acc, s, 0, DOT_F32, SWAP)


@triton.jit
def _grouped_kernel(x_ptr, slots_ptr, block_expert_ptr, w32_ptr, absmax_ptr, book_ptr, y_ptr,
                    K, NO, stride_x, expert_words, expert_groups,
                    XDIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SWIGLU: tl.constexpr, INT4: tl.constexpr, DECODE: tl.constexpr, DOT_F32: tl.constexpr,
                    SWAP: tl.constexpr):
    """One (tile of BLOCK_N output features, block of BLOCK_M slots) program: y[slot] = W_e · x[slot // XDIV]
    for the block's expert e (SWIGLU: silu(gate) · up, W_e = [gate; up], NO features each)."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        W: tl.constexpr = BLOCK_K // 8  # int32 words a row a step
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM], −1: padding
        m_ok = slot >= 0
        x_off = tl.where(m_ok, slot // XDIV, 0).to(tl.int64) * stride_x
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, NO - 1).to(tl.int64)  # out-of-range features re-read row NO − 1, dropped
        words = tl.arange(0, W)
        w_e = w32_ptr + e.to(tl.int64) * expert_words
        a_e = absmax_ptr + e.to(tl.int64) * expert_groups
        kk = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + _tile(_columns(kk, INT4), x_off, SWAP)  # xᵀ [BK, BM] (SWAP) or x [BM, BK], step 0
        x_ok = _tile_mask(kk < BLOCK_K, m_ok, SWAP)
        # the PRMT tables (unused by GATHER and int4), loaded so that they stay in registers
        tab = book_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + 16
        t0, t1, t2, t3 = tl.load(tab), tl.load(tab + 1), tl.load(tab + 2), tl.load(tab + 3)
        t4, t5, t6, t7 = tl.load(tab + 4), tl.load(tab + 5), tl.load(tab + 6), tl.load(tab + 7)
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros_like(acc)
        for k in range(0, K, BLOCK_K):
            xk = tl.load(x_tile + k, mask=x_ok, other=0.0)
            acc = _step(w_e + rows[:, None] * (K // 8), a_e + rows[:, None] * (K // 64), k, words, xk, acc,
                        t0, t1, t2, t3, t4, t5, t6, t7, book_ptr, INT4, DECODE, DOT_F32, SWAP)
            if SWIGLU:
                up = _step(w_e + (rows + NO)[:, None] * (K // 8), a_e + (rows + NO)[:, None] * (K // 64), k, words,
                           xk, up, t0, t1, t2, t3, t4, t5, t6, t7, book_ptr, INT4, DECODE, DOT_F32, SWAP)
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * up
        ok = _tile_mask(offs_n < NO, m_ok, SWAP)
        out = y_ptr + _tile(offs_n, slot.to(tl.int64) * NO, SWAP)
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)


CONFIG = (64, 128, 4, 3, True)  # BLOCK_N, BLOCK_K, warps, stages, swap (gpu_ops.nf4_mma.MmaConfig)


def block_rows(slots: int, experts: int) -> int:
    """Rows a block: the average run of a device expert, rounded up to a tensor-core tile (16–64)."""
    mean = slots // max(1, experts)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


@triton.jit
def _hot(key_ptr, t, P, lo, hi, EP: tl.constexpr, TILE: tl.constexpr):
    """Tile t's slots s, their keys, and the one-hot [TILE, EP] of their experts (keys outside
    [lo, hi): none)."""
    s = t * TILE + tl.arange(0, TILE)
    key = tl.load(key_ptr + s, mask=s < P, other=-1)
    e = tl.arange(0, EP)
    return s, key, (key[:, None] - lo == e[None, :]) & (key[:, None] < hi)


@triton.jit
def _store_block_experts(block_expert_ptr, end, b, ok, lo, hi, BM: tl.constexpr):
    """Blocks b's experts (−1 past the last run): the runs ending at or before a block's first row
    (end [EP]: each run's padded end)."""
    run = tl.sum((end[None, :] <= (b * BM)[:, None]).to(tl.int32), 1)
    tl.store(block_expert_ptr + b, tl.where(run < hi - lo, run, -1), mask=ok)


@triton.jit
def _sort_kernel(key_ptr, slots_ptr, block_expert_ptr, P, lo, hi, NB,
                 BM: tl.constexpr, EP: tl.constexpr, TILE: tl.constexpr):
    """`sort_slots` in one program, for few tiles of slots, TILE a step as a one-hot [TILE, EP] of
    their experts: the runs' sizes (its column sums), each run's padded start, each block's expert,
    then each slot at its run's next row plus the earlier slots of its expert in the tile (the
    one-hot's exclusive prefix sum down the tile): in order within a run, as the twin's stable sort."""
    counts = tl.zeros([EP], tl.int32)
    for t in range(0, tl.cdiv(P, TILE)):
        _, _, hot = _hot(key_ptr, t, P, lo, hi, EP, TILE)
        counts += tl.sum(hot.to(tl.int32), 0)
    padded = (counts + BM - 1) // BM * BM
    end = tl.cumsum(padded, 0)
    for b0 in range(0, NB, TILE):
        b = b0 + tl.arange(0, TILE)
        _store_block_experts(block_expert_ptr, end, b, b < NB, lo, hi, BM)
    nxt = end - padded  # each run's next free row
    for t in range(0, tl.cdiv(P, TILE)):
        s, key, hot = _hot(key_ptr, t, P, lo, hi, EP, TILE)
        h = hot.to(tl.int32)
        row = tl.sum(tl.where(hot, nxt[None, :] + tl.cumsum(h, 0) - h, 0), 1)
        tl.store(slots_ptr + row, s, mask=(s < P) & (key >= lo) & (key < hi))
        nxt += tl.sum(h, 0)


@triton.jit
def _count_kernel(key_ptr, count_ptr, P, lo, hi, EP: tl.constexpr, TILE: tl.constexpr):
    """`sort_slots`, first pass, a program a tile of slots: its slots by expert, count[tile, EP]."""
    t = tl.program_id(0)
    _, _, hot = _hot(key_ptr, t, P, lo, hi, EP, TILE)
    tl.store(count_ptr + t * EP + tl.arange(0, EP), tl.sum(hot.to(tl.int32), 0))


@triton.jit
def _place_kernel(key_ptr, count_ptr, slots_ptr, block_expert_ptr, P, lo, hi, NT, NB, BPT,
                  BM: tl.constexpr, EP: tl.constexpr, TILE: tl.constexpr, CT: tl.constexpr):
    """`sort_slots`, second pass, a program a tile of slots: the runs' sizes (all tiles' counts)
    and this tile's slots before its own (the earlier tiles' counts), each run's padded start;
    each slot at its run's start plus the earlier slots of its expert (earlier tiles', then the
    one-hot's exclusive prefix sum down this tile): in order within a run, as the twin's stable
    sort. The tile's share of the blocks, BPT of them, gets each block's expert."""
    t = tl.program_id(0)
    e = tl.arange(0, EP)
    total = tl.zeros([EP], tl.int32)
    before = tl.zeros([EP], tl.int32)
    for c0 in range(0, NT, CT):
        c = c0 + tl.arange(0, CT)
        n = tl.load(count_ptr + c[:, None] * EP + e[None, :], mask=(c < NT)[:, None], other=0)
        total += tl.sum(n, 0)
        before += tl.sum(tl.where((c < t)[:, None], n, 0), 0)
    padded = (total + BM - 1) // BM * BM
    end = tl.cumsum(padded, 0)
    s, key, hot = _hot(key_ptr, t, P, lo, hi, EP, TILE)
    h = hot.to(tl.int32)
    row = tl.sum(tl.where(hot, (end - padded + before)[None, :] + tl.cumsum(h, 0) - h, 0), 1)
    tl.store(slots_ptr + row, s, mask=(s < P) & (key >= lo) & (key < hi))
    for b0 in range(0, BPT, TILE):
        j = b0 + tl.arange(0, TILE)
        b = t * BPT + j
        _store_block_experts(block_expert_ptr, end, b, (b < NB) & (j < BPT), lo, hi, BM)


# Tiles of slots (of 8192 / experts each) up to which the sort runs as one program: on the H200 host
# it took ~2–3 µs of GPU time a tile, and the two passes ~65 µs of the host's time a call (three
# launches): 512 tokens × 8 slots over 128 experts (64 tiles), one program 177 µs, two passes 64;
# a 24-expert piece of them (32 tiles) 66 against 115; 64 tokens (8 tiles) 40 against 79.
ONE_PROGRAM_TILES = 32


def sort_slots(local: torch.Tensor, experts: int, bm: int, lo: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """local [N, k] int32 (each slot's expert; slots outside [lo, lo + experts): elsewhere) →
    (slots [B·bm] int32: each block's slots, −1 padding; block_expert [B] int32: the block's expert
    − lo, −1 past the last run), B = ceil(N·k / bm) + experts, each expert's run starting a block,
    its slots in order. No sync: the block count is not read back (blocks past the last run exit).
    The rows are set to −1, then up to ONE_PROGRAM_TILES tiles of slots go through one program
    (`_sort_kernel`), more through a program a tile in two passes (`_count_kernel`, `_place_kernel`).
    Its torch twin: `sort_slots_reference`."""
    key = local.reshape(-1)
    if key.dtype != torch.int32:
        key = key.to(torch.int32)
    key = key.contiguous()
    P = key.numel()
    B = -(-P // bm) + experts
    EP = triton.next_power_of_2(experts)
    TILE = max(16, min(128, 8192 // EP))
    NT = triton.cdiv(P, TILE)
    slots = torch.full((B * bm,), -1, dtype=torch.int32, device=key.device)
    block_expert = torch.empty(B, dtype=torch.int32, device=key.device)
    if NT <= ONE_PROGRAM_TILES:
        _sort_kernel[(1,)](key, slots, block_expert, P, lo, lo + experts, B, BM=bm, EP=EP, TILE=TILE, num_warps=8)
        return slots, block_expert
    count = torch.empty((NT, EP), dtype=torch.int32, device=key.device)
    _count_kernel[(NT,)](key, count, P, lo, lo + experts, EP=EP, TILE=TILE, num_warps=4)
    _place_kernel[(NT,)](key, count, slots, block_expert, P, lo, lo + experts, NT, B, triton.cdiv(B, NT),
                         BM=bm, EP=EP, TILE=TILE, CT=max(1, min(16, 4096 // EP)), num_warps=4)
    return slots, block_expert


def sort_slots_reference(local: torch.Tensor, experts: int, bm: int, lo: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`sort_slots` in torch ops (none of them a sync: the counts are a scatter-add, as
    torch.bincount reads its input's range back to the host)."""
    key = local.reshape(-1).long()
    P, dev = key.numel(), key.device
    key = torch.where((key >= lo) & (key < lo + experts), key - lo, experts)  # elsewhere: sorted last, in no run
    order = torch.argsort(key, stable=True)
    sk = key[order]
    counts = torch.zeros(experts + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))[:experts]
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
                out: torch.Tensor | None = None, config: tuple[int, int, int, int, bool] | None = None) -> torch.Tensor:
    """y [rows, N] (N/2 for swiglu) bf16 (float32 where dot_f32): y[s] = W_e · x[s // xdiv] for each
    slot s of a block of expert e (`sort_slots`), W_e [N, K] the e-th of the NF4 stack (packed
    [E, N·K/2], absmax [E, N·K/64]; int4: the host experts' format, codes [E, N, K/2] and scales
    [E, N, K/64], cpu_attention.experts); other rows zero where `zero`, else left unwritten (or
    those of `out`, which takes y where given). config: (BLOCK_N, BLOCK_K, warps, stages, swap), else
    CONFIG. dot_f32 (exact, for checks under Triton's CPU interpreter): the weights decoded to
    float32, unrounded, the code book gathered (no inline PTX)."""
    N, K = shape
    if K % 64:
        raise ValueError(f"grouped_gemm needs K divisible by 64, got W {shape}")
    NO = N // 2 if swiglu else N
    x = x.to(torch.float32 if dot_f32 else torch.bfloat16)
    if x.stride(-1) != 1:
        x = x.contiguous()
    dtype = torch.float32 if dot_f32 else torch.bfloat16
    y = out if out is not None else (torch.zeros if zero else torch.empty)((rows, NO), dtype=dtype, device=x.device)
    BN, BK, warps, stages, swap = config or CONFIG
    BK = min(BK, K & -K)  # a power of two dividing K
    grid = (triton.cdiv(NO, BN), block_expert.numel())
    _grouped_kernel[grid](x, slots, block_expert, packed.view(torch.int32), absmax, _book(x.device), y,
                          K, NO, x.stride(0), N * K // 8, N * K // 64,
                          XDIV=xdiv, BLOCK_M=bm, BLOCK_N=BN, BLOCK_K=BK, SWIGLU=swiglu, INT4=int4,
                          DECODE=int(Decode.GATHER if dot_f32 else Decode.PRMT), DOT_F32=dot_f32, SWAP=swap,
                          num_warps=warps, num_stages=stages)
    return y
