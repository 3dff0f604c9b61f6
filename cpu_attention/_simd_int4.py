"""SIMD micro-kernels for int4 decode: integer dot products over 4-bit codes (LLVM vector IR).

The codes (`int4.py`) are never widened to floats. The two hot loops widen them in registers
and multiply them with integer factors in which the scales are already folded
(`_simd_int4_factors` for the keys, `_simd_int4_weights` for the values), summing in int32:

- keys are per channel over a block: score = Σ_d q_d (code_d s_d + z_d) = Σ_d (q_d s_d) code_d +
  q · z, so each token costs one integer dot product of an int16 q' ≈ q · s / qsc with its codes,
  as 16-bit lanes (x86 pmaddwd, which LLVM fuses with the add into vpdpwssd where VNNI is there;
  `make_scores_int4`);
- values are per token and group of 32 channels: Σ_t p_t (code_t s_tg + z_tg) = Σ_t (p_t s_tg)
  code_t + Σ_t p_t z_tg, so the codes of four tokens are summed against their weights p_t s_tg,
  rounded to one byte, by one vpdpbusd per 16 channels (`make_accumulate_int4`).

Keys (the VNNI order, [D/8, BS, 4] a block and head): a 32-bit lane holds 8 channels of one token
(8r + j low nibble, 8r + 4 + j high, j < 4), so a vector of W lanes is W tokens. Masked with
0x000F000F, shifted right by 8, 4 or 12 first, it gives each token's channel pairs (8r, 8r+2),
(8r+1, 8r+3), (8r+4, 8r+6), (8r+5, 8r+7) as 16-bit lanes, and one pmaddwd each against q's
pair, splat, adds them to the W tokens' scores: no horizontal sums (the row layout this replaced
spent a third of its score instructions on them). q' is stored in that pair order (`PAIRS`).

Values (the VNNI value order, quads of 4 tokens [D/2, 4]): a 32-bit lane of a quad's group r
holds byte 16r + i of its 4 tokens' packed rows; masked with 0x0F0F0F0F it is the 4 tokens'
codes of channel 32r + i as bytes, shifted right by 4 first, of channel 32r + 16 + i. vpdpbusd
of the splat 4 weights (unsigned bytes) of head and group with them (signed bytes, 0..15) adds
the 4 tokens to 16 channels: 11 instructions a token and kv head (G = 4, D = 128) where token
pairs by pmaddwd took 30, and the accumulator stays in channel order. Without VNNI each vpdpbusd
is one pmaddubsw and one pmaddwd (`_simd_vnni._dpbusd`; no pair saturates: 2 · 255 · 15 < 2^15).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from cpu_attention._simd import IVEC, _args, _c_array_1d, _c_array_2d, _ir, _madd, _splat, _vec_ptr
from cpu_attention._simd_vnni import DPBUSD, W_LANES, _at, _c, _dpbusd, _fold_pieces

SUM_TOKENS = 4096  # tokens one value pass sums in int32: 4096 · 255 · 15 < 2^31 (2^24 in the float it becomes)


def _dot_add(builder, acc, a, b):
    """acc + pmaddwd(a, b): <L x i32> acc, <2L x i16> a, b (one vpdpwssd where VNNI is there)."""
    return builder.add(acc, _madd(builder, a, b))


def _fma(builder, n):
    ir, cgutils = _ir()
    f32v = ir.VectorType(ir.FloatType(), n)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32v, [f32v] * 3), f"llvm.fmuladd.v{n}f32")


PAIRS = (0, 2, 1, 3, 4, 6, 5, 7)  # pair order: the channels of positions 8r + i are 8r + PAIRS[i]


def _scores_int4_codegen(ng, W):
    """Codegen of `scores_int4`: see `make_scores_int4`."""

    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        i32 = ir.IntType(32)
        D = builder.extract_value(qp.shape, 1)
        S = builder.extract_value(s.shape, 1)
        i32v, i16v, f32v = ir.VectorType(i32, W), ir.VectorType(ir.IntType(16), 2 * W), ir.VectorType(ir.FloatType(), W)
        fma = _fma(builder, W)
        i8p = ir.IntType(8).as_pointer()
        pref = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                              "llvm.prefetch")
        rows = builder.sdiv(D, intp(8))
        row_bytes = builder.mul(BS, intp(4))
        heads = [builder.add(g, intp(i)) for i in range(ng)]
        qrow = [builder.mul(h, D) for h in heads]
        mask = ir.Constant(i32v, [0x000F000F] * W)
        shifts = [None, ir.Constant(i32v, [8] * W), ir.Constant(i32v, [4] * W), ir.Constant(i32v, [12] * W)]
        # per head, one sum per channel-pair vector: 4 ng independent chains
        accs = [[cgutils.alloca_once(builder, i32v) for _ in range(4)] for _ in range(ng)]
        lanes = [intp(j) for j in range(W)]

        def chunk(c0, load):  # tokens off + c0 .. off + c0 + W of the block
            for i in range(ng):
                for p in range(4):
                    builder.store(ir.Constant(i32v, None), accs[i][p])
            with cgutils.for_range_slice(builder, intp(0), rows, intp(1), intp) as (r, _):
                tok = builder.mul(builder.add(off, c0), intp(4))  # the chunk's first token, in bytes
                x = load(builder.add(kb, builder.add(builder.mul(r, row_bytes), tok)))
                pairs = [builder.bitcast(builder.and_(x if sh is None else builder.lshr(x, sh), mask), i16v)
                         for sh in shifts]  # (8r, 8r+2), (8r+1, 8r+3), (8r+4, 8r+6), (8r+5, 8r+7) a token
                # the same bytes of a later block's keys and values into L2, of the next one's values
                # into L1: over a block's rows and chunks, every line of its D·BS/2 bytes (4W bytes a
                # chunk of a row: a line where W is 16)
                at = builder.add(builder.mul(r, row_bytes), tok)
                for arr, base, level in ((k, pk, 2), (v, pv, 2), (v, pv1, 3)):
                    ptr = builder.gep(arr.data, [builder.add(base, at)], inbounds=True)
                    builder.call(pref, [builder.bitcast(ptr, i8p), i32(0), i32(level), i32(1)])
                for i in range(ng):
                    at = builder.add(qrow[i], builder.mul(r, intp(8)))
                    for p in range(4):
                        ptr = builder.bitcast(builder.gep(qp.data, [builder.add(at, intp(2 * p))], inbounds=True),
                                              i32.as_pointer())
                        qv = builder.bitcast(_splat(builder, builder.load(ptr, align=2), W), i16v)
                        builder.store(_dot_add(builder, builder.load(accs[i][p]), pairs[p], qv), accs[i][p])
            for i in range(ng):
                tot = [builder.load(a) for a in accs[i]]
                tot = builder.add(builder.add(tot[0], tot[1]), builder.add(tot[2], tot[3]))
                sc = builder.call(fma, [builder.sitofp(tot, f32v), _splat(builder, _at(builder, qsc, heads[i]), W),
                                        _splat(builder, _at(builder, qcon, heads[i]), W)])
                dst = builder.gep(s.data, [builder.add(builder.mul(heads[i], S), builder.add(col, c0))], inbounds=True)
                builder.store(sc, builder.bitcast(dst, f32v.as_pointer()), align=4)

        def vector_load(at):
            ptr = builder.bitcast(builder.gep(k.data, [at], inbounds=True), i32v.as_pointer())
            return builder.load(ptr, align=1)

        full = builder.mul(builder.sdiv(nb, intp(W)), intp(W))
        with cgutils.for_range_slice(builder, intp(0), full, intp(W), intp) as (c0, _):
            chunk(c0, vector_load)
        with builder.if_then(builder.icmp_signed("<", full, nb)):
            m = builder.sub(nb, full)

            def lane_load(at):  # the m tokens left, one lane at a time (never past them: the pool may end there)
                x = ir.Constant(i32v, None)
                for j in range(W):
                    live = builder.icmp_signed("<", lanes[j], m)
                    lane = builder.select(live, lanes[j], intp(0))
                    at_j = builder.add(at, builder.mul(lane, intp(4)))
                    ptr = builder.bitcast(builder.gep(k.data, [at_j], inbounds=True), i32.as_pointer())
                    x = builder.insert_element(x, builder.select(live, builder.load(ptr, align=1), i32(0)), i32(j))
                return x

            chunk(full, lane_load)
        return context.get_dummy_value()

    return codegen


def make_scores_int4(ng: int, W: int = IVEC):
    """An intrinsic scores_int4(qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g): the scores
    of a block's tokens off .. off + nb for heads g .. g+ng, s[g+i, col + j] = qsc[g+i] · Σ_c
    qp'[g+i, c] · code(off + j, c) + qcon[g+i] for j < nb, W tokens a vector (the pool's VNNI key
    order, `int4.py`: the block's keys of one head at byte kb of k, [D/8, BS, 4]); each 32-bit lane
    split by a mask and shifts into a token's four channel pairs as 16-bit lanes, each summed
    against q's pair by one pmaddwd (vpdpwssd with VNNI). Meanwhile the bytes at the same offsets
    of a later block's keys and values (bytes pk of k, pv of v) are prefetched into L2, and of the
    next block's values (pv1) into L1: a block's D·BS/2 bytes of each over its chunks. (A line a
    row of the first chunk only, as before, left half of a block of 32 unprefetched: int4 at
    block 32 read 0.31–0.44 of DRAM where block 16 read 0.50–0.55, bench/RESULTS.md.)

    qp [G, D] int16 in pair order (position 8r + i holds channel 8r + PAIRS[i]); qsc, qcon [G]
    float32; k, v uint8 (any shape, C-contiguous); s [G, S] float32 with S ≥ col + nb rounded up
    to W (the last vector is stored whole). Sums exact in int32 (|q| ≤ 32767, codes ≤ 15, D ≤
    4096). D % 8 == 0. No bounds checks; reads no byte of k outside the block's tokens."""

    @intrinsic
    def scores_int4(typingctx, qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g):
        if not (_c_array_2d(qp, types.int16) and _c_array_1d(qsc, types.float32) and _c_array_1d(qcon, types.float32)
                and _c(k, types.uint8) and _c(v, types.uint8) and _c_array_2d(s, types.float32)):
            return None
        return (types.void(qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g),
                _scores_int4_codegen(ng, W))

    return scores_int4


def _accumulate_int4_codegen(ng, C, IW, P, name):
    """Codegen of `accumulate_int4`: see `make_accumulate_int4`."""

    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        wq, wsc, zsum, g, v, quads, nq, acc = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        G, NG, S = (builder.extract_value(wq.shape, i) for i in (1, 2, 3))
        D = builder.extract_value(acc.shape, 1)
        H = builder.sdiv(D, intp(2))  # bytes of a token's codes
        i32, i32v, f32v = ir.IntType(32), ir.VectorType(ir.IntType(32), IW), ir.VectorType(ir.FloatType(), IW)
        nib = ir.Constant(i32v, [0x0F0F0F0F] * IW)
        four = ir.Constant(i32v, [4] * IW)
        fma = _fma(builder, IW)
        # element of (piece p, head g+i, group 0, token 0) in wq; of (head g+i, channel 0) in acc
        wrow = [[builder.mul(builder.add(builder.mul(intp(p), G), builder.add(g, intp(i))), builder.mul(NG, S))
                 for p in range(P)] for i in range(ng)]
        arow = [builder.mul(builder.add(g, intp(i)), D) for i in range(ng)]
        regs = [[[[cgutils.alloca_once(builder, i32v) for _ in range(2)] for _ in range(P)] for _ in range(C)]
                for _ in range(ng)]

        def one_pass(b0, nk):  # the channels of bytes b0 .. b0 + nk·IW of a token (nk chunks, each in one group)
            for i in range(ng):
                for kk in range(nk):
                    for p in range(P):
                        for h in range(2):
                            builder.store(ir.Constant(i32v, None), regs[i][kk][p][h])
            with cgutils.for_range_slice(builder, intp(0), nq, intp(1), intp) as (u, _):
                base = _at(builder, quads, u)
                for kk in range(nk):
                    off = builder.add(b0, intp(kk * IW))
                    x = builder.load(_vec_ptr(builder, v.data, builder.add(base, builder.mul(off, intp(4))), i32v),
                                     align=1)
                    codes = (builder.and_(x, nib), builder.and_(builder.lshr(x, four), nib))  # channels c, c + 16
                    grp = builder.mul(builder.sdiv(off, intp(16)), S)
                    for i in range(ng):
                        for p in range(P):  # the 4 tokens' weights of head g+i, group grp: one 32-bit lane, splat
                            at = builder.add(wrow[i][p], builder.add(grp, builder.mul(u, intp(4))))
                            w = _splat(builder, builder.load(_vec_ptr(builder, wq.data, at, i32), align=1), IW)
                            for h in range(2):
                                r = regs[i][kk][p][h]
                                builder.store(_dpbusd(builder, builder.load(r), w, codes[h], name, small_b=True), r)
            for kk in range(nk):
                off = builder.add(b0, intp(kk * IW))
                grp = builder.sdiv(off, intp(16))
                ch = builder.add(builder.mul(grp, intp(32)), builder.srem(off, intp(16)))
                for i in range(ng):
                    at = builder.add(builder.mul(builder.add(g, intp(i)), NG), grp)
                    sc = _splat(builder, _at(builder, wsc, at), IW)
                    z = _splat(builder, _at(builder, zsum, at), IW)
                    for h in range(2):
                        ptr = _vec_ptr(builder, acc.data, builder.add(arow[i], builder.add(ch, intp(16 * h))), f32v)
                        r = regs[i][kk]
                        tot = (builder.sitofp(builder.load(r[0][h]), f32v) if P == 1
                               else _fold_pieces(builder, builder.load(r[0][h]), builder.load(r[1][h])))
                        builder.store(builder.call(fma, [sc, tot, builder.fadd(builder.load(ptr, align=4), z)]), ptr,
                                      align=4)

        full = builder.mul(builder.sdiv(H, intp(C * IW)), intp(C * IW))
        with cgutils.for_range_slice(builder, intp(0), full, intp(C * IW), intp) as (b0, _):
            one_pass(b0, C)
        with cgutils.for_range_slice(builder, full, H, intp(IW), intp) as (b0, _):
            one_pass(b0, 1)
        return context.get_dummy_value()

    return codegen


VALUE_PIECES = 1  # bytes of a value weight (`make_value_factors`): 1, or 2 as int8's (hi, lo)


def make_accumulate_int4(ng: int, C: int | None = None, IW: int = IVEC, P: int = VALUE_PIECES):
    """An intrinsic accumulate_int4(wq, wsc, zsum, g, v, quads, nq, acc): for heads i < ng and every
    channel d of group r = d // 32,
    acc[g+i, d] += wsc[g+i, r] · Σ_{u<nq} Σ_{j<4} w[g+i, r, 4u+j] · code(token j of quad u, d) + zsum[g+i, r],
    w = wq[0] (P = 1) or 256 wq[0] + wq[1] (P = 2), the sums exact in int32: one vpdpbusd adds a quad's
    4 tokens to 16 channels (`_simd_vnni._dpbusd`: pmaddubsw and pmaddwd without VNNI). C chunks of
    IW channels a head (default 2 for P = 1, 1 for P = 2) in registers over the nq quads, then
    converted and added to acc.

    wq [P, G, D/32, S] uint8 weights by token column (4u + j: quad u's token j; nq ≤ SUM_TOKENS / 4), wsc,
    zsum [G, D/32] float32 their scales and the zero points' share (`value_factors`); v uint8 (any
    shape, C-contiguous) holding quads in the VNNI value order (`int4.py`: [D/2, 4], byte (c, j) token
    j's packed byte c), quads [≥ nq] int64 the byte offset of each; acc [G, D] float32; all
    C-contiguous; D % 32 == 0, IW ≤ 16. No bounds checks."""
    C = C or (2 if P == 1 else 1)
    name = DPBUSD if IW == W_LANES else None  # vpdpbusd only at the width it was chosen for

    @intrinsic
    def accumulate_int4(typingctx, wq, wsc, zsum, g, v, quads, nq, acc):
        if not (_c(wq, types.uint8, 4) and _c_array_2d(wsc, types.float32) and _c_array_2d(zsum, types.float32)
                and _c(v, types.uint8) and _c(quads, types.int64, 1) and _c_array_2d(acc, types.float32)):
            return None
        return types.void(wq, wsc, zsum, g, v, quads, nq, acc), _accumulate_int4_codegen(ng, C, IW, P, name)

    return accumulate_int4


@numba.njit(nogil=True, cache=True)
def pair_order(D: int) -> np.ndarray:
    """The channel at each position of the pair order (`make_scores_int4`), [D] int64: for the
    kernel's q16 and for tests."""
    out = np.empty(D, np.int64)
    for r in range(D // 8):
        for i in range(8):
            out[8 * r + i] = 8 * r + PAIRS[i]
    return out
