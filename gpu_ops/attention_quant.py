"""Triton paged decode attention over int8 and int4 KV blocks (`GpuKVPool.kv_dtype` INT8 / INT4).

Why: the KV read is the whole cost of decode attention, and a quantized block is ~1/1.9 (int8)
or ~1/3.6 (int4) of a bf16 block's bytes. Each code byte is read once from HBM and dequantized
in registers; nothing is gathered or converted in memory first (`decode_attention_torch` is
the torch twin: gather, dequantize to float32, softmax).

Layouts are `cpu_attention.layout`'s (module doc) and `cpu_attention.int4`'s. Each keeps 4 codes
of a tile column in a 32-bit word (the VNNI order), so a tile loads as words, contiguous along a
row (16-byte vector loads, pipelined), and `_unpack_rows` splits them in registers. Against byte
loads, at 1 × 32k and 16 × 8k, block 32 (H100): int8 89 → 69 and 258 → 196 µs, int4 94 → 83 and
295 → 270 (the int8 loop's PTX: 578 instructions a block against 413):
    int8 keys    [D, BS]    channel d of token t at (d//4)·4BS + 4t + d%4   (4 bytes contiguous)
    int8 values  [BS, D]    token t of channel d at (t//4)·4D + 4d + t%4
    int4 keys    [D/2, BS]  byte row x = (r, j) = (x//4, x%4): low nibble channel 8r + j, high 8r + 4 + j
    int4 values  [BS, D/2]  byte c of a packed row: low nibble channel 32(c//16) + c%16, high +16
int4 splits channels into the low and high nibbles' sets: q is loaded in the two orders, and
values accumulate in two halves (acc_lo, acc_hi), each in its own channel order, until the
epilogue's product with Rᵀ (rows taken in the same orders) puts them back.

Scales go where they cost least: int8 keys' per-token scale multiplies the score, int8 values'
multiplies the softmax weight. int4 keys are dequantized in registers (code·s + z per element,
to bf16, as a bf16 pool's keys): (q∘s)·code + q·z per block was tried and took 206 registers
against 127 (D 128, BS 16, sm_90: the [GP, D/2] float32 products and the q·z reductions).
Codes become floats by a conversion (I2F, quarter-rate on Hopper): as float bits instead
(`q4_triton.codes_f32`) the kernel read 651 against 655 GB/s at 1 × 64k, 583 against 582 at
1 × 32k (block 32, H200): the conversion is not what bounds it.
int4 values are dequantized in registers, their per-(token, group) scale and zero expanded to
the tile's columns by a product with a one-hot [16, D/2] matrix (exact: one nonzero term)
instead of a gather load per element. Loading scales as contiguous vectors and reordering them
in registers instead (a [D] → 2 × [D/2] permute for keys, a broadcast to [BS, D/2] for values)
cut the loop's PTX from 859 instructions to 643 and was slower on the H100: 111-116 µs against
83 at 1 × 32k (the broadcast's layout conversion goes through shared memory).

Rotation (`cpu_attention.rotation`, R orthonormal): int8 keys are stored as k @ R, so scores
use q_rot = q @ R, made once per program; int8 and int4 values are stored as v @ R, so the
accumulator is rotated and each split's output is turned back, out = acc_rot @ Rᵀ, before
the merge (linear, so merging rotated-back partials is exact). R enters as R·√P (±1 and 0,
int8, exact in bf16) and a float32 1/√P; a float32 operand times it is split into two bf16
halves (`_rot_dot`) so the rotation keeps ~16 bits, not bf16's 8. Every product with R goes in
chunks of RC = 32 rows or columns read from memory (L2): a [D, D] operand in registers took
all 255 and spilled (`ptxas -v` for sm_90).

Blocks being filled (`tail_of_block` ≥ 0: bf16 tail, keys and values plain) are not branched
on in the main loop, which attends the codes only (a tail block's scores masked to -inf; its
stale codes are read and weighted 0: pool memory is zeroed at allocation and only ever holds
finite quantizer output). Tails are a sequence's last two blocks at most (the block being
filled, and the one this step completed, sealed at the next step's start), so one more split,
program sp = S, attends them (`_attend_tails`: plain q, plain values) and the merge takes it as
any split. A branch in the main loop kept its temporaries live there (227-255 registers against
128-140, int8), and a second loop over the split's tails beside it took 86 more (int4: 214
against 128, so one program an SM where four fit).

The dense R·√P is made on the device once per (D, device) (`rotation_matrix`): by the
first eager call, or by `prepare(pool)` before a CUDA graph is captured without an eager call
first; a capture that finds it missing raises (no host copy may happen inside a capture).

Split-K as `attention_triton`: one program per (sequence, kv head, split), splits' partial
(out, lse) merged by its merge kernel; a run's rows in one program (`attention_triton.RunRows`),
so a speculative step dequantizes each block once for all its rows. Shapes are static, no host
sync: capturable.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from cpu_attention import rotation
from cpu_attention.layout import KVDtype
from gpu_ops import pdl
from gpu_ops.runs import RunRows
from gpu_ops.attention_triton import _query_rows, _sms, merge_splits, query_rows, split_outputs
from gpu_ops.kv_pool import GpuKVPool, quant_shapes_ok


@triton.jit
def _rot_dot(x, r, DOT_F32: tl.constexpr):
    """x [M, K] float32 @ r [K, N] (R·√P entries, any dtype) in float32: x as two bf16 halves
    (hi + lo), so the tensor cores keep ~16 mantissa bits of x; r's ±1 are exact in bf16."""
    if DOT_F32:
        return tl.dot(x, r.to(tl.float32), input_precision="ieee")
    rb = r.to(tl.bfloat16)
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(hi, rb) + tl.dot(lo, rb)


@triton.jit
def _rotate_rows(src_ptr, row_off, row_ok, rot_ptr, cols, M: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                 RC: tl.constexpr, DOT_F32: tl.constexpr):
    """Rows x of a float tile in memory (row r at src_ptr + row_off[r], D contiguous values) → x @ R·√P
    at channels cols: [M, N] float32. K goes in chunks of RC rows of R, read from memory, so no
    operand is larger than [RC, N] (a [D, D] operand in registers took all 255 and spilled)."""
    acc = tl.zeros([M, N], tl.float32)
    for k0 in tl.static_range(0, D, RC):
        k = k0 + tl.arange(0, RC)
        x = tl.load(src_ptr + row_off[:, None] + k[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        acc += _rot_dot(x, tl.load(rot_ptr + k[:, None] * D + cols[None, :]), DOT_F32)
    return acc


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One block's scores s [GP, BS] (masked: -inf) into the running max m_i and sum l_i [GP]:
    → (p [GP, BS], alpha [GP] for the accumulator, new m_i, new l_i)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _lse(m_i, l_i, lse_ptr, dst, row_ok):
    """Stores the split's lse (-inf where it saw no token) → 1 / l (1 there: its out stays 0)."""
    empty = l_i == 0.0
    tl.store(lse_ptr + dst, tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i))), mask=row_ok)
    return 1.0 / tl.where(empty, 1.0, l_i)


@triton.jit
def _attend_tails(q_ptr, tk_ptr, tv_ptr, tob_ptr, bt_row_ptr, o_ptr, lse_ptr, row_ok, n_row, head, n, dst,
                  layer, T1, Hkv, h, scale, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DT: tl.constexpr):
    """The tail split: the run's last two blocks, those in a bf16 tail, attended with plain q and
    values (each row masked at its length) → (out, lse) at rows dst."""
    d = tl.arange(0, D)
    t = tl.arange(0, BS)
    q = tl.load(q_ptr + (head * D)[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(DT)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    nb = tl.cdiv(n, BS)
    for i in range(tl.maximum(nb - 2, 0), nb):
        blk = tl.load(bt_row_ptr + i).to(tl.int64)
        tail = tl.load(tob_ptr + blk)
        if tail >= 0:
            tb = ((layer * T1 + tail) * Hkv + h).to(tl.int64) * (BS * D)
            kt = tl.load(tk_ptr + tb + (t * D)[None, :] + d[:, None])  # [D, BS] transposed
            s = tl.dot(q, kt.to(DT)).to(tl.float32) * scale
            s = tl.where((i * BS + t)[None, :] < n_row[:, None], s, float("-inf"))
            p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
            vt = tl.load(tv_ptr + tb + (t * D)[:, None] + d[None, :])  # [BS, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(DT), vt.to(DT))
    inv_l = _lse(m_i, l_i, lse_ptr, dst, row_ok)
    tl.store(o_ptr + (dst * D)[:, None] + d[None, :], (acc * inv_l[:, None]).to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _store_rotated_back(acc, inv_l, inv_sqrt, rot_ptr, d, o_ptr, dst, row_ok, D: tl.constexpr,
                        RC: tl.constexpr, DOT_F32: tl.constexpr):
    """out = acc @ Rᵀ·√P · inv_sqrt · inv_l at rows dst, by column chunks of RC (no [D, D] operand)."""
    for n0 in tl.static_range(0, D, RC):
        e = n0 + tl.arange(0, RC)
        o = _rot_dot(acc, tl.load(rot_ptr + e[None, :] * D + d[:, None]), DOT_F32)
        tl.store(o_ptr + (dst * D)[:, None] + e[None, :], (o * (inv_sqrt * inv_l)[:, None]).to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def _unpack_rows(w, R: tl.constexpr, C: tl.constexpr, SIGNED: tl.constexpr):
    """Words w [R, C] int32, four codes each → the codes [4R, C] int32, byte j of word (r, c) at
    row 4r + j: the layouts keep 4 codes of a column in a word, so a tile loads as 32-bit words."""
    if SIGNED:
        b0, b1, b2, b3 = (w << 24) >> 24, (w << 16) >> 24, (w << 8) >> 24, w >> 24
    else:
        b0, b1, b2, b3 = w & 255, (w >> 8) & 255, (w >> 16) & 255, (w >> 24) & 255
    x = tl.join(tl.join(b0, b1), tl.join(b2, b3))  # [R, C, k, i]: byte 2i + k
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (4 * R, C))


@triton.jit
def _int8_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tk_ptr, tv_ptr, tob_ptr, rot_ptr, bt_ptr, len_ptr, run_ptr, o_ptr,
    lse_ptr, layer, NB1, T1, Hkv, MB, blocks_per_split, scale, inv_sqrt, B, Hq,
    G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, RC: tl.constexpr,
    DT: tl.constexpr, DOT_F32: tl.constexpr, RUNS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    b, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row_ok, n_row, head, n = _query_rows(run_ptr, len_ptr, b, h, Hq, G, GP, RUNS)
    dst = sp * B * Hq + head
    if sp == tl.num_programs(2) - 1:
        _attend_tails(q_ptr, tk_ptr, tv_ptr, tob_ptr, bt_ptr + b * MB, o_ptr, lse_ptr, row_ok, n_row, head, n, dst,
                      layer, T1, Hkv, h, scale, GP, BS, D, DT)
    else:
        _int8_split(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tob_ptr, rot_ptr, bt_ptr + b * MB, o_ptr, lse_ptr,
                    row_ok, n_row, head, n, dst, layer, NB1, Hkv, h, sp, blocks_per_split, scale, inv_sqrt,
                    GP, BS, D, RC, DT, DOT_F32)


@triton.jit
def _int8_split(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tob_ptr, rot_ptr, bt_row_ptr, o_ptr, lse_ptr,
                row_ok, n_row, head, n, dst, layer, NB1, Hkv, h, sp, blocks_per_split, scale, inv_sqrt,
                GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, RC: tl.constexpr, DT: tl.constexpr,
                DOT_F32: tl.constexpr):
    d = tl.arange(0, D)
    t = tl.arange(0, BS)
    q_row = head * D
    q_rot = (_rotate_rows(q_ptr, q_row, row_ok, rot_ptr, d, GP, D, D, RC, DOT_F32) * inv_sqrt).to(DT)  # q @ R
    k_words = k_ptr.to(tl.pointer_type(tl.int32))
    v_words = v_ptr.to(tl.pointer_type(tl.int32))
    k_off = (tl.arange(0, D // 4) * BS)[:, None] + t[None, :]  # [D/4, BS] words: 4 channels of a token
    v_off = (tl.arange(0, BS // 4) * D)[:, None] + d[None, :]  # [BS/4, D] words: 4 tokens of a channel
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)  # Σ p · (v @ R): rotated
    first = sp * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(n, BS))
    for i in range(first, last):
        blk = tl.load(bt_row_ptr + i).to(tl.int64)
        hb = (layer * NB1 + blk) * Hkv + h  # (layer, block, head): index of its codes, scales
        kc = _unpack_rows(tl.load(k_words + hb * (BS * D // 4) + k_off), D // 4, BS, True)  # [D, BS]
        ksc = tl.load(ks_ptr + hb * BS + t)  # [BS] per-token key scale, on the score
        vc = _unpack_rows(tl.load(v_words + hb * (BS * D // 4) + v_off), BS // 4, D, True)  # [BS, D]
        vsc = tl.load(vs_ptr + hb * BS + t)  # [BS] per-token value scale, on the weight
        tail = tl.load(tob_ptr + blk)  # ≥ 0: the block is in a tail, attended by the tail split
        s = tl.dot(q_rot, kc.to(DT)).to(tl.float32) * (ksc * scale)[None, :]
        s = tl.where(((i * BS + t)[None, :] < n_row[:, None]) & (tail < 0), s, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot((p * vsc[None, :]).to(DT), vc.to(DT))
    inv_l = _lse(m_i, l_i, lse_ptr, dst, row_ok)
    _store_rotated_back(acc, inv_l, inv_sqrt, rot_ptr, d, o_ptr, dst, row_ok, D, RC, DOT_F32)


@triton.jit
def _int4_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, tk_ptr, tv_ptr, tob_ptr, rot_ptr, bt_ptr, len_ptr,
    run_ptr, o_ptr, lse_ptr, layer, NB1, T1, Hkv, MB, blocks_per_split, scale, inv_sqrt, B, Hq,
    G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, RC: tl.constexpr,
    DT: tl.constexpr, DOT_F32: tl.constexpr, RUNS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    b, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row_ok, n_row, head, n = _query_rows(run_ptr, len_ptr, b, h, Hq, G, GP, RUNS)
    dst = sp * B * Hq + head
    if sp == tl.num_programs(2) - 1:
        _attend_tails(q_ptr, tk_ptr, tv_ptr, tob_ptr, bt_ptr + b * MB, o_ptr, lse_ptr, row_ok, n_row, head, n, dst,
                      layer, T1, Hkv, h, scale, GP, BS, D, DT)
    else:
        _int4_split(q_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, tob_ptr, rot_ptr, bt_ptr + b * MB, o_ptr,
                    lse_ptr, row_ok, n_row, head, n, dst, layer, NB1, Hkv, h, sp, blocks_per_split, scale, inv_sqrt,
                    GP, BS, D, RC, DT, DOT_F32)


@triton.jit
def _int4_split(q_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, tob_ptr, rot_ptr, bt_row_ptr, o_ptr,
                lse_ptr, row_ok, n_row, head, n, dst, layer, NB1, Hkv, h, sp, blocks_per_split, scale, inv_sqrt,
                GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, RC: tl.constexpr, DT: tl.constexpr,
                DOT_F32: tl.constexpr):
    t = tl.arange(0, BS)
    x = tl.arange(0, D // 2)  # key byte rows and value byte columns
    kch = (x // 4) * 8 + x % 4  # a key byte's low-nibble channel; + 4: its high one
    vch = (x // 16) * 32 + x % 16  # a value byte's low-nibble channel; + 16: its high one
    q_row = (head * D)[:, None]
    # q at the key bytes' low- and high-nibble channels: [GP, D/2] dot operands each
    qb_lo = tl.load(q_ptr + q_row + kch[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32).to(DT)
    qb_hi = tl.load(q_ptr + q_row + kch[None, :] + 4, mask=row_ok[:, None], other=0.0).to(tl.float32).to(DT)
    k_words = k_ptr.to(tl.pointer_type(tl.int32))
    v_words = v_ptr.to(tl.pointer_type(tl.int32))
    k_off = (tl.arange(0, D // 8) * BS)[:, None] + t[None, :]  # [D/8, BS] words: 4 key bytes of a token
    v_off = (tl.arange(0, BS // 4) * (D // 2))[:, None] + x[None, :]  # [BS/4, D/2] words: 4 tokens' bytes
    gi = tl.arange(0, 16)  # value groups, padded to a dot's minimum K
    vs_off = (t * (D // 32))[:, None] + gi[None, :]  # [BS, 16]
    g_ok = (gi < (D // 32))[None, :]
    onehot = ((x // 16)[None, :] == gi[:, None]).to(DT)  # [16, D/2]: byte column → its group
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc_lo = tl.zeros([GP, D // 2], tl.float32)  # Σ p · (v @ R) at channels vch
    acc_hi = tl.zeros([GP, D // 2], tl.float32)  # ... at channels vch + 16
    first = sp * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(n, BS))
    for i in range(first, last):
        blk = tl.load(bt_row_ptr + i).to(tl.int64)
        hb = (layer * NB1 + blk) * Hkv + h
        kb = _unpack_rows(tl.load(k_words + hb * (BS * D // 8) + k_off), D // 8, BS, False)  # [D/2, BS] bytes
        sc_lo = tl.load(ks_ptr + hb * D + kch).to(tl.float32)  # per block and channel
        sc_hi = tl.load(ks_ptr + hb * D + kch + 4).to(tl.float32)
        z_lo = tl.load(kz_ptr + hb * D + kch).to(tl.float32)
        z_hi = tl.load(kz_ptr + hb * D + kch + 4).to(tl.float32)
        vb = _unpack_rows(tl.load(v_words + hb * (BS * D // 8) + v_off), BS // 4, D // 2, False)  # [BS, D/2]
        vsc = tl.load(vs_ptr + hb * (BS * (D // 32)) + vs_off, mask=g_ok, other=0.0).to(DT)  # [BS, 16]
        vzr = tl.load(vz_ptr + hb * (BS * (D // 32)) + vs_off, mask=g_ok, other=0.0).to(DT)
        vsc_x = tl.dot(vsc, onehot)  # [BS, D/2] float32: each byte column's group scale
        vz_x = tl.dot(vzr, onehot)
        tail = tl.load(tob_ptr + blk)  # ≥ 0: the block is in a tail, attended by the tail split
        s = tl.dot(qb_lo, ((kb & 15).to(tl.float32) * sc_lo[:, None] + z_lo[:, None]).to(DT))
        s = (s + tl.dot(qb_hi, ((kb >> 4).to(tl.float32) * sc_hi[:, None] + z_hi[:, None]).to(DT))) * scale
        s = tl.where(((i * BS + t)[None, :] < n_row[:, None]) & (tail < 0), s.to(tl.float32), float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
        pd = p.to(DT)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(pd, ((vb & 15).to(tl.float32) * vsc_x + vz_x).to(DT))
        acc_hi = acc_hi * alpha[:, None] + tl.dot(pd, ((vb >> 4).to(tl.float32) * vsc_x + vz_x).to(DT))
    inv_l = _lse(m_i, l_i, lse_ptr, dst, row_ok)
    for n0 in tl.static_range(0, D, RC):  # out = acc @ Rᵀ by column chunks, acc's rows by halves
        e = n0 + tl.arange(0, RC)
        o = _rot_dot(acc_lo, tl.load(rot_ptr + e[None, :] * D + vch[:, None]), DOT_F32)
        o += _rot_dot(acc_hi, tl.load(rot_ptr + e[None, :] * D + vch[:, None] + 16), DOT_F32)
        tl.store(o_ptr + (dst * D)[:, None] + e[None, :], (o * (inv_sqrt * inv_l)[:, None]).to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


# (warps, pipeline stages[, registers a thread at most]): the fastest of bench/gpu_kv_attention.py's
# --launch 4x1,4x2,4x2x128 at 1 × 32k and 16 × 8k, one row and runs of 5, block 32 (H100), codes
# loaded as words: int8 4x2 69-371 µs against 73-386 for 4x1 (with byte loads 4x1 was the faster);
# int4 capped at 128 registers (four programs an SM) 83-521 µs against 92-570 uncapped
LAUNCH = {KVDtype.INT8: (4, 2), KVDtype.INT4: (4, 2, 128)}


@functools.cache
def rotation_matrix(D: int, device: torch.device) -> torch.Tensor:
    """R·√P [D, D] int8 on `device` (±1 on the Hadamard blocks, 0 off them; `rotation.py`'s R =
    this / √P). Made once per (D, device); not inside a CUDA graph capture."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the quantized attention's rotation for head dim {D} is not on {device} yet: call "
                           "gpu_ops.attention_quant.prepare(pool) (or run one eager step) before capturing")
    r = torch.round(rotation.rotate(torch.eye(D)) * math.sqrt(rotation.block(D)))
    return r.to(torch.int8).to(device)


def prepare(pool: GpuKVPool) -> None:
    """Make what `paged_decode_quant` caches for this pool now (a capture may not create it)."""
    if pool.quantized:
        rotation_matrix(pool.head_dim, pool.k.device)
        _sms(pool.k.device)


def paged_decode_quant(
    pool: GpuKVPool, layer: int, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, out_dtype: torch.dtype = torch.float32, dot_f32: bool = False, runs: RunRows | None = None,
    launch: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gpu_ops.attention.decode_attention` → (out [B, Hq, D] out_dtype, lse [B, Hq]
    float32), q and out plain (unrotated). dot_f32: float32 dots (Triton's CPU interpreter); launch:
    (warps, pipeline stages[, registers a thread at most]) a program, default `LAUNCH`'s."""
    B, Hq, D = q.shape
    Hkv, BS = pool.num_kv_heads, pool.block_size
    if not quant_shapes_ok(pool.kv_dtype, D, BS):
        raise ValueError(f"no Triton kernel for {pool.kv_dtype.value} KV with head dim {D}, block size {BS}: "
                         "use kernel=AttnKernel.TORCH (or AUTO)")
    MB = block_tables.shape[1]
    # splits as attention_triton's, and the tail split last
    S, per, o, lse = split_outputs(B, Hq, Hkv, D, MB, q.device, out_dtype, runs, extra=1)
    rot = rotation_matrix(D, q.device)
    common = dict(**query_rows(Hq // Hkv, runs), BS=BS, D=D, RC=min(32, D), DT=tl.float32 if dot_f32 else tl.bfloat16,
                  DOT_F32=dot_f32, PDL=pdl.enabled(q.device))
    launch = launch or LAUNCH[pool.kv_dtype]
    common.update(num_warps=launch[0], num_stages=launch[1],
                  **({"maxnreg": launch[2]} if len(launch) > 2 else {}), **pdl.launch(q.device))
    # tail_of_block is per block, layer independent; the tails are [L, T + 1, Hkv, BS, D]
    lens = seq_lens.to(torch.int32).contiguous()
    tails = (pool.tail_k, pool.tail_v, pool.tail_of_block, rot, block_tables.contiguous(), lens,
             runs.codes if runs is not None else lens, o, lse)
    sizes = (layer, pool.k.shape[1], pool.tail_k.shape[1], Hkv, MB, per, scale, 1.0 / math.sqrt(rotation.block(D)),
             B, Hq)
    if pool.kv_dtype is KVDtype.INT8:
        _int8_kernel[(B, Hkv, S + 1)](q.contiguous(), pool.k, pool.v, pool.k_scale, pool.v_scale, *tails, *sizes, **common)
    else:
        _int4_kernel[(B, Hkv, S + 1)](q.contiguous(), pool.k, pool.v, pool.k_scale, pool.k_zero, pool.v_scale, pool.v_zero,
                                      *tails, *sizes, **common)
    return merge_splits(o, lse, out_dtype)
