"""Intel AMX tiles for int8 decode with many query rows a kv head: scores and value sums as tile
products (`decode_int8` takes them from `TILE_MIN_HEADS` rows a kv head on).

Where a kv head has many query rows (a speculative run's rows times GQA's heads: 8 × 4 = 32),
the vector kernels' arithmetic grows with the rows and bounds the call, not the KV's bytes
(`bench/RESULTS.md`, "Verifying k rows over one read of the KV"). An AMX tile multiply does 16
rows × 16 columns × 64 bytes in one instruction, and the int8 pool's byte order (`layout.py`)
is already the order its second operand wants, four consecutive bytes a 32-bit element:

- scores (`scores_tiles`): C[row, token] += Σ_c q[row, c] k[token, c]. A: the rows' 64
  channels of one of q's pieces (hi or lo, one signed byte each, `decode_int8._split_q`); B:
  16 channel groups × 16 tokens × 4 channels, exactly a block's keys [D/4, BS, 4] at a row
  stride of 4 BS bytes (tdpbssd: signed × signed, no sign flip). Two groups of 16 tokens at a
  time, hi and lo each: four accumulators, four independent products in flight (one group
  at a time left two, each waiting on the one before).
- values (`values_tiles`): C[row, channel] += Σ_t w[row, t] v[t, channel]. A: the rows' BS
  weights of a block (unsigned bytes, `decode_int8._softmax_split`); B: BS/4 groups of 4
  tokens × 16 channels × 4 tokens, exactly a block's values [BS/4, D, 4] at a row stride of
  4 D bytes (tdpbusd: unsigned × signed). Four accumulators hold 64 channels at a time.

Each call loads its own tile configuration (81 ns on the GPU host) and takes every group of
`rows` query rows (`_row_groups`); `release` frees the tile state at the end of a thread's work.
Both are exact integer sums, the same as the vector kernels': the twins (`scores_twin`,
`values_twin`, plain loops) give the same bits and stand in for the tiles where the CPU has
none, so the tile path's logic runs in CI. `TILES` is true where Numba compiles for a CPU with
amx-tile and amx-int8 and Linux has granted the process the tile state (arch_prctl
ARCH_REQ_XCOMP_PERM, asked once at import); then `scores_tiles`, `values_tiles` and `release`
are the tile intrinsics, else the twins. Shapes: D % 64 == 0, BS % 16 == 0, BS <= 64, at most
16 rows a group; token groups of 16 (the score chunks of `decode_int8._tile_addresses`).

What the tiles leave: with the products this cheap, the online softmax's float work (an
exponential per row and token, 32 a token and kv head for a run of 8) is most of a run's time,
as it is the vector kernels' (bench/RESULTS.md).
"""
from __future__ import annotations

import ctypes

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from cpu_attention._numba import JIT
from cpu_attention._simd import _FEATURES, _args, _ir
from cpu_attention._simd_vnni import _at, _c, _ptr

ROWS = 16  # query rows a tile holds
ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158  # Linux x86-64


def _permit() -> bool:
    """Ask Linux for the tile data state (needed before the first tile instruction of the process,
    else it faults); false where the CPU Numba compiles for has no AMX or the kernel refuses."""
    if not {"amx-tile", "amx-int8"} <= _FEATURES:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        args = (ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM), ctypes.c_long(XFEATURE_XTILEDATA))
        return libc.syscall(*args) == 0  # longs: a variadic call's registers are read whole
    except (OSError, AttributeError):
        return False


TILES = _permit()


def _tile_ops(builder):
    """The tile instructions as LLVM's x86 intrinsics (tile registers as immediates)."""
    ir, cgutils = _ir()
    i8, i64, i8p, void = ir.IntType(8), ir.IntType(64), ir.IntType(8).as_pointer(), ir.VoidType()

    def fn(name, args):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(void, args), name)

    cfg, load, store = fn("llvm.x86.ldtilecfg", [i8p]), fn("llvm.x86.tileloadd64", [i8, i8p, i64]), \
        fn("llvm.x86.tilestored64", [i8, i8p, i64])
    zero, release = fn("llvm.x86.tilezero", [i8]), fn("llvm.x86.tilerelease", [])
    dps = {"ss": fn("llvm.x86.tdpbssd", [i8, i8, i8]), "us": fn("llvm.x86.tdpbusd", [i8, i8, i8])}

    class Ops:
        @staticmethod
        def configure(shapes):
            """ldtilecfg of palette 1 with tile t as shapes[t] = (rows: an i8 value, bytes a row: an int
            or an i16 value); the other tiles unused."""
            mem = cgutils.alloca_once(builder, ir.ArrayType(i8, 64))
            builder.store(ir.Constant(ir.ArrayType(i8, 64), None), mem)
            base = builder.bitcast(mem, i8p)
            builder.store(i8(1), base)
            for t, (rows, colsb) in enumerate(shapes):
                width = ir.IntType(16)(colsb) if isinstance(colsb, int) else colsb
                builder.store(width, builder.bitcast(builder.gep(base, [i64(16 + 2 * t)]), ir.IntType(16).as_pointer()))
                builder.store(rows, builder.gep(base, [i64(48 + t)]))
            builder.call(cfg, [base])

        load = staticmethod(lambda t, ptr, stride: builder.call(load, [i8(t), ptr, stride]))
        store = staticmethod(lambda t, ptr, stride: builder.call(store, [i8(t), ptr, stride]))
        zero = staticmethod(lambda t: builder.call(zero, [i8(t)]))
        dp = staticmethod(lambda kind, c, a, b: builder.call(dps[kind], [i8(c), i8(a), i8(b)]))
        release = staticmethod(lambda: builder.call(release, []))

    return Ops


def _row_groups(builder, G, rows, body):
    """body(g0) for each group of `rows` query rows: g0 = 0, rows, ..., the last at G - rows."""
    _, cgutils = _ir()
    n = builder.sdiv(builder.add(G, builder.sub(rows, rows.type(1))), rows)
    with cgutils.for_range(builder, n) as loop:
        at = builder.mul(loop.index, rows)
        last = builder.sub(G, rows)
        body(builder.select(builder.icmp_signed("<", at, last), at, last))


def _scores_codegen(context, builder, sig, args):
    ir, cgutils = _ir()
    qp, k, kbase, ngroups, BS, ci, rows = _args(context, builder, sig, args)
    intp = context.get_value_type(types.intp)
    i8 = ir.IntType(8)
    G, D = builder.extract_value(qp.shape, 1), builder.extract_value(qp.shape, 2)
    TL = builder.extract_value(ci.shape, 2)
    ops = _tile_ops(builder)
    r8 = builder.trunc(rows, i8)
    # t0..t3 sums (rows × 16 tokens, int32): hi and lo of token group a, hi and lo of group b;
    # t4, t5 q's hi and lo (A: rows × 64 channels); t6, t7 keys of groups a and b (B: 16 channel
    # groups × 16 tokens × 4 channels). Two token groups at a time: four independent products.
    ops.configure([(r8, 64)] * 6 + [(i8(16), 64)] * 2)
    krow = builder.mul(BS, intp(4))  # bytes between a block's channel groups
    tstride = builder.mul(TL, intp(4))
    halves = builder.sdiv(D, intp(64))
    last = builder.sub(ngroups, intp(1))

    def group(g0):
        qrow = [builder.mul(builder.add(builder.mul(intp(p), G), g0), D) for p in range(2)]  # (piece, g0, 0)
        crow = [builder.mul(builder.add(builder.mul(intp(p), G), g0), TL) for p in range(2)]
        with cgutils.for_range_slice(builder, intp(0), ngroups, intp(2), intp) as (a, _):
            b = builder.select(builder.icmp_signed("<", a, last), builder.add(a, intp(1)), last)
            for t in range(4):
                ops.zero(t)
            with cgutils.for_range(builder, halves) as loop_h:
                h = loop_h.index
                for p in range(2):
                    ops.load(4 + p, _ptr(builder, qp.data, builder.add(qrow[p], builder.mul(h, intp(64))), i8), D)
                down = builder.mul(h, builder.mul(intp(16), krow))
                for x, t in ((a, 6), (b, 7)):
                    ops.load(t, _ptr(builder, k.data, builder.add(_at(builder, kbase, x), down), i8), krow)
                ops.dp("ss", 0, 4, 6)
                ops.dp("ss", 1, 5, 6)
                ops.dp("ss", 2, 4, 7)
                ops.dp("ss", 3, 5, 7)
            for x, t0 in ((a, 0), (b, 2)):
                col = builder.mul(x, intp(16))
                for p in range(2):
                    dst = builder.mul(builder.add(crow[p], col), intp(4))
                    ops.store(t0 + p, _ptr(builder, ci.data, dst, i8), tstride)

    _row_groups(builder, G, rows, group)
    return context.get_dummy_value()


def _values_codegen(context, builder, sig, args):
    ir, cgutils = _ir()
    wp, v, gbase, nb, BS, vi, rows = _args(context, builder, sig, args)
    intp = context.get_value_type(types.intp)
    i8 = ir.IntType(8)
    G, NP = builder.extract_value(wp.shape, 0), builder.extract_value(wp.shape, 1)
    D = builder.extract_value(vi.shape, 1)
    ops = _tile_ops(builder)
    r8, g8 = builder.trunc(rows, i8), builder.trunc(builder.sdiv(BS, intp(4)), i8)
    # t0..t3 sums of 64 channels (rows × 16 channels, int32); t4 weights (A: rows × BS tokens);
    # t5..t7 values in turn (B: BS/4 groups × 16 channels × 4 tokens)
    ops.configure([(r8, 64)] * 4 + [(r8, builder.trunc(BS, ir.IntType(16)))] + [(g8, 64)] * 3)
    vstride = builder.mul(D, intp(4))
    per_block = builder.sdiv(BS, intp(4))

    def group(g0):
        with cgutils.for_range(builder, builder.sdiv(D, intp(64))) as loop_h:
            h = loop_h.index
            for j in range(4):
                ops.zero(j)
            with cgutils.for_range(builder, nb) as loop_i:
                i = loop_i.index
                w_at = builder.add(builder.mul(g0, NP), builder.mul(i, BS))
                ops.load(4, _ptr(builder, wp.data, w_at, i8), NP)
                vb = _at(builder, gbase, builder.mul(i, per_block))
                for j in range(4):
                    at = builder.add(vb, builder.mul(builder.add(builder.mul(h, intp(64)), intp(16 * j)), intp(4)))
                    ops.load(5 + j % 3, _ptr(builder, v.data, at, i8), vstride)
                    ops.dp("us", j, 4, 5 + j % 3)
            for j in range(4):
                at = builder.mul(builder.add(builder.mul(g0, D), builder.add(builder.mul(h, intp(64)), intp(16 * j))),
                                 intp(4))
                ops.store(j, _ptr(builder, vi.data, at, i8), vstride)

    _row_groups(builder, G, rows, group)
    return context.get_dummy_value()


def _release_codegen(context, builder, sig, args):
    _tile_ops(builder).release()
    return context.get_dummy_value()


@intrinsic
def _release(typingctx):
    return types.void(), _release_codegen


@intrinsic
def _scores_tiles(typingctx, qp, k, kbase, ngroups, BS, ci, rows):
    if not (_c(qp, types.int8, 3) and _c(k, types.int8) and _c(kbase, types.int64, 1) and _c(ci, types.int32, 3)):
        return None
    return types.void(qp, k, kbase, ngroups, BS, ci, rows), _scores_codegen


@intrinsic
def _values_tiles(typingctx, wp, v, gbase, nb, BS, vi, rows):
    if not (_c(wp, types.uint8, 2) and _c(v, types.int8) and _c(gbase, types.int64, 1) and _c(vi, types.int32, 2)):
        return None
    return types.void(wp, v, gbase, nb, BS, vi, rows), _values_codegen


@numba.njit(inline="always", **JIT)
def release_twin():
    """What `release` does for the twins: nothing."""


@numba.njit(inline="always", **JIT)
def _groups(G, rows):
    return (G + rows - 1) // rows


@numba.njit(**JIT)
def scores_twin(qp, k, kbase, ngroups, BS, ci, rows):
    """For every row g of q's pieces qp (int8 [2, G, D]) and token group x < ngroups of 16 tokens
    whose keys start at byte kbase[x] of k (int8, the VNNI key order [D/4, BS, 4]): ci[p, g,
    16 x + j] = Σ_c qp[p, g, c] k[j, c] (int32 [2, G, TL]). rows: the tiles' rows (`_row_groups`)."""
    kf = k.reshape(-1)
    G, D = qp.shape[1], qp.shape[2]
    for gi in range(_groups(G, rows)):
        g0 = min(gi * rows, G - rows)
        for x in range(ngroups):
            base = kbase[x]
            for j in range(16):
                for g in range(g0, g0 + rows):
                    for p in range(2):
                        acc = np.int32(0)
                        for c in range(D):
                            acc += np.int32(qp[p, g, c]) * np.int32(kf[base + (c // 4) * 4 * BS + 4 * j + c % 4])
                        ci[p, g, 16 * x + j] = acc


@numba.njit(**JIT)
def values_twin(wp, v, gbase, nb, BS, vi, rows):
    """For every row g: vi[g, d] = Σ over the nb blocks' tokens j of wp[g, i BS + j] v[j, d],
    block i's values (int8, the VNNI value order [BS/4, D, 4]) from byte gbase[i BS / 4] of v;
    wp uint8 [G, >= nb BS], vi int32 [G, D]."""
    vf = v.reshape(-1)
    G, D = wp.shape[0], vi.shape[1]
    for gi in range(_groups(G, rows)):
        g0 = min(gi * rows, G - rows)
        for g in range(g0, g0 + rows):
            for d in range(D):
                acc = np.int32(0)
                for i in range(nb):
                    base = gbase[i * (BS // 4)]
                    for j in range(BS):
                        acc += np.int32(wp[g, i * BS + j]) * np.int32(vf[base + (j // 4) * 4 * D + 4 * d + j % 4])
                vi[g, d] = acc


release = _release if TILES else release_twin
scores_tiles = _scores_tiles if TILES else scores_twin
values_tiles = _values_tiles if TILES else values_twin
