"""SIMD micro-kernels for int4 decode: integer dot products over 4-bit codes (LLVM vector IR).

The codes (`int4.py`) are never widened to floats. The two hot loops widen them to 16-bit lanes in
registers and multiply them with int16 factors in which the scales are already folded, summing
in int32 (x86 pmaddwd, which LLVM fuses with the add into vpdpwssd where VNNI is there):

- keys are per channel over a block: score = Σ_d q_d (code_d s_d + z_d) = Σ_d (q_d s_d) code_d +
  q · z, so each token costs one integer dot product of an int16 q' ≈ q · s / qsc with its codes
  (`make_scores_int4`). q' is made per block and head in one instruction a vector: q is rounded
  to int16 once a step (q16, `decode_int4._query16`), the block's scales once for all heads (u16
  = s / b, `make_block_scales`), and q' = q16 · u16 / 2^15 by pmulhrsw (`make_block_query`).
  (Rounding q · s itself, per block and head, needs a pass for its maximum and one to round:
  measured 13.8 of the kernel's 31 ns a token and head on the GPU host.) q' then keeps 2^-15 of
  max|q| · max s rather than of max|q s|, far finer than the 16 levels of the codes;
- values are per token and group of 32 channels: Σ_t p_t (code_t s_tg + z_tg) = Σ_t (p_t s_tg)
  code_t + Σ_t p_t z_tg, so per tile the weights p_t s_tg are rounded to int16 (`make_value_factors`,
  from the tile's scales gathered by `make_scales_copy`) and the codes of two tokens are summed
  by one pmaddwd per pair of lanes (`make_accumulate_int4`).

Rounding: the weights keep 2^-16 of their largest element (as the int8 path's q and weights), q'
2^-15 of max|q| · max s (above). The rounding errors e of a factor multiply codes of 0..15, whose
mean ~7.5 would turn them into a bias shared by all tokens of a block (keys: the log-sum-exp
moves); the kernels' float constants subtract 7.5 Σ e, so what is left is Σ e (code - 7.5).

Keys (the VNNI order, [D/8, BS, 4] a block and head): a 32-bit lane holds 8 channels of one token
(8r + j low nibble, 8r + 4 + j high, j < 4), so a vector of W lanes is W tokens. Masked with
0x000F000F, shifted right by 8, 4 or 12 first, it gives each token's channel pairs (8r, 8r+2),
(8r+1, 8r+3), (8r+4, 8r+6), (8r+5, 8r+7) as 16-bit lanes, and one pmaddwd each against q's
pair, splat, adds them to the W tokens' scores: no horizontal sums (the row layout this replaced
spent a third of its score instructions on them). q' is stored in that pair order (`PAIRS`).

Values: IW bytes of one group of tokens A and B, each zero-extended to IW int32 lanes and
combined as A | B << 16; masked with 0x000F000F it holds, lane i, the int16 pair (A's code, B's
code) of channel 32r + i.., and shifted right by 4 first, of channel 32r + 16 + i..: pmaddwd with
the splat weight pair (w_A, w_B) of group r sums both tokens, and the accumulator stays in
channel order.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from cpu_attention._simd import (
    ACC_CHUNKS, IVEC, VEC, _args, _c_array_2d, _ir, _madd, _mulhrs, _shuffle, _splat, _vec_ptr,
)

Q16 = np.float32(32767.0)  # int16 levels of a factor's largest element
TINY = np.float32(1e-30)  # below this a row's int16 scale (max / 32767) would leave float32's normal range
MID = np.float32(7.5)  # the codes' midpoint: rounding errors are centred on it (module doc)
SUM_TOKENS = 4096  # tokens one value pass sums in int32: 4096 · 32767 · 15 < 2^31


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
                # a line a row: a later block's keys and values into L2, the next one's values into L1
                # (again for each further chunk of a block: a few prefetches of lines already on their way)
                at = builder.mul(r, row_bytes)
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


def _at(builder, arr, i):
    return builder.load(builder.gep(arr.data, [i], inbounds=True))


def make_scores_int4(ng: int, W: int = IVEC):
    """An intrinsic scores_int4(qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g): the scores
    of a block's tokens off .. off + nb for heads g .. g+ng, s[g+i, col + j] = qsc[g+i] · Σ_c
    qp'[g+i, c] · code(off + j, c) + qcon[g+i] for j < nb, W tokens a vector (the pool's VNNI key
    order, `int4.py`: the block's keys of one head at byte kb of k, [D/8, BS, 4]); each 32-bit lane
    split by a mask and shifts into a token's four channel pairs as 16-bit lanes, each summed
    against q's pair by one pmaddwd (vpdpwssd with VNNI). Meanwhile a line a row (D·BS/2 bytes a
    block: all of it for BS 16) of a later block's keys and values (bytes pk of k, pv of v) is
    prefetched into L2, and of the next block's values (pv1) into L1.

    qp [G, D] int16 in pair order (position 8r + i holds channel 8r + PAIRS[i]); qsc, qcon [G]
    float32; k, v uint8 (any shape, C-contiguous); s [G, S] float32 with S ≥ col + nb rounded up
    to W (the last vector is stored whole). Sums exact in int32 (|q| ≤ 32767, codes ≤ 15, D ≤
    4096). D % 8 == 0. No bounds checks; reads no byte of k outside the block's tokens."""

    @intrinsic
    def scores_int4(typingctx, qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g):
        if not (_c_array_2d(qp, types.int16) and _c_array_1d(qsc, types.float32) and _c_array_1d(qcon, types.float32)
                and isinstance(k, types.Array) and k.dtype == types.uint8 and k.layout == "C"
                and isinstance(v, types.Array) and v.dtype == types.uint8 and v.layout == "C"
                and _c_array_2d(s, types.float32)):
            return None
        return (types.void(qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g),
                _scores_int4_codegen(ng, W))

    return scores_int4


def _accumulate_int4_codegen(ng, C, IW):
    """Codegen of `accumulate_int4`: see `make_accumulate_int4`."""

    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        w16, wsc, zsum, g, v, rows, n, acc = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        H = builder.extract_value(v.shape, 1)  # bytes a row: D/2
        D = builder.mul(H, intp(2))
        NG = builder.extract_value(w16.shape, 1)
        S = builder.extract_value(w16.shape, 2)
        i8v, i32v = ir.VectorType(ir.IntType(8), IW), ir.VectorType(ir.IntType(32), IW)
        i16v, f32v = ir.VectorType(ir.IntType(16), 2 * IW), ir.VectorType(ir.FloatType(), IW)
        nib = ir.Constant(i32v, [0x000F000F] * IW)
        fma = _fma(builder, IW)
        wrow = [builder.mul(builder.add(g, intp(i)), NG) for i in range(ng)]  # row of (head, group 0) in w16, wsc
        arow = [builder.mul(builder.add(g, intp(i)), D) for i in range(ng)]
        regs = [[[cgutils.alloca_once(builder, i32v) for _ in range(2)] for _ in range(C)] for _ in range(ng)]

        def row(t):  # byte offset of the tile's row t
            return context.cast(builder, builder.load(builder.gep(rows.data, [t], inbounds=True)), sig.args[5].dtype,
                                types.intp)

        def weights(i, grp, t, pair):  # the (w_t, w_t+1) pair (or (w_t, 0)) of head g+i and group grp, splat
            at = builder.gep(w16.data, [builder.add(builder.mul(builder.add(wrow[i], grp), S), t)], inbounds=True)
            if pair:
                w = builder.load(builder.bitcast(at, ir.IntType(32).as_pointer()), align=2)
            else:
                w = builder.zext(builder.load(at), ir.IntType(32))
            return builder.bitcast(_splat(builder, w, IW), i16v)

        def step(b0, nk, t, pair):  # regs += the codes of tokens t (and t+1) × their weights
            ra = row(t)
            rb = row(builder.add(t, intp(1))) if pair else None
            for kk in range(nk):
                off = builder.add(b0, intp(kk * IW))
                grp = builder.sdiv(off, intp(16))
                u = builder.zext(builder.load(_vec_ptr(builder, v.data, builder.add(ra, off), i8v), align=1), i32v)
                if pair:
                    ub = builder.zext(builder.load(_vec_ptr(builder, v.data, builder.add(rb, off), i8v), align=1), i32v)
                    u = builder.or_(u, builder.shl(ub, ir.Constant(i32v, [16] * IW)))
                lo = builder.bitcast(builder.and_(u, nib), i16v)
                hi = builder.bitcast(builder.and_(builder.lshr(u, ir.Constant(i32v, [4] * IW)), nib), i16v)
                for i in range(ng):
                    wp = weights(i, grp, t, pair)
                    for h, x in ((0, lo), (1, hi)):
                        builder.store(_dot_add(builder, builder.load(regs[i][kk][h]), x, wp), regs[i][kk][h])

        def one_pass(b0, nk):  # channels of bytes b0 .. b0 + nk·IW (nk sub-chunks of one group each)
            for i in range(ng):
                for kk in range(nk):
                    for h in range(2):
                        builder.store(ir.Constant(i32v, None), regs[i][kk][h])
            with cgutils.for_range_slice(builder, intp(0), builder.sdiv(n, intp(2)), intp(1), intp) as (tp, _):
                step(b0, nk, builder.mul(tp, intp(2)), True)
            odd = builder.icmp_signed("!=", builder.srem(n, intp(2)), intp(0))
            with builder.if_then(odd):  # the last token alone, paired with weight 0
                step(b0, nk, builder.sub(n, intp(1)), False)
            for kk in range(nk):
                off = builder.add(b0, intp(kk * IW))
                grp = builder.sdiv(off, intp(16))
                ch = builder.add(builder.mul(grp, intp(32)), builder.srem(off, intp(16)))
                for i in range(ng):
                    at = builder.add(wrow[i], grp)
                    sc = _splat(builder, builder.load(builder.gep(wsc.data, [at], inbounds=True)), IW)
                    z = _splat(builder, builder.load(builder.gep(zsum.data, [at], inbounds=True)), IW)
                    for h in range(2):
                        ptr = _vec_ptr(builder, acc.data, builder.add(arow[i], builder.add(ch, intp(16 * h))), f32v)
                        total = builder.sitofp(builder.load(regs[i][kk][h]), f32v)
                        builder.store(builder.call(fma, [sc, total, builder.fadd(builder.load(ptr, align=4), z)]), ptr,
                                      align=4)

        full = builder.mul(builder.sdiv(H, intp(C * IW)), intp(C * IW))
        with cgutils.for_range_slice(builder, intp(0), full, intp(C * IW), intp) as (b0, _):
            one_pass(b0, C)
        with cgutils.for_range_slice(builder, full, H, intp(IW), intp) as (b0, _):
            one_pass(b0, 1)
        return context.get_dummy_value()

    return codegen


def make_accumulate_int4(ng: int, C: int = max(ACC_CHUNKS // 2, 1), IW: int = IVEC):
    """An intrinsic accumulate_int4(w16, wsc, zsum, g, v, rows, n, acc): for heads i < ng and every
    channel d of group r = d // 32,
    acc[g+i, d] += wsc[g+i, r] · Σ_{t<n} w16[g+i, r, t] · code(v.flat[rows[t]:], d) + zsum[g+i, r],
    the sums in exact int32 arithmetic (token pairs, pmaddwd / vpdpwssd), 2·C int32 vectors of IW
    lanes a head at a time in registers over the n rows, then converted and added to acc.

    w16 [G, D/32, S] int16 weights (n ≤ SUM_TOKENS), wsc, zsum [G, D/32] float32 their scales and the
    zero points' share (`value_factors`); v [R, D/2] uint8 packed rows (`int4.py`), rows [≥ n]
    integer byte offsets of the rows in v (row index × D/2); acc [G, D] float32; all C-contiguous;
    D % 32 == 0, IW ≤ 16. No bounds checks."""

    @intrinsic
    def accumulate_int4(typingctx, w16, wsc, zsum, g, v, rows, n, acc):
        if not (isinstance(w16, types.Array) and w16.dtype == types.int16 and w16.ndim == 3 and w16.layout == "C"
                and _c_array_2d(wsc, types.float32) and _c_array_2d(zsum, types.float32)
                and _c_array_2d(v, types.uint8) and isinstance(rows, types.Array)
                and isinstance(rows.dtype, types.Integer) and rows.ndim == 1 and _c_array_2d(acc, types.float32)):
            return None
        return types.void(w16, wsc, zsum, g, v, rows, n, acc), _accumulate_int4_codegen(ng, C, IW)

    return accumulate_int4


def _c_array_1d(t, dtype) -> bool:
    return isinstance(t, types.Array) and t.dtype == dtype and t.ndim == 1 and t.layout == "C"


@numba.njit(nogil=True, cache=True)
def pair_order(D: int) -> np.ndarray:
    """The channel at each position of the pair order (`make_scores_int4`), [D] int64: for the
    kernel's q16 and for tests."""
    out = np.empty(D, np.int64)
    for r in range(D // 8):
        for i in range(8):
            out[8 * r + i] = 8 * r + PAIRS[i]
    return out


def _concat(builder, parts):
    """Equal vectors joined end to end into one (a power of two of them)."""
    while len(parts) > 1:
        n = parts[0].type.count
        parts = [_shuffle(builder, a, b, list(range(2 * n))) for a, b in zip(parts[0::2], parts[1::2])]
    return parts[0]


def _hreduce(builder, v, op):
    """op over the lanes of vector v, by halving shuffles → a scalar."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = op(_shuffle(builder, v, v, list(range(n))), _shuffle(builder, v, v, list(range(n, 2 * n))))
    ir, _ = _ir()
    return builder.extract_element(v, ir.IntType(32)(0))


class _Vec:
    """Float32 vector helpers of W lanes for the factor kernels' IR."""

    def __init__(self, builder, W):
        ir, cgutils = _ir()
        self.b, self.W = builder, W
        self.f32v, self.i32v = ir.VectorType(ir.FloatType(), W), ir.VectorType(ir.IntType(32), W)
        self.i16v = ir.VectorType(ir.IntType(16), W)
        mod = builder.module
        self._fma = cgutils.get_or_insert_function(mod, ir.FunctionType(self.f32v, [self.f32v] * 3),
                                                   f"llvm.fmuladd.v{W}f32")
        self._rint = cgutils.get_or_insert_function(mod, ir.FunctionType(self.f32v, [self.f32v]), f"llvm.rint.v{W}f32")

    def const(self, x):
        ir, _ = _ir()
        return ir.Constant(self.f32v, [float(x)] * self.W)

    def load(self, base, index):
        return self.b.load(_vec_ptr(self.b, base, index, self.f32v), align=4)

    def load_bf16(self, base, index):  # W bf16 values (uint16 bits) → float32
        raw = self.b.load(_vec_ptr(self.b, base, index, self.i16v), align=2)
        return self.b.bitcast(self.b.shl(self.b.zext(raw, self.i32v), self.const_i(16)), self.f32v)

    def const_i(self, x):
        ir, _ = _ir()
        return ir.Constant(self.i32v, [x] * self.W)

    def fma(self, a, x, y):
        return self.b.call(self._fma, [a, x, y])

    def rint(self, x):  # round half to even (the default rounding mode), as np.rint
        return self.b.call(self._rint, [x])

    def abs_bits(self, x):  # |x| as int32 bits, which order as |x| does
        return self.b.and_(self.b.bitcast(x, self.i32v), self.const_i(0x7FFFFFFF))

    def imax(self, a, x):
        return self.b.select(self.b.icmp_signed(">", x, a), x, a)

    def hmax_f32(self, v):  # max lane of int32 magnitude bits → float32
        ir, _ = _ir()
        m = _hreduce(self.b, v, self.imax)
        return self.b.bitcast(m, ir.FloatType())

    def hsum(self, v):
        return _hreduce(self.b, v, self.b.fadd)

    def scale(self, mx):
        """(s, 1/s): s = mx / 32767, or 1 where mx ≤ TINY (a row all but zero: its int16 factors
        become 0 rather than scaled by an overflowing 1 / s)."""
        ir, _ = _ir()
        f32 = ir.FloatType()
        s = self.b.select(self.b.fcmp_ordered(">", mx, f32(float(TINY))), self.b.fdiv(mx, f32(float(Q16))), f32(1.0))
        return s, self.b.fdiv(f32(1.0), s)


def _block_scales_codegen(W, IW):
    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        ks, kz, row, u16, zs, bsc = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        V = _Vec(builder, W)
        D = builder.extract_value(ks.shape, 1)
        base = builder.mul(row, D)
        mxa = cgutils.alloca_once_value(builder, V.const_i(0))
        with cgutils.for_range_slice(builder, intp(0), D, intp(W), intp) as (d, _):  # max s; zs = z + 7.5 s
            sv = V.load_bf16(ks.data, builder.add(base, d))
            builder.store(V.imax(builder.load(mxa), V.abs_bits(sv)), mxa)
            zv = V.load_bf16(kz.data, builder.add(base, d))
            builder.store(V.fma(V.const(float(MID)), sv, zv), _vec_ptr(builder, zs.data, d, V.f32v), align=4)
        b, inv = V.scale(V.hmax_f32(builder.load(mxa)))
        invv = _splat(builder, inv, W)

        P = max(W, 8)  # lanes a run: whole rows of 8 channels, permuted into pair order
        Vp = _Vec(builder, P)
        perm = [8 * (i // 8) + PAIRS[i % 8] for i in range(P)]
        L = 2 * IW  # int16 lanes of the vectors `make_block_query` loads
        invp = _splat(builder, inv, P)
        # stored whole, as `make_block_query` loads them: a load that spans several narrower
        # stores still in flight is not forwarded from them and waits for them all
        with cgutils.for_range_slice(builder, intp(0), D, intp(L), intp) as (d, _):
            parts = []
            for j in range(0, L, P):
                raw = Vp.load_bf16(ks.data, builder.add(base, builder.add(d, intp(j))))
                sv = _shuffle(builder, raw, raw, perm)
                parts.append(builder.fptosi(Vp.rint(builder.fmul(sv, invp)), Vp.i16v))
            x = _concat(builder, parts)
            builder.store(x, _vec_ptr(builder, u16.data, d, x.type), align=2)
        builder.store(b, builder.gep(bsc.data, [intp(0)], inbounds=True))
        return context.get_dummy_value()

    return codegen


def make_block_scales(W: int = VEC, IW: int = IVEC):
    """An intrinsic block_scales(ks, kz, row, u16, zs, bsc): what one block's key scales s =
    ks[row] and zeros z = kz[row] give every head's q' (`make_block_query`): bsc[0] = b = max s /
    32767 (1 where max s ≤ TINY), u16 = round(s / b) in pair order (`pair_order`),
    zs = z + 7.5 s (channel order: the zero points' share of a score plus the rounding bias's
    counterweight, module doc).

    ks, kz [R, D] uint16 (bf16 bits, s ≥ 0); u16 [D] int16; zs [D], bsc [≥ 1] float32; all
    C-contiguous; D % 32 == 0, 2·IW a multiple of max(W, 8). No bounds checks."""

    @intrinsic
    def block_scales(typingctx, ks, kz, row, u16, zs, bsc):
        if not (_c_array_2d(ks, types.uint16) and _c_array_2d(kz, types.uint16) and isinstance(row, types.Integer)
                and _c_array_1d(u16, types.int16) and _c_array_1d(zs, types.float32)
                and _c_array_1d(bsc, types.float32)):
            return None
        return types.void(ks, kz, row, u16, zs, bsc), _block_scales_codegen(W, IW)

    return block_scales


def _block_query_codegen(ng, W, IW):
    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        q16, qa, u16, bsc, zs, qn, g, qp, qsc, qcon = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        V = _Vec(builder, W)
        f32 = ir.FloatType()
        D = builder.extract_value(q16.shape, 1)
        L = 2 * IW  # int16 lanes a vector
        i16v, i32v = ir.VectorType(ir.IntType(16), L), ir.VectorType(ir.IntType(32), IW)
        ones = ir.Constant(i16v, [1] * L)
        rows = [builder.mul(builder.add(g, intp(i)), D) for i in range(ng)]
        suma = [cgutils.alloca_once_value(builder, ir.Constant(i32v, None)) for _ in range(ng)]
        dota = [cgutils.alloca_once_value(builder, V.const(0)) for _ in range(ng)]
        with cgutils.for_range_slice(builder, intp(0), D, intp(L), intp) as (d, _):  # q' = q16 u16 / 2^15, Σ q'
            u = builder.load(_vec_ptr(builder, u16.data, d, i16v), align=2)
            for i in range(ng):
                at = builder.add(rows[i], d)
                x = _mulhrs(builder, builder.load(_vec_ptr(builder, q16.data, at, i16v), align=2), u)
                builder.store(x, _vec_ptr(builder, qp.data, at, i16v), align=2)
                builder.store(builder.add(builder.load(suma[i]), _madd(builder, x, ones)), suma[i])
        with cgutils.for_range_slice(builder, intp(0), D, intp(W), intp) as (d, _):  # q · zs
            zv = V.load(zs.data, d)
            for i in range(ng):
                builder.store(V.fma(V.load(qn.data, builder.add(rows[i], d)), zv, builder.load(dota[i])), dota[i])
        b = builder.load(builder.gep(bsc.data, [intp(0)], inbounds=True))
        for i in range(ng):
            gi = builder.add(g, intp(i))
            a = builder.load(builder.gep(qa.data, [gi], inbounds=True))
            sc = builder.fmul(builder.fmul(a, b), f32(32768.0))
            total = builder.sitofp(_hreduce(builder, builder.load(suma[i]), builder.add), f32)
            con = builder.fsub(V.hsum(builder.load(dota[i])), builder.fmul(builder.fmul(f32(float(MID)), sc), total))
            builder.store(sc, builder.gep(qsc.data, [gi], inbounds=True))
            builder.store(con, builder.gep(qcon.data, [gi], inbounds=True))
        return context.get_dummy_value()

    return codegen


def make_block_query(ng: int, W: int = VEC, IW: int = IVEC):
    """An intrinsic block_query(q16, qa, u16, bsc, zs, qn, g, qp, qsc, qcon): one block's query for
    heads g .. g+ng from `make_block_scales`' u16, bsc, zs: qp[g+i] = round(q16[g+i] u16 / 2^15)
    (x86 pmulhrsw: one instruction a vector, where a rounding of q · s per block and head costs a
    pass for its maximum and one for the rounding), qsc[g+i] = qa[g+i] · bsc[0] · 2^15, so that
    qsc · qp ≈ q · s; qcon[g+i] = qn[g+i] · zs - 7.5 · qsc · Σ qp[g+i] = q · z less 7.5 Σ (qsc qp -
    q s), the rounding bias (module doc).

    q16 [G, D] int16 (q rounded once a step: qn ≈ qa · q16, in pair order, `pair_order`); qa
    [G], bsc [≥ 1], zs [D] float32; u16 [D] int16; qn [G, D] float32 (channel order); qp [G, D]
    int16; qsc, qcon [G] float32; all C-contiguous; D % (2 IW) == 0, D % W == 0. No bounds checks."""

    @intrinsic
    def block_query(typingctx, q16, qa, u16, bsc, zs, qn, g, qp, qsc, qcon):
        if not (_c_array_2d(q16, types.int16) and _c_array_1d(qa, types.float32) and _c_array_1d(u16, types.int16)
                and _c_array_1d(bsc, types.float32) and _c_array_1d(zs, types.float32)
                and _c_array_2d(qn, types.float32) and isinstance(g, types.Integer) and _c_array_2d(qp, types.int16)
                and _c_array_1d(qsc, types.float32) and _c_array_1d(qcon, types.float32)):
            return None
        return types.void(q16, qa, u16, bsc, zs, qn, g, qp, qsc, qcon), _block_query_codegen(ng, W, IW)

    return block_query


def _value_factors_codegen(W):
    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        p, vsc, vzr, n, w16, wsc, zsum = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        V = _Vec(builder, W)
        f32 = ir.FloatType()
        G, P = builder.extract_value(p.shape, 0), builder.extract_value(p.shape, 1)
        NG, S = builder.extract_value(vsc.shape, 0), builder.extract_value(vsc.shape, 1)
        SW = builder.extract_value(w16.shape, 2)
        lanes = ir.Constant(ir.VectorType(ir.IntType(64), W), list(range(W)))
        full = builder.mul(builder.sdiv(n, intp(W)), intp(W))

        def over_tokens(body):  # body(j, keep): tokens j .. j+W; keep(x) zeroes the lanes at or past n
            with cgutils.for_range_slice(builder, intp(0), full, intp(W), intp) as (j, _):
                body(j, lambda x: x)
            with builder.if_then(builder.icmp_signed("<", full, n)):
                live = builder.icmp_signed("<", builder.add(_splat(builder, full, W), lanes), _splat(builder, n, W))
                body(full, lambda x: builder.select(live, x, V.const(0)))

        mxa, za, erra = (cgutils.alloca_once(builder, t) for t in (V.i32v, V.f32v, V.f32v))
        builder.store(V.const_i(0), mxa)
        with cgutils.for_range(builder, NG, intp=intp) as loop:  # the tile's largest value scale
            at = builder.mul(loop.index, S)
            over_tokens(lambda j, keep: builder.store(
                V.imax(builder.load(mxa), V.abs_bits(keep(V.load(vsc.data, builder.add(at, j))))), mxa))
        smax = V.hmax_f32(builder.load(mxa))
        with cgutils.for_range(builder, G, intp=intp) as gl:
            g = gl.index
            prow = builder.mul(g, P)
            builder.store(V.const_i(0), mxa)
            over_tokens(lambda j, keep: builder.store(
                V.imax(builder.load(mxa), V.abs_bits(keep(V.load(p.data, builder.add(prow, j))))), mxa))
            # one scale for the head's weights of every group: its largest weight × the largest scale
            s, inv = V.scale(builder.fmul(V.hmax_f32(builder.load(mxa)), smax))
            sv, invv = _splat(builder, s, W), _splat(builder, inv, W)
            with cgutils.for_range(builder, NG, intp=intp) as rl:
                r = rl.index
                at = builder.mul(r, S)
                wat = builder.mul(builder.add(builder.mul(g, NG), r), SW)
                builder.store(V.const(0), za)
                builder.store(V.const(0), erra)

                def body(j, keep):
                    pv = keep(V.load(p.data, builder.add(prow, j)))
                    prod = builder.fmul(pv, keep(V.load(vsc.data, builder.add(at, j))))
                    x = V.rint(builder.fmul(prod, invv))
                    builder.store(builder.fptosi(x, V.i16v), _vec_ptr(builder, w16.data, builder.add(wat, j), V.i16v),
                                  align=2)
                    builder.store(builder.fadd(builder.load(erra), V.fma(x, sv, builder.fneg(prod))), erra)
                    builder.store(V.fma(pv, keep(V.load(vzr.data, builder.add(at, j))), builder.load(za)), za)

                over_tokens(body)
                gr = builder.add(builder.mul(g, NG), r)
                zs = builder.fsub(V.hsum(builder.load(za)), builder.fmul(f32(float(MID)), V.hsum(builder.load(erra))))
                builder.store(s, builder.gep(wsc.data, [gr], inbounds=True))
                builder.store(zs, builder.gep(zsum.data, [gr], inbounds=True))
        return context.get_dummy_value()

    return codegen


def make_value_factors(W: int = VEC):
    """An intrinsic value_factors(p, vsc, vzr, n, w16, wsc, zsum): a tile's value factors for
    every head g and group r: w16[g, r, j] = round(p[g, j] vsc[r, j] / wsc[g, r]) for j < n
    (0 up to the next multiple of W), wsc[g, r] = max_j p[g, j] · max_{r', j} vsc[r', j] / 32767
    (one scale for all groups of a head), zsum[g, r] = Σ_j p[g, j] vzr[r, j] - 7.5 Σ_j (w16 wsc -
    p vsc) (the zero points' share, less the rounding bias: module doc).

    p [G, ≥ n rounded up to W] the tile's softmax weights (≥ 0; past n anything); vsc, vzr [D/32,
    same] float32: the tokens' value scales (> 0) and zeros per group (0 for tokens read elsewhere);
    w16 [G, D/32, same] int16; wsc, zsum [G, D/32] float32; all C-contiguous. No bounds checks."""

    @intrinsic
    def value_factors(typingctx, p, vsc, vzr, n, w16, wsc, zsum):
        if not (_c_array_2d(p, types.float32) and _c_array_2d(vsc, types.float32) and _c_array_2d(vzr, types.float32)
                and isinstance(n, types.Integer) and isinstance(w16, types.Array) and w16.dtype == types.int16
                and w16.ndim == 3 and w16.layout == "C" and _c_array_2d(wsc, types.float32)
                and _c_array_2d(zsum, types.float32)):
            return None
        return types.void(p, vsc, vzr, n, w16, wsc, zsum), _value_factors_codegen(W)

    return value_factors


SCALE_GROUPS = (2, 3, 4, 8)  # groups a token (D/32) with a vector scale copy; others: a scalar loop


def _scales_copy_codegen(W):
    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        vs, vz, row, nb, vsc, vzr, col = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        NG = builder.extract_value(vs.shape, 1)
        S = builder.extract_value(vsc.shape, 1)
        j0 = cgutils.alloca_once_value(builder, intp(0))  # tokens copied so far

        def widened(x, w):  # <w x i16> bf16 bits → <w x float>
            wide = builder.zext(x, ir.VectorType(ir.IntType(32), w))
            f32v = ir.VectorType(ir.FloatType(), w)
            return builder.bitcast(builder.shl(wide, ir.Constant(wide.type, [16] * w)), f32v)

        def chunk(ng, w, j):  # tokens j .. j+w of ng groups: one load, a shuffle per group
            for src, dst in ((vs, vsc), (vz, vzr)):
                x = builder.load(_vec_ptr(builder, src.data, builder.mul(builder.add(row, j), intp(ng)),
                                          ir.VectorType(ir.IntType(16), w * ng)), align=2)
                for r in range(ng):
                    part = x if ng == 1 else _shuffle(builder, x, x, [r + ng * i for i in range(w)])
                    at = builder.add(builder.add(builder.mul(intp(r), S), col), j)
                    builder.store(widened(part, w), _vec_ptr(builder, dst.data, at, ir.VectorType(ir.FloatType(), w)),
                                  align=4)

        def scalar():  # the tokens left, one element at a time
            with cgutils.for_range_slice(builder, builder.load(j0), nb, intp(1), intp) as (j, _):
                with cgutils.for_range(builder, NG, intp=intp) as loop:
                    r = loop.index
                    for src, dst in ((vs, vsc), (vz, vzr)):
                        x = builder.load(builder.gep(src.data, [builder.add(builder.mul(builder.add(row, j), NG), r)],
                                                     inbounds=True))
                        f = builder.bitcast(builder.shl(builder.zext(x, ir.IntType(32)), ir.IntType(32)(16)),
                                            ir.FloatType())
                        at = builder.add(builder.add(builder.mul(r, S), col), j)
                        builder.store(f, builder.gep(dst.data, [at], inbounds=True))

        done = builder.append_basic_block("scales_done")
        default = builder.append_basic_block("scales_scalar")
        sw = builder.switch(NG, default)
        for ng in SCALE_GROUPS:
            bb = builder.append_basic_block(f"scales_{ng}")
            sw.add_case(NG.type(ng), bb)
            builder.position_at_end(bb)
            full = builder.mul(builder.sdiv(nb, intp(W)), intp(W))
            with cgutils.for_range_slice(builder, intp(0), full, intp(W), intp) as (j, _):
                chunk(ng, W, j)
            builder.store(full, j0)
            w = W // 2
            while w >= 4:  # what is left (< W tokens) in halving chunks
                j = builder.load(j0)
                with builder.if_then(builder.icmp_signed("<=", builder.add(j, intp(w)), nb)):
                    chunk(ng, w, j)
                    builder.store(builder.add(j, intp(w)), j0)
                w //= 2
            builder.branch(default)
        builder.position_at_end(default)
        scalar()
        builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return codegen


def make_scales_copy(W: int = VEC):
    """An intrinsic scales_copy(vs, vz, row, nb, vsc, vzr, col): vsc[r, col + j] = vs[row + j, r]
    and vzr[r, col + j] = vz[row + j, r] as float32, for j < nb and every group r: a block's value
    scales and zeros (token-major, as the pool stores them) transposed into a tile's (group-major,
    as `value_factors` reads them). For D/32 in SCALE_GROUPS, W tokens a load (then W/2, .. 4) and a
    shuffle per group; otherwise, and for the last < 4 tokens, one element at a time.

    vs, vz [R, NG] uint16 (bf16 bits); vsc, vzr [NG, S] float32; all C-contiguous. Reads and
    writes exactly these elements. No bounds checks."""

    @intrinsic
    def scales_copy(typingctx, vs, vz, row, nb, vsc, vzr, col):
        if not (_c_array_2d(vs, types.uint16) and _c_array_2d(vz, types.uint16)
                and _c_array_2d(vsc, types.float32) and _c_array_2d(vzr, types.float32)
                and all(isinstance(t, types.Integer) for t in (row, nb, col))):
            return None
        return types.void(vs, vz, row, nb, vsc, vzr, col), _scales_copy_codegen(W)

    return scales_copy
