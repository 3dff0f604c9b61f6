"""SIMD micro-kernels for int4 decode: the int16 key factors the score kernel takes (LLVM vector IR).

`_simd_int4`'s dot products multiply the codes by integer factors in which the scales are folded.
This module makes the keys' (the values' weights are `_simd_int4_weights`'s, on its helpers here):
q' ≈ q · s / qsc per block and head, in one instruction a vector: q is rounded to int16 once a
step (q16, `decode_int4._query16`), the block's scales once for all heads (u16 = s / b,
`make_block_scales`), and q' = q16 · u16 / 2^15 by pmulhrsw (`make_block_query`). (Rounding q · s
itself, per block and head, needs a pass for its maximum and one to round: measured 13.8 of the
kernel's 31 ns a token and head on the GPU host.) q' then keeps 2^-15 of max|q| · max s rather
than of max|q s|, far finer than the 16 levels of the codes.

Rounding errors e of a factor multiply codes of 0..15, whose mean ~7.5 would turn them into a
bias shared by all tokens of a block (keys: the log-sum-exp moves); the kernels' float constants
subtract 7.5 Σ e, so what is left is Σ e (code - 7.5).
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import intrinsic

from cpu_attention._simd import (
    IVEC, VEC, _args, _c_array_1d, _c_array_2d, _ir, _madd, _mulhrs, _shuffle, _splat, _vec_ptr,
)
from cpu_attention._simd_int4 import PAIRS

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
