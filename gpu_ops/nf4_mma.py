"""Triton NF4 × bf16 tensor-core matmul for 3..64 rows (decode batches): a W4A16 kernel for Hopper.

    y[m, n] = Σ_k x[m, k] · W[n, k],   W[n, k] = NF4[code[n, k]] · absmax[n, k // 64]

Why: at 32 rows bitsandbytes dequantizes the whole weight to bf16 and calls cuBLAS (0.5 + 2 + 2
bytes moved a weight, ~300 GB/s of NF4 bytes on an H100); our first tensor-core kernel
(`nf4_triton.nf4_matmul`: a 256-entry table gathered from global memory per byte, 64-code K
steps, [32, BN] byte tiles loaded across rows) was 2x slower still. This one reads each weight
byte once, contiguously, and decodes it in registers.

Layout (`gpu_ops.nf4`, as stored, no repacking): packed [N, K/2] uint8 read as int32 words
[N, K/8], 8 codes a word (byte p: element 2p high nibble, 2p + 1 low); absmax float32 [N, K/64].
A program owns BLOCK_N output features (and all ≤ 64 rows, so the weights are read once); a step
loads [BLOCK_N, BLOCK_K/8] words (each row BLOCK_K/2 contiguous bytes) and prefetches the next
step's while it computes. Decode: the code book's bytes in 8 registers, looked up with PTX `prmt`
(`nf4_ptx.prmt_bf16_asm`, 16 prmt + 5 shift/logic ops for 8 codes, no memory), 8 bf16 a word
joined into the [BLOCK_N, BLOCK_K] tile in K order; x's tile comes from L2.

Orientation (`MmaConfig.swap`):
- x·Wᵀ (default): x [64, BK] is wgmma's A and the decoded tile, stored to shared memory, its B:
  both operands from shared memory, the MMAs asynchronous. wgmma's M is 64, so fewer rows are
  zero-padded (the tensor cores have the time: at 64 MACs a weight, HBM speed needs ~80% of an
  H100's bf16 rate).
- W·xᵀ (swap AB): the decoded tile is A, from registers, and the rows of x are the MMA's N
  (BLOCK_M = 16/32/64): no padding, but Triton routes the tile through shared memory into the
  A-fragment layout and, with one warpgroup, ptxas serializes the wgmmas
  (bench/nf4_mma_sass.py counts both; bench/nf4_mma.py times them).

Scale (`Scale`): WEIGHT multiplies the decoded codes by absmax in bf16 before the dot (one bf16x2
fma a pair in the decoder: bf16(bf16(code)·bf16(absmax)), within a bf16 ulp of bitsandbytes'
dequantized weight), one dot a step; SUM dots one 64-code group a step and scales the float32
partial product (BLOCK_K = 64, exact).

Split-K: `split` programs share an output tile's K range so that narrow W (o, k/v, down) still
fill the SMs. Each writes float32 partials [split, M, N]; the last to arrive (an int32 counter a
tile, incremented with acq_rel after a CTA barrier, reset by that program) sums them in split
order (deterministic) and stores y: one launch. The counters are one fixed buffer per device
(allocated by the first split call: make it outside a CUDA-graph capture, as Triton's compile
must be), so two split launches must not run concurrently on one device.

float32 accumulation, bf16 output (+ residual, added as torch would: bf16(bf16(y) + res)).
Capturable in a CUDA graph: no host sync, outputs and partials allocated per call by torch.
"""
from __future__ import annotations

import dataclasses
import enum
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gpu_ops import pdl
from gpu_ops.nf4_code import BLOCK
from gpu_ops.nf4_gemv import Decode, _book, _decode_gather, _load_f32, _sms
from gpu_ops.nf4_ptx import prmt_bf16_asm, q4_bf16_asm
from gpu_ops.q4_triton import codes_f32, scale_zero

MAX_ROWS = 64
MAX_TILES = 1 << 14  # output tiles a split launch may have: the size of the counter buffer
PRMT_BF16 = tl.constexpr(prmt_bf16_asm(scaled=False))
PRMT_BF16_SCALED = tl.constexpr(prmt_bf16_asm(scaled=True))
Q4_BF16 = tl.constexpr(q4_bf16_asm())
# inline-asm operands: 8 bf16 (16-bit registers) out; the word and the 8 tables in (+ the absmax bits)
_OUT8_IN9 = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r,r,r")
_OUT8_IN10 = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r,r,r,r")
_OUT8_IN2 = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r")


class Scale(enum.IntEnum):
    WEIGHT = 0  # absmax applied to the decoded bf16 weights (bitsandbytes' dequantized values)
    SUM = 1  # absmax applied to each 64-group's float32 partial dot (BLOCK_K = 64)


@dataclasses.dataclass(frozen=True)
class MmaConfig:
    """Tiles and launch of one nf4_mma call; BLOCK_M follows from the rows (`block_m`)."""

    block_n: int = 128  # output features a program
    block_k: int = 128  # codes of K a step (a multiple of the 64-code group)
    warps: int = 8
    stages: int = 3  # Triton's software pipelining of the x tiles (weights: prefetched one step ahead)
    split: int = 1  # programs along K per output tile
    scale: Scale = Scale.WEIGHT
    swap: bool = False  # True: yᵀ = W·xᵀ, the decoded tile the MMA's A; False: y = x·Wᵀ, it is B

    def __post_init__(self):
        pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
        if not (pow2(self.block_n) and self.block_n >= 16 and pow2(self.block_k) and self.block_k >= BLOCK
                and self.split >= 1 and (self.scale is Scale.WEIGHT or self.block_k == BLOCK)
                and (self.swap or self.warps >= 4)):
            raise ValueError(f"{self}: block_n a power of two ≥ 16, block_k a power of two ≥ {BLOCK} "
                             f"(= {BLOCK} with Scale.SUM), split ≥ 1, ≥ 4 warps (a warpgroup) unless swap")

    def fit(self, K: int) -> MmaConfig:
        """The same config with block_k, then split, lowered until block_k · split divides K."""
        bk, s = self.block_k, self.split
        while K % (bk * s):
            if bk > BLOCK and K % bk:
                bk //= 2
            else:
                s -= 1
        return dataclasses.replace(self, block_k=bk, split=s)

    def block_m(self, rows: int) -> int:
        """Rows of x a program: the row bucket with swap (the MMA's N), else 64 (wgmma's M, zero-padded)."""
        return row_bucket(rows) if self.swap else 64

    @property
    def tag(self) -> str:
        return (f"n{self.block_n}k{self.block_k}w{self.warps}s{self.stages}x{self.split}"
                f"{'-sum' if self.scale is Scale.SUM else ''}{'-swap' if self.swap else ''}")


# (N, K, row bucket) → the fastest config measured on an H100 (bench/nf4_mma.py, 2026-11-23 04:07
# UTC, bench/RESULTS.md); other shapes take `default_config`
CONFIGS: dict[tuple[int, int, int], MmaConfig] = {
    # µs at rows 4: 11.4, 8: 11.4, 16: 11.6
    (4096, 4096, 16): MmaConfig(block_n=64, block_k=128, warps=4, stages=3, split=8, swap=True),
    # µs at rows 32: 13.5
    (4096, 4096, 32): MmaConfig(block_n=128, block_k=256, warps=8, stages=3, split=4, swap=True),
    # µs at rows 64: 16.2
    (4096, 4096, 64): MmaConfig(block_n=128, block_k=256, warps=8, stages=3, split=4),
    # µs at rows 4: 30.0, 8: 30.1, 16: 30.6
    (4096, 14336, 16): MmaConfig(block_n=64, block_k=128, warps=4, stages=3, split=8, swap=True),
    # µs at rows 32: 36.4
    (4096, 14336, 32): MmaConfig(block_n=128, block_k=128, warps=4, stages=3, split=8, swap=True),
    # µs at rows 64: 39.5
    (4096, 14336, 64): MmaConfig(block_n=128, block_k=64, warps=8, stages=3, split=8),
    # µs at rows 4: 15.2, 8: 15.2, 16: 15.5
    (6144, 4096, 16): MmaConfig(block_n=64, block_k=128, warps=4, stages=3, split=8, swap=True),
    # µs at rows 32: 15.9
    (6144, 4096, 32): MmaConfig(block_n=64, block_k=128, warps=4, stages=3, split=4, swap=True),
    # µs at rows 64: 19.1
    (6144, 4096, 64): MmaConfig(block_n=64, block_k=128, warps=4, stages=3, split=4),
    # µs at rows 4: 56.3, 8: 57.2, 16: 57.2
    (28672, 4096, 16): MmaConfig(block_n=64, block_k=128, warps=4, stages=3, split=1, swap=True),
    # µs at rows 32: 59.0
    (28672, 4096, 32): MmaConfig(block_n=64, block_k=128, warps=4, stages=3, split=1, swap=True),
    # µs at rows 64: 74.5
    (28672, 4096, 64): MmaConfig(block_n=128, block_k=64, warps=4, stages=3, split=1, scale=Scale.SUM, swap=True),
    # µs at rows 4: 198.6, 8: 202.2, 16: 199.4
    (128256, 4096, 16): MmaConfig(block_n=64, block_k=128, warps=4, stages=3, split=1, swap=True),
    # µs at rows 32: 220.1
    (128256, 4096, 32): MmaConfig(block_n=64, block_k=128, warps=4, stages=3, split=1, swap=True),
    # µs at rows 64: 286.7
    (128256, 4096, 64): MmaConfig(block_n=128, block_k=64, warps=4, stages=3, split=1, scale=Scale.SUM, swap=True),
}


def row_bucket(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def default_config(N: int, K: int, rows: int, sms: int) -> MmaConfig:
    """For shapes the table lacks, what won on most of its shapes up to 32 rows: 64 × 128 tiles
    of W·xᵀ (swap), 4 warps, and the smallest split (≤ 8) that gives every SM a program. (The
    x·Wᵀ loop counts fewer instructions in bench/nf4_mma_sass.py, but measured slower at ≤ 32
    rows: it pads the rows to 64.)"""
    tiles, steps = triton.cdiv(N, 64), max(1, K // 128)
    split = next((d for d in range(1, 9) if steps % d == 0 and tiles * d >= sms), 1)
    return MmaConfig(block_n=64, block_k=128, warps=4, stages=3, split=split, swap=True).fit(K)


def mma_config(N: int, K: int, rows: int, sms: int) -> MmaConfig:
    cfg = CONFIGS.get((N, K, row_bucket(rows)))
    return default_config(N, K, rows, sms) if cfg is None else cfg.fit(K)


@triton.jit
def _join8(e0, e1, e2, e3, e4, e5, e6, e7):
    """8 tensors [R, W] (element j of each word) → [R, 8W] in element order 8w + j."""
    a = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    return tl.reshape(a, [e0.shape[0], 8 * e0.shape[1]])  # a[r, w, j2, j1, j0] = e_{4·j2 + 2·j1 + j0}


@triton.jit
def _linear_value(q, SHIFT: tl.constexpr, sc, z):
    """The code at bit SHIFT of each word (`gpu_ops.q4`) as float32 (c − z) · s."""
    return (codes_f32((q >> SHIFT) & 15) - z) * sc


@triton.jit
def _decode_tile(q, s, t0, t1, t2, t3, t4, t5, t6, t7, book_ptr, DECODE: tl.constexpr, SCALED: tl.constexpr):
    """q [BN, W] int32 words → [BN, 8W] bf16 codes, times s [BN, W] (each word's absmax) if SCALED.
    LINEAR (`gpu_ops.q4`): s holds each word's group word (scale and zero), always applied."""
    if DECODE == 2:  # bf16((c − z) · s) as dequantize_q4, by bf16x2 arithmetic in PTX
        e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
            Q4_BF16, _OUT8_IN2, [q, s.to(tl.int32, bitcast=True)], dtype=(tl.int16,) * 8, is_pure=True, pack=1)
        return _join8(e0, e1, e2, e3, e4, e5, e6, e7).to(tl.bfloat16, bitcast=True)
    if DECODE == 3:  # the same in float32 (the interpreter's): element 2i in nibble i, 2i + 1 in nibble i + 4
        sc, z = scale_zero(s)  # s: the int32 group words, plainly loaded
        f0, f1 = _linear_value(q, 0, sc, z), _linear_value(q, 16, sc, z)
        f2, f3 = _linear_value(q, 4, sc, z), _linear_value(q, 20, sc, z)
        f4, f5 = _linear_value(q, 8, sc, z), _linear_value(q, 24, sc, z)
        f6, f7 = _linear_value(q, 12, sc, z), _linear_value(q, 28, sc, z)
        return _join8(f0, f1, f2, f3, f4, f5, f6, f7).to(tl.bfloat16)
    if DECODE == 0:
        if SCALED:
            e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
                PRMT_BF16_SCALED, _OUT8_IN10, [q, t0, t1, t2, t3, t4, t5, t6, t7, s.to(tl.int32, bitcast=True)],
                dtype=(tl.int16,) * 8, is_pure=True, pack=1)
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
                PRMT_BF16, _OUT8_IN9, [q, t0, t1, t2, t3, t4, t5, t6, t7], dtype=(tl.int16,) * 8, is_pure=True, pack=1)
        return _join8(e0, e1, e2, e3, e4, e5, e6, e7).to(tl.bfloat16, bitcast=True)
    f0, f1, f2, f3, f4, f5, f6, f7 = _decode_gather(q, book_ptr)  # float32 codes: the interpreter's path
    if SCALED:  # bitsandbytes' rounding: bf16(code · absmax) from float32
        f0, f1, f2, f3, f4, f5, f6, f7 = f0 * s, f1 * s, f2 * s, f3 * s, f4 * s, f5 * s, f6 * s, f7 * s
    return _join8(f0, f1, f2, f3, f4, f5, f6, f7).to(tl.bfloat16)


@triton.jit
def _load_scales(a_rows, k, words, SCALE: tl.constexpr, DECODE: tl.constexpr):
    """absmax for the step at code k: per word [BN, W] (WEIGHT) or the step's one group [BN, 1] (SUM)."""
    if SCALE == 1:
        s = tl.load(a_rows + k // 64)
    elif DECODE == 0 or DECODE == 2:  # (2: the group words' bits, as float32)
        s = _load_f32(a_rows + (k // 64 + words // 8)[None, :])  # takes q's layout: no shuffle before the decoder
    else:
        s = tl.load(a_rows + (k // 64 + words // 8)[None, :])
    return s  # (one return: Triton wants every return of a function to have one type)


@triton.jit
def _mma(w, xk, acc, s, SCALE: tl.constexpr, DOT_F32: tl.constexpr, SWAP: tl.constexpr):
    """acc + the step's product: W·xᵀ [BN, BM] (SWAP: w is the MMA's A, xk = xᵀ [BK, BM]) or
    x·Wᵀ [BM, BN] (xk = x [BM, BK] is A, the decoded tile B, read by the MMA from shared memory)."""
    if SWAP:
        a, b = w, xk
    else:
        a, b = xk, tl.trans(w)
        if SCALE == 1:
            s = tl.trans(s)  # the group's absmax [BN, 1] → [1, BN]
    if DOT_F32:  # exact products: for checks (Triton's CPU interpreter mishandles bf16 dots)
        a, b = a.to(tl.float32), b.to(tl.float32)
        if SCALE == 1:
            return acc + tl.dot(a, b, input_precision="ieee") * s
        return tl.dot(a, b, acc, input_precision="ieee")
    if SCALE == 1:
        return acc + tl.dot(a, b) * s
    return tl.dot(a, b, acc)


@triton.jit
def _tile(n_vals, m_vals, SWAP: tl.constexpr):
    """n_vals[n] + m_vals[m] over the accumulator's tile: [BN, BM] if SWAP, else [BM, BN]."""
    if SWAP:
        t = n_vals[:, None] + m_vals[None, :]
    else:
        t = m_vals[:, None] + n_vals[None, :]
    return t


@triton.jit
def _tile_mask(n_ok, m_ok, SWAP: tl.constexpr):
    """n_ok[n] & m_ok[m] over the accumulator's tile."""
    if SWAP:
        t = n_ok[:, None] & m_ok[None, :]
    else:
        t = m_ok[:, None] & n_ok[None, :]
    return t


@triton.jit
def _store_y(y_ptr, res_ptr, acc, y_off, r_off, ok, RES: tl.constexpr):
    """acc → y bf16 at y_off, + res (at r_off) rounded as torch's res + y.to(bf16)."""
    out = acc.to(tl.bfloat16)
    if RES:
        r = tl.load(res_ptr + r_off, mask=ok, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16)
    tl.store(y_ptr + y_off, out, mask=ok)


@triton.jit(do_not_specialize=["M", "splits"])
def _nf4_mma_kernel(
    x_ptr, w32_ptr, absmax_ptr, book_ptr, y_ptr, res_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_ym, stride_rm, k_per_split, splits,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr, SWAP: tl.constexpr,
    DECODE: tl.constexpr, SPLIT: tl.constexpr, RES: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    """Output tile of BLOCK_N features × BLOCK_M rows over codes [pid_s·k_per_split, +k_per_split)."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    W: tl.constexpr = BLOCK_K // 8  # int32 words a row a step
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # out-of-range features re-read row N-1; their results are dropped
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    words = tl.arange(0, W)
    w_rows = w32_ptr + rows.to(tl.int64)[:, None] * (K // 8)  # [BN, 1]
    a_rows = absmax_ptr + rows.to(tl.int64)[:, None] * (K // 64)  # [BN, 1]
    kk = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + _tile(kk, offs_m * stride_xm, SWAP)  # step 0 of xᵀ [BK, BM] (SWAP) or x [BM, BK]
    x_ok = _tile_mask(kk < BLOCK_K, m_ok, SWAP)
    # the PRMT tables (unused by GATHER), loaded, not immediates, so that they stay in registers
    tab = book_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + 16
    t0, t1, t2, t3 = tl.load(tab), tl.load(tab + 1), tl.load(tab + 2), tl.load(tab + 3)
    t4, t5, t6, t7 = tl.load(tab + 4), tl.load(tab + 5), tl.load(tab + 6), tl.load(tab + 7)
    k_first = pid_s * k_per_split
    q = tl.load(w_rows + (k_first // 8 + words)[None, :])  # [BN, W] int32
    s = _load_scales(a_rows, k_first, words, SCALE, DECODE)
    if PDL:  # weights and scales are constant: loaded above while the previous kernel ends; x is not
        gdc_wait()
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(0, k_per_split, BLOCK_K):  # (not range(k_first, ...): Triton's interpreter rejects it)
        k = k_first + i
        more = i + BLOCK_K < k_per_split  # the next step's weights load while this one computes
        k_next = k_first + tl.minimum(i + BLOCK_K, k_per_split - BLOCK_K)
        q_next = tl.load(w_rows + (k_next // 8 + words)[None, :], mask=more, other=0)
        s_next = _load_scales(a_rows, k_next, words, SCALE, DECODE)
        xk = tl.load(x_tile + k, mask=x_ok, other=0.0)  # bf16, from L2
        w = _decode_tile(q, s, t0, t1, t2, t3, t4, t5, t6, t7, book_ptr, DECODE, SCALE == 0)  # [BN, BK] bf16
        acc = _mma(w, xk, acc, s, SCALE, DOT_F32, SWAP)
        q, s = q_next, s_next
    if PDL:
        gdc_launch_dependents()
    ok = _tile_mask(offs_n < N, m_ok, SWAP)
    y_off = _tile(offs_n, offs_m * stride_ym, SWAP)
    r_off = _tile(offs_n, offs_m * stride_rm, SWAP)
    if SPLIT:
        mn = _tile(offs_n, offs_m * N, SWAP)  # offsets in one [M, N] partial
        tl.store(part_ptr + pid_s * M * N + mn, acc, mask=ok)
        tl.debug_barrier()  # every thread's partials are written before the counter says so
        tile = pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == splits - 1:  # the last of the tile's programs
            total = tl.zeros_like(acc)
            for j in range(0, splits):  # in split order whoever arrives last: deterministic
                total += tl.load(part_ptr + j * M * N + mn, mask=ok, other=0.0, cache_modifier=".cg")
            _store_y(y_ptr, res_ptr, total, y_off, r_off, ok, RES)
            tl.store(count_ptr + tile, 0)  # ready for the next launch
    else:
        _store_y(y_ptr, res_ptr, acc, y_off, r_off, ok, RES)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def nf4_mma(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int],
            config: MmaConfig | None = None, residual: torch.Tensor | None = None,
            decode: Decode = Decode.PRMT, dot_f32: bool = False) -> torch.Tensor:
    """x [M ≤ 64, K] bf16, W [N, K] as NF4 (K a multiple of 64) → y [M, N] bf16 (+ residual [M, N] bf16).
    decode=LINEAR: W in `gpu_ops.q4`'s linear format instead (packed int32 [N, K/8], absmax its sz
    words [N, K/64]).

    config: default `mma_config` (the measured table, else a heuristic); block_k and split are
    lowered to fit K. decode=GATHER (NF4), LINEAR_F32 (q4) and dot_f32 are for Triton's CPU
    interpreter (no inline PTX, no bf16 dots)."""
    N, K = shape
    M = x.shape[0]
    if K % BLOCK or not 1 <= M <= MAX_ROWS:
        raise ValueError(f"nf4_mma takes 1..{MAX_ROWS} rows and K divisible by {BLOCK}, got x {tuple(x.shape)}, W {shape}")
    cfg = (config or mma_config(N, K, M, _sms(x.device))).fit(K)
    if decode in (Decode.LINEAR, Decode.LINEAR_F32) and cfg.scale is Scale.SUM:
        # the linear format's zero points need the weights scaled
        cfg = dataclasses.replace(cfg, scale=Scale.WEIGHT)
    BM = cfg.block_m(M)
    x = x.to(torch.bfloat16)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and (residual.shape != (M, N) or residual.dtype != torch.bfloat16
                                 or residual.stride(-1) != 1):
        raise ValueError(f"residual must be bf16 [{M}, {N}] with unit stride, got {residual.dtype} {tuple(residual.shape)}")
    y = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    res = y if residual is None else residual
    grid = (triton.cdiv(N, cfg.block_n), cfg.split, triton.cdiv(M, BM))
    part = counts = y  # unused without split
    if cfg.split > 1:
        if grid[0] * grid[2] > MAX_TILES:
            raise ValueError(f"split-K over {grid[0] * grid[2]} tiles, the counters hold {MAX_TILES}: use split=1")
        part = torch.empty((cfg.split, M, N), dtype=torch.float32, device=x.device)
        counts = _counters(x.device)
    _nf4_mma_kernel[grid](
        x, packed.view(torch.int32), absmax, _book(x.device), y, res, part, counts,
        M, N, K, x.stride(0), y.stride(0), res.stride(0), K // cfg.split, cfg.split,
        BLOCK_N=cfg.block_n, BLOCK_M=BM, BLOCK_K=cfg.block_k, SCALE=int(cfg.scale), SWAP=cfg.swap, DECODE=int(decode),
        SPLIT=cfg.split > 1, RES=residual is not None, DOT_F32=dot_f32, PDL=pdl.enabled(x.device),
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl.launch(x.device),
    )
    return y
