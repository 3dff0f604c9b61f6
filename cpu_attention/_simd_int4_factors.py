"""SIMD micro-kernels for int4 decode: the int16 factors the dot products take (LLVM vector IR).

`_simd_int4`'s dot products multiply the codes by integer factors in which the scales are folded;
these kernels make them:

- keys: q' ≈ q · s / qsc per block and head, in one instruction a vector: q is rounded to int16
  once a step (q16, `decode_int4._query16`), the block's scales once for all heads (u16 = s / b,
  `make_block_scales`), and q' = q16 · u16 / 2^15 by pmulhrsw (`make_block_query`). (Rounding q · s
  itself, per block and head, needs a pass for its maximum and one to round: measured 13.8 of the
  kernel's 31 ns a token and head on the GPU host.) q' then keeps 2^-15 of max|q| · max s rather
  than of max|q s|, far finer than the 16 levels of the codes;
- values: per tile the weights p_t s_tg rounded to one byte (`make_value_factors`; VALUE_PIECES
  2 keeps 16 bits in two, as int8's), from the tile's scales gathered by `make_scales_copy`.

Rounding: q' keeps 2^-15 of max|q| · max s (above); a value weight 1/255 of the tile's largest
p · s of its head, half of that its rounding error. That is coarse next to the int8 path's 16
bits, and on purpose: the codes it multiplies have 16 levels, and the weights' error adds
3e-4–1e-3 to the output (relative, kernel against its float64 twin over the same codes, the
tests' random data; 4e-3–9e-3 where a few tokens carry a tile, as in tests/test_offload.py's
case) where int4 itself is 1e-2–4e-2 from unquantized attention, and SmolLM2's argmax
agreement with bf16 KV stayed 0.97–0.98; the value sums take 11 instructions a token
and kv head with one byte, 19 with two (bench/RESULTS.md, tenth session). The rounding errors e
of a factor multiply codes of 0..15, whose mean ~7.5 would turn them into a bias shared by all
tokens of a block (keys: the log-sum-exp moves); the kernels' float constants subtract 7.5 Σ e,
so what is left is Σ e (code - 7.5).
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import intrinsic

from cpu_attention._simd import (
    IVEC, VEC, _args, _c_array_1d, _c_array_2d, _ir, _madd, _mulhrs, _shuffle, _splat, _vec_ptr,
)
from cpu_attention._simd_int4 import PAIRS, VALUE_PIECES

Q16 = np.float32(32767.0)  # int16 levels of a factor's largest element
TINY = np.float32(1e-30)  # below this a row's int16 scale (max / 32767) would leave float32's normal range
MID = np.float32(7.5)  # the codes' midpoint: rounding errors are centred on it (module doc)


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

    def scale(self, mx, levels=Q16):
        """(s, 1/s): s = mx / levels, or 1 where mx ≤ TINY (a row all but zero: its integer factors
        become 0 rather than scaled by an overflowing 1 / s)."""
        ir, _ = _ir()
        f32 = ir.FloatType()
        s = self.b.select(self.b.fcmp_ordered(">", mx, f32(float(TINY))), self.b.fdiv(mx, f32(float(levels))), f32(1.0))
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


def _value_factors_codegen(W, P):
    levels = WEIGHT_LEVELS[P]

    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        p, vsc, vzr, n, wq, wsc, zsum = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        V = _Vec(builder, W)
        f32 = ir.FloatType()
        i8v = ir.VectorType(ir.IntType(8), W)
        G, PS = builder.extract_value(p.shape, 0), builder.extract_value(p.shape, 1)
        NG, S = builder.extract_value(vsc.shape, 0), builder.extract_value(vsc.shape, 1)
        SW = builder.extract_value(wq.shape, 3)
        piece = builder.mul(builder.mul(G, NG), SW)  # elements between wq's pieces
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
            prow = builder.mul(g, PS)
            builder.store(V.const_i(0), mxa)
            over_tokens(lambda j, keep: builder.store(
                V.imax(builder.load(mxa), V.abs_bits(keep(V.load(p.data, builder.add(prow, j))))), mxa))
            # one scale for the head's weights of every group: its largest weight × the largest scale
            s, inv = V.scale(builder.fmul(V.hmax_f32(builder.load(mxa)), smax), levels)
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
                    xi = builder.fptosi(x, V.i32v)
                    parts = [xi] if P == 1 else [builder.lshr(xi, V.const_i(8)), builder.and_(xi, V.const_i(255))]
                    for k, part in enumerate(parts):
                        dst = builder.add(builder.mul(intp(k), piece), builder.add(wat, j))
                        builder.store(builder.trunc(part, i8v), _vec_ptr(builder, wq.data, dst, i8v), align=1)
                    builder.store(builder.fadd(builder.load(erra), V.fma(x, sv, builder.fneg(prod))), erra)
                    builder.store(V.fma(pv, keep(V.load(vzr.data, builder.add(at, j))), builder.load(za)), za)

                over_tokens(body)
                gr = builder.add(builder.mul(g, NG), r)
                zs = builder.fsub(V.hsum(builder.load(za)), builder.fmul(f32(float(MID)), V.hsum(builder.load(erra))))
                builder.store(s, builder.gep(wsc.data, [gr], inbounds=True))
                builder.store(zs, builder.gep(zsum.data, [gr], inbounds=True))
        return context.get_dummy_value()

    return codegen


WEIGHT_LEVELS = {1: 255.0, 2: 65000.0}  # a weight's largest value in P bytes (2: hi = x >> 8 < 255, as int8's)


def make_value_factors(W: int = VEC, P: int = VALUE_PIECES):
    """An intrinsic value_factors(p, vsc, vzr, n, wq, wsc, zsum): a tile's value factors for every
    head g and group r: w[g, r, j] = round(p[g, j] vsc[r, j] / wsc[g, r]) for j < n (0 up to the
    next multiple of W), stored in P bytes (wq[0] = w for P = 1; wq[0] = w >> 8, wq[1] = w & 255
    for P = 2), wsc[g, r] = max_j p[g, j] · max_{r', j} vsc[r', j] / WEIGHT_LEVELS[P] (one scale
    for all groups of a head), zsum[g, r] = Σ_j p[g, j] vzr[r, j] - 7.5 Σ_j (w wsc - p vsc) (the
    zero points' share, less the rounding bias: module doc).

    p [G, ≥ n rounded up to W] the tile's softmax weights (≥ 0; past n anything); vsc, vzr [D/32,
    same] float32: the tokens' value scales (> 0) and zeros per group (0 for tokens read elsewhere);
    wq [P, G, D/32, same] uint8; wsc, zsum [G, D/32] float32; all C-contiguous. No bounds checks."""

    @intrinsic
    def value_factors(typingctx, p, vsc, vzr, n, wq, wsc, zsum):
        if not (_c_array_2d(p, types.float32) and _c_array_2d(vsc, types.float32) and _c_array_2d(vzr, types.float32)
                and isinstance(n, types.Integer) and isinstance(wq, types.Array) and wq.dtype == types.uint8
                and wq.ndim == 4 and wq.layout == "C" and _c_array_2d(wsc, types.float32)
                and _c_array_2d(zsum, types.float32)):
            return None
        return types.void(p, vsc, vzr, n, wq, wsc, zsum), _value_factors_codegen(W, P)

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
