"""Triton NF4 matrix-vector kernel for decode (1..8 rows of x), reading the bitsandbytes layout as is.

Why: at batch 1 a linear only streams its weights, so time ≥ NF4 bytes / HBM bandwidth.
bitsandbytes' gemv reaches 0.9-1.3 TB/s of the H100's 3.0, and our first Triton kernel
(`nf4_triton.nf4_gemv`: a 256-entry table gathered per byte from global memory, up to 8 L1
wavefronts a warp) no more. Here each thread loads 16 bytes of a weight row (32 codes, one
int32 word = 8 codes at a time) and decodes them in registers with `prmt` (gpu_ops/nf4_ptx.py):
the bf16 code book's high and low bytes sit in 8 registers, one `prmt` looks up 4 codes in 8
entries, a second picks the half by each code's bit 3, a third pairs the bytes: ~29 integer ops
for 8 codes, no memory. That integer work, not HBM, bounds the wide shapes (gate_up, lm_head:
~1.8-2.0 TB/s on an H100); a float32 table gathered per code through L1 instead (one load a
code) measured 5-40% slower everywhere and was dropped (commit f517a70 has it).

The sum per 64-code group is scaled once by its absmax (float32, as stored):
    y[m, n] = Σ_g absmax[n, g] · Σ_{k in g} x[m, k] · NF4[code[n, k]]
float32 accumulation, bf16 code values (as bitsandbytes' gemv). x rows are read as bf16 pairs
(int32) and widened by shifts; one decode serves every row of x (up to 8). A program owns
BLOCK_N rows of W and a K range (split-K, partials summed by torch, is available but measured
no faster on the Llama-3-8B shapes); the next step's words are loaded while a step computes.
"""
from __future__ import annotations

import enum
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gpu_ops import nf4_tc, pdl

from gpu_ops.nf4_code import NF4_CODE
from gpu_ops.nf4_tc import _sms
from gpu_ops.nf4_ptx import prmt_asm, prmt_tables

MAX_ROWS = 8


class Decode(enum.IntEnum):
    PRMT = 0  # the code book in registers, inline PTX (the GPU path)
    GATHER = 1  # plain tl.load gathers from the code book: for Triton's CPU interpreter (no inline PTX)
    LINEAR = 2  # not NF4: the linear 4-bit format of gpu_ops.q4 (nf4_mma only; nf4_tc.q4_tc_gemv for the GEMV)
    LINEAR_F32 = 3  # LINEAR decoded in float32 arithmetic, no inline PTX: for Triton's CPU interpreter


PRMT_ASM = tl.constexpr(prmt_asm())


@triton.jit
def _decode_prmt(q, t0, t1, t2, t3, t4, t5, t6, t7):
    return tl.inline_asm_elementwise(
        PRMT_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [q, t0, t1, t2, t3, t4, t5, t6, t7],
        dtype=(tl.float32,) * 8, is_pure=True, pack=1,
    )


LOAD_ASM = tl.constexpr("ld.global.nc.f32 $0, [$1];")


@triton.jit
def _decode_gather(q, book_ptr):
    f0 = tl.load(book_ptr + ((q >> 4) & 15))
    f1 = tl.load(book_ptr + (q & 15))
    f2 = tl.load(book_ptr + ((q >> 12) & 15))
    f3 = tl.load(book_ptr + ((q >> 8) & 15))
    f4 = tl.load(book_ptr + ((q >> 20) & 15))
    f5 = tl.load(book_ptr + ((q >> 16) & 15))
    f6 = tl.load(book_ptr + ((q >> 28) & 15))
    f7 = tl.load(book_ptr + ((q >> 24) & 15))
    return f0, f1, f2, f3, f4, f5, f6, f7


@triton.jit
def _load_f32(ptrs):
    """A plain load that is no layout anchor for Triton: it takes its consumer's layout, no shuffle."""
    return tl.inline_asm_elementwise(LOAD_ASM, "=r,l", [ptrs], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, xrow_ptr, xw, H: tl.constexpr):
    """Σ_j f_j · x[8w + j] per word w: xw [4H] word indices, x read as bf16 pairs (int32)."""
    p0 = tl.load(xrow_ptr + xw * 4)[None, :]
    p1 = tl.load(xrow_ptr + xw * 4 + 1)[None, :]
    p2 = tl.load(xrow_ptr + xw * 4 + 2)[None, :]
    p3 = tl.load(xrow_ptr + xw * 4 + 3)[None, :]
    hi = -65536
    s = f0 * (p0 << 16).to(tl.float32, bitcast=True)
    s += f1 * (p0 & hi).to(tl.float32, bitcast=True)
    s += f2 * (p1 << 16).to(tl.float32, bitcast=True)
    s += f3 * (p1 & hi).to(tl.float32, bitcast=True)
    s += f4 * (p2 << 16).to(tl.float32, bitcast=True)
    s += f5 * (p2 & hi).to(tl.float32, bitcast=True)
    s += f6 * (p3 << 16).to(tl.float32, bitcast=True)
    s += f7 * (p3 & hi).to(tl.float32, bitcast=True)
    return tl.sum(tl.reshape(s, [s.shape[0], H, 4]), axis=2)  # [BN, H]: one half group (32 codes) of each row


@triton.jit
def _nf4_gemv_kernel(
    x32_ptr, w32_ptr, absmax_ptr, book_ptr, out_ptr, res_ptr,
    N, KW, stride_xm, words_per_split, stride_rm,
    M: tl.constexpr, BLOCK_N: tl.constexpr, H: tl.constexpr, DECODE: tl.constexpr, SPLIT: tl.constexpr,
    RES: tl.constexpr, SWIGLU: tl.constexpr = False, PDL: tl.constexpr = False,
    eid_ptr=None, expert_words=0, XDIV: tl.constexpr = 0,
):
    """out[s, m, n] (float32 partials if SPLIT, else bf16 y[m, n], plus res[m, n] if RES) for
    rows [pid_n·BN, +BN) of W.

    A step covers H half groups (32 codes, 4 int32 words, one 16-byte load) of each row.

    XDIV > 0 (experts): W is a stack of experts' matrices, expert_words int32 words apart, and
    axis 1 runs over slots s: the slot's expert eid[s] (−1: none here, the slot's row is 0) times
    x's row s // XDIV, into out's row s (M = 1, no split).
    """
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    words = words_per_split
    k_first = pid_s * words_per_split
    if XDIV > 0:
        e = tl.load(eid_ptr + pid_s)
        words = tl.where(e >= 0, words_per_split, 0)  # no expert here: no step, zeros out
        e = tl.maximum(e, 0).to(tl.int64)
        w32_ptr += e * expert_words
        absmax_ptr += e * (expert_words // 8)
        x32_ptr += (pid_s // XDIV) * stride_xm
        k_first = 0
    if SWIGLU:  # W = [gate; up], N = 2F: the program's rows pair gate row n with up row F + n
        i = tl.arange(0, BLOCK_N)
        rows = tl.minimum(pid_n * (BLOCK_N // 2) + i // 2, N // 2 - 1) + (i % 2) * (N // 2)
    else:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(rows, N - 1)  # clamp: out-of-range rows re-read row N-1, their results are dropped
    h = tl.arange(0, H)
    w = tl.arange(0, 4 * H)
    w_rows = w32_ptr + rows.to(tl.int64)[:, None] * KW  # [BN, 1]; KW = K / 8 int32 words a row
    a_rows = absmax_ptr + rows.to(tl.int64)[:, None] * (KW // 8)  # [BN, 1]
    acc0 = tl.zeros([BLOCK_N, H], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, H], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, H], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, H], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_N, H], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_N, H], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_N, H], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_N, H], dtype=tl.float32)
    # the PRMT tables (book_ptr + 16 .. + 24 as int32): loaded, not immediates, so that ptxas
    # keeps them in registers instead of re-materializing them for every word
    if DECODE == 0:
        tab = book_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + 16
        t0, t1, t2, t3 = tl.load(tab), tl.load(tab + 1), tl.load(tab + 2), tl.load(tab + 3)
        t4, t5, t6, t7 = tl.load(tab + 4), tl.load(tab + 5), tl.load(tab + 6), tl.load(tab + 7)
    q = tl.load(w_rows + (k_first + w)[None, :])  # [BN, 4H] int32: 8 codes each
    sc = _load_scales(a_rows, k_first, h, DECODE)  # [BN, H]
    if PDL:  # weights and scales are constant: loaded above while the previous kernel ends; x is not
        gdc_wait()
    for i in range(0, words, 4 * H):  # (not range(k_first, ...): Triton's interpreter rejects it)
        kw = k_first + i  # word index along K of this step
        # prefetch the next step while this one computes (masked off after the last step; the
        # scales, an L1 hit, are re-read there instead)
        more = i + 4 * H + 0 * w[None, :] < words  # [1, 4H] (a comparison: Triton's interpreter takes no bool &)
        k_next = k_first + tl.minimum(i + 4 * H, words_per_split - 4 * H)
        q_next = tl.load(w_rows + (k_next + w)[None, :], mask=more, other=0)
        sc_next = _load_scales(a_rows, k_next, h, DECODE)
        xw = kw + w  # [4H]
        if DECODE == 0:
            f0, f1, f2, f3, f4, f5, f6, f7 = _decode_prmt(q, t0, t1, t2, t3, t4, t5, t6, t7)
        else:
            f0, f1, f2, f3, f4, f5, f6, f7 = _decode_gather(q, book_ptr)
        acc0 += sc * _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, x32_ptr, xw, H)
        if M > 1:
            acc1 += sc * _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, x32_ptr + stride_xm, xw, H)
        if M > 2:
            acc2 += sc * _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, x32_ptr + 2 * stride_xm, xw, H)
        if M > 3:
            acc3 += sc * _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, x32_ptr + 3 * stride_xm, xw, H)
        if M > 4:
            acc4 += sc * _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, x32_ptr + 4 * stride_xm, xw, H)
        if M > 5:
            acc5 += sc * _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, x32_ptr + 5 * stride_xm, xw, H)
        if M > 6:
            acc6 += sc * _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, x32_ptr + 6 * stride_xm, xw, H)
        if M > 7:
            acc7 += sc * _row_dot(f0, f1, f2, f3, f4, f5, f6, f7, x32_ptr + 7 * stride_xm, xw, H)
        q, sc = q_next, sc_next
    if PDL:
        gdc_launch_dependents()
    if SWIGLU:  # one output per gate/up pair: F = N / 2 columns
        NO = N // 2
        offs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        NO = N
        offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < NO
    out = out_ptr + pid_s * M * NO + offs
    res = res_ptr + offs
    _store_row(out, acc0, ok, SPLIT, res, RES, SWIGLU, BLOCK_N)
    if M > 1:
        _store_row(out + NO, acc1, ok, SPLIT, res + stride_rm, RES, SWIGLU, BLOCK_N)
    if M > 2:
        _store_row(out + 2 * NO, acc2, ok, SPLIT, res + 2 * stride_rm, RES, SWIGLU, BLOCK_N)
    if M > 3:
        _store_row(out + 3 * NO, acc3, ok, SPLIT, res + 3 * stride_rm, RES, SWIGLU, BLOCK_N)
    if M > 4:
        _store_row(out + 4 * NO, acc4, ok, SPLIT, res + 4 * stride_rm, RES, SWIGLU, BLOCK_N)
    if M > 5:
        _store_row(out + 5 * NO, acc5, ok, SPLIT, res + 5 * stride_rm, RES, SWIGLU, BLOCK_N)
    if M > 6:
        _store_row(out + 6 * NO, acc6, ok, SPLIT, res + 6 * stride_rm, RES, SWIGLU, BLOCK_N)
    if M > 7:
        _store_row(out + 7 * NO, acc7, ok, SPLIT, res + 7 * stride_rm, RES, SWIGLU, BLOCK_N)


@triton.jit
def _load_scales(a_rows, kw, h, DECODE: tl.constexpr):
    """absmax of each half group of the step at word kw: [BN, H] (two half groups a group)."""
    ptrs = a_rows + (kw // 8 + h // 2)[None, :]
    if DECODE == 1:
        return tl.load(ptrs)
    return _load_f32(ptrs)


@triton.jit
def _store_row(ptr, acc, ok, SPLIT: tl.constexpr, res, RES: tl.constexpr, SWIGLU: tl.constexpr,
               BLOCK_N: tl.constexpr):
    y = tl.sum(acc, axis=1)
    if SPLIT:
        tl.store(ptr, y, mask=ok)
    elif SWIGLU:  # interleaved (gate, up) sums, each rounded to bf16 as torch's gate_up output is,
        g, u = tl.split(tl.reshape(y.to(tl.bfloat16).to(tl.float32), [BLOCK_N // 2, 2]))  # then silu(g)·u
        tl.store(ptr, (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16), mask=ok)
    elif RES:  # torch's res + y.to(bf16): y rounded to bf16 first, the sum rounded again
        r = tl.load(res, mask=ok, other=0.0).to(tl.float32)
        tl.store(ptr, (y.to(tl.bfloat16).to(tl.float32) + r).to(tl.bfloat16), mask=ok)
    else:
        tl.store(ptr, y.to(tl.bfloat16), mask=ok)


@functools.cache
def _book(device: torch.device) -> torch.Tensor:
    """[24] float32: the code book (GATHER), then the 8 PRMT table words (as float32 bits)."""
    words = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in prmt_tables()], dtype=torch.int32)
    return torch.cat([NF4_CODE, words.view(torch.float32)]).to(device)


def gemv_config(N: int, K: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, H, warps, split-K) for W [N, K]: the fastest of bench/nf4_gemv.py's sweep on an H100.

    Narrow W (N < 128 · sms, 16,896 on an H100: qkv, o, down): 4-row tiles of 2048-code steps,
    2 rows a thread (~80 registers, 24 warps an SM); wide W (gate_up, lm_head): 32-row tiles of
    512-code steps. 4096-code steps, 8- and 16-row tiles and split-K were no faster at 1 row.
    """
    H = 64
    while K % (32 * H):
        H //= 2
    if N >= 4 * sms * 32:
        return 32, min(H, 16), 4, 1
    return 4, H, 4, 1


def nf4_gemv(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int],
             decode: Decode = Decode.PRMT, config: tuple[int, int, int, int] | None = None,
             residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """x [M ≤ 8, K] bf16, W [N, K] as NF4 (K a multiple of 64) → y [M, N] bf16 (+ residual
    [M, N] bf16, added in the kernel's epilogue as torch would add it).

    swiglu: W is [gate; up] (N = 2F) and the result is silu(x·gateᵀ) · (x·upᵀ), [M, F] bf16,
    computed in the epilogue (no split-K, no residual).

    config: (BLOCK_N, H, warps, split-K), default `gemv_config`; H a power of two, K divisible
    by 32·H·split.

    2..8 rows go to the tensor-core kernel `nf4_tc.nf4_tc_gemv` where the device runs it
    (`nf4_tc.enabled`), unless a Triton decode or config is asked for: it costs what one row does.
    One row stays here: a Llama-3-8B step measured 3.15 ms with this kernel, 3.20 with nf4_tc (H200,
    bench/nf4_gemv.py --step), though each linear alone is as fast or faster there."""
    N, K = shape
    M = x.shape[0]
    if M > 1 and decode is Decode.PRMT and config is None and K % 64 == 0 and nf4_tc.enabled(x.device):
        return nf4_tc.nf4_tc_gemv(x, packed, absmax, shape, residual=residual, swiglu=swiglu)
    if K % 64 or not 1 <= M <= MAX_ROWS:
        raise ValueError(f"nf4_gemv takes 1..{MAX_ROWS} rows and K divisible by 64, got x {tuple(x.shape)}, W {shape}")
    BN, H, warps, S = config or gemv_config(N, K, _sms(x.device))
    x = x.to(torch.bfloat16)
    if x.stride(-1) != 1 or x.stride(0) % 2:
        x = x.contiguous()
    x32 = x.view(torch.int32)  # bf16 pairs: x[2i] in the low half
    w32 = packed.view(torch.int32)
    grid = (triton.cdiv(N, BN), S)
    if residual is not None and (residual.shape != (M, N) or residual.dtype != torch.bfloat16
                                 or residual.stride(-1) != 1):
        raise ValueError(f"residual must be bf16 [{M}, {N}] with unit stride, got {residual.dtype} {tuple(residual.shape)}")
    if swiglu:
        if N % 2 or BN % 2 or residual is not None:
            raise ValueError(f"swiglu needs an even N and tile, and no residual: W {shape}, tile {BN}")
        y = torch.empty((M, N // 2), dtype=torch.bfloat16, device=x.device)
        grid = (triton.cdiv(N // 2, BN // 2), 1)
        _nf4_gemv_kernel[grid](x32, w32, absmax, _book(x.device), y, y, N, K // 8, x32.stride(0), K // 8, 0,
                               M=M, BLOCK_N=BN, H=H, DECODE=int(decode), SPLIT=False, RES=False, SWIGLU=True,
                               PDL=pdl.enabled(x.device), num_warps=warps, **pdl.launch(x.device))
        return y
    if S == 1:
        y = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
        res = y if residual is None else residual
        _nf4_gemv_kernel[grid](x32, w32, absmax, _book(x.device), y, res, N, K // 8, x32.stride(0), K // 8,
                               res.stride(0), M=M, BLOCK_N=BN, H=H, DECODE=int(decode), SPLIT=False,
                               RES=residual is not None, PDL=pdl.enabled(x.device), num_warps=warps,
                               **pdl.launch(x.device))
        return y
    part = torch.empty((S, M, N), dtype=torch.float32, device=x.device)
    _nf4_gemv_kernel[grid](x32, w32, absmax, _book(x.device), part, part, N, K // 8, x32.stride(0), K // 8 // S,
                           0, M=M, BLOCK_N=BN, H=H, DECODE=int(decode), SPLIT=True, RES=False,
                           PDL=pdl.enabled(x.device), num_warps=warps, **pdl.launch(x.device))
    y = part.sum(0).to(torch.bfloat16)
    return y if residual is None else residual + y


def nf4_experts_gemv(x: torch.Tensor, eids: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                     shape: tuple[int, int], xdiv: int, swiglu: bool = False,
                     decode: Decode = Decode.PRMT) -> torch.Tensor:
    """Slots s of a mixture-of-experts layer in one launch: y[s] = W_{eids[s]} · x[s // xdiv] with
    W_e [N, K] the e-th of a stack of NF4 matrices (packed [E, N·K/2], absmax [E, N·K/64]); a slot
    whose eid is −1 (an expert another device computes) gets a zero row. x [R, K] bf16, eids [S]
    int32 → y [S, N] bf16 ([S, N/2] silu(gate)·up where swiglu: W is [gate; up]). The expert ids
    are read on the device: nothing syncs, so a CUDA graph can hold it. The tensor-core kernel
    (`nf4_tc`) answers where the device runs it."""
    N, K = shape
    if decode is Decode.PRMT and K % 64 == 0 and nf4_tc.enabled(x.device):
        return nf4_tc.nf4_tc_experts_gemv(x, eids, packed, absmax, shape, xdiv, swiglu=swiglu)
    if K % 64:
        raise ValueError(f"nf4_experts_gemv needs K divisible by 64, got W {shape}")
    BN, H, warps, _ = gemv_config(N, K, _sms(x.device))
    x = x.to(torch.bfloat16)
    if x.stride(-1) != 1 or x.stride(0) % 2:
        x = x.contiguous()
    x32 = x.view(torch.int32)
    S = eids.numel()
    NO = N // 2 if swiglu else N
    y = torch.empty((S, NO), dtype=torch.bfloat16, device=x.device)
    if swiglu:
        if N % 2 or BN % 2:
            raise ValueError(f"swiglu needs an even N and tile: W {shape}, tile {BN}")
        grid = (triton.cdiv(NO, BN // 2), S)
    else:
        grid = (triton.cdiv(N, BN), S)
    _nf4_gemv_kernel[grid](x32, packed.view(torch.int32), absmax, _book(x.device), y, y, N, K // 8, x32.stride(0),
                           K // 8, 0, M=1, BLOCK_N=BN, H=H, DECODE=int(decode), SPLIT=False, RES=False,
                           SWIGLU=swiglu, PDL=pdl.enabled(x.device), eid_ptr=eids, expert_words=N * K // 8,
                           XDIV=xdiv, num_warps=warps, **pdl.launch(x.device))
    return y
