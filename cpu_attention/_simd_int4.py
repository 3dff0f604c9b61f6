"""SIMD micro-kernels for int4 decode: integer dot products over 4-bit codes (LLVM vector IR).

int4 rows (`int4.py`: byte 16r + i of a row holds code 32r + i in its low nibble and 32r + 16 + i
in its high one) are never widened to floats. The two hot loops widen the codes to 16-bit lanes
in registers and multiply them with int16 factors in which the scales are already folded,
summing in int32 (x86 pmaddwd, which LLVM fuses with the add into vpdpwssd where VNNI is there):

- keys are per channel over a block: score = Σ_d q_d (code_d s_d + z_d) = Σ_d (q_d s_d) code_d +
  q · z, so each token costs one integer dot product of an int16 q' ≈ q · s / qsc with its codes
  (`make_dots_int4`). q' is made per block and head in one instruction a vector: q is rounded to
  int16 once a step (q16, `decode_int4._query16`), the block's scales once for all heads (u16 =
  s / b, `make_block_scales`), and q' = q16 · u16 / 2^15 by pmulhrsw (`make_block_query`). (Rounding
  q · s itself, per block and head, needs a pass for its maximum and one to round: measured 13.8 of
  the kernel's 31 ns a token and head on the GPU host.) q' then keeps 2^-15 of max|q| · max s
  rather than of max|q s|, far finer than the 16 levels of the codes;
- values are per token and group of 32 channels: Σ_t p_t (code_t s_tg + z_tg) = Σ_t (p_t s_tg)
  code_t + Σ_t p_t z_tg, so per tile the weights p_t s_tg are rounded to int16 (`make_value_factors`,
  from the tile's scales gathered by `make_scales_copy`) and the codes of two tokens are summed
  by one pmaddwd per pair of lanes (`make_accumulate_int4`).

Rounding: the weights keep 2^-16 of their largest element (as the int8 path's q and weights), q'
2^-15 of max|q| · max s (above). The rounding errors e of a factor multiply codes of 0..15, whose mean ~7.5 would turn
them into a bias shared by all tokens of a block (keys: the log-sum-exp moves); the kernels' float
constants subtract 7.5 Σ e, so what is left is Σ e (code - 7.5).

Key code layout: a row's bytes are read in chunks of E = 2·IW (then IW at the end, where D/2 is not
a multiple of 2·IW), each widened to E int16 lanes and split into its low nibbles and its high
ones. q'16 is stored in that order (`code_order`): positions 2c .. 2c+E hold the channels of
the low nibbles of bytes c .. c+E, positions 2c+E .. 2c+2E those of their high nibbles. With
IW = 8 (AVX2) that is the channel order itself; with 16 (AVX-512), runs of 16 channels swapped.

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
    ACC_CHUNKS, DOT_TOKENS, IVEC, VEC, _args, _c_array_2d, _head_sums, _ir, _lane_sums, _madd, _mulhrs, _shuffle,
    _splat, _vec_ptr,
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


def _dots_int4_codegen(ng, T, IW):
    """Codegen of `dots_int4`: see `make_dots_int4`."""

    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        q, g, k, r0, r1, s, sj, qsc, qc = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        H = builder.extract_value(k.shape, 1)  # bytes a row: D/2
        D = builder.mul(H, intp(2))
        S = builder.extract_value(s.shape, 1)
        last = builder.sub(r1, intp(1))
        rows = []
        for t in range(T):  # rows past the end repeat the last one (their stores are never read)
            r = builder.add(r0, intp(t))
            rows.append(builder.mul(builder.select(builder.icmp_signed("<", r, r1), r, last), H))
        qrows = [builder.mul(builder.add(g, intp(i)), D) for i in range(ng)]
        i32v = ir.VectorType(ir.IntType(32), IW)
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(i32v, None)) for _ in range(T)] for _ in range(ng)]

        def chunk(c, E):  # bytes c .. c+E of every row: E low-nibble codes, then E high ones
            i8v, i16v = ir.VectorType(ir.IntType(8), E), ir.VectorType(ir.IntType(16), E)
            codes = []
            for r in rows:
                x = builder.zext(builder.load(_vec_ptr(builder, k.data, builder.add(r, c), i8v), align=1), i16v)
                lo = builder.and_(x, ir.Constant(i16v, [15] * E))
                codes.append((lo, builder.lshr(x, ir.Constant(i16v, [4] * E))))
            for i in range(ng):
                at = builder.add(qrows[i], builder.mul(c, intp(2)))
                qlo = builder.load(_vec_ptr(builder, q.data, at, i16v), align=2)
                qhi = builder.load(_vec_ptr(builder, q.data, builder.add(at, intp(E)), i16v), align=2)
                for t in range(T):
                    a = builder.load(accs[i][t])
                    for qv, x in ((qlo, codes[t][0]), (qhi, codes[t][1])):
                        if E // 2 < IW:  # a last half chunk: widened with zeros, upper lanes 0
                            qv, x = (_shuffle(builder, y, ir.Constant(y.type, None), list(range(2 * IW)))
                                     for y in (qv, x))
                        a = _dot_add(builder, a, qv, x)
                    builder.store(a, accs[i][t])

        full = builder.mul(builder.sdiv(H, intp(2 * IW)), intp(2 * IW))
        with cgutils.for_range_slice(builder, intp(0), full, intp(2 * IW), intp) as (c, _):
            chunk(c, 2 * IW)
        with cgutils.for_range_slice(builder, full, H, intp(IW), intp) as (c, _):
            chunk(c, IW)
        sums = _lane_sums(builder, [builder.load(a) for row in accs for a in row], builder.add)
        f32T = ir.VectorType(ir.FloatType(), T)
        fma = _fma(builder, T)
        for i in range(ng):
            part = builder.sitofp(_head_sums(builder, sums, i, T), f32T)
            gi = builder.add(g, intp(i))
            sc = _splat(builder, builder.load(builder.gep(qsc.data, [gi], inbounds=True)), T)
            c0 = _splat(builder, builder.load(builder.gep(qc.data, [gi], inbounds=True)), T)
            at = builder.add(builder.mul(gi, S), sj)
            builder.store(builder.call(fma, [sc, part, c0]), _vec_ptr(builder, s.data, at, f32T), align=4)
        return context.get_dummy_value()

    return codegen


def make_dots_int4(ng: int, T: int = DOT_TOKENS, IW: int = IVEC):
    """An intrinsic dots_int4(q, g, k, r0, r1, s, sj, qsc, qc): for heads i < ng and tokens t < T,
    s[g+i, sj+t] = qsc[g+i] · Σ_p q[g+i, p] · code(k[min(r0+t, r1-1)], p) + qc[g+i].

    q [G, D] int16 in the code layout of IW lanes (module doc, `code_order`); k [R, D/2] uint8
    packed rows (`int4.py`: a block's rows of one head, or a pool's rows reshaped); s [G, S]
    float32; qsc, qc [G] float32; all C-contiguous; D % 32 == 0, IW ≤ 16.
    The integer sums are exact (|sum| < 2^31 for D ≤ 8192). Rows past r1 repeat row r1-1, so a
    caller may step r0 by T to r1 and give s at least T-1 spare columns. No bounds checks."""

    @intrinsic
    def dots_int4(typingctx, q, g, k, r0, r1, s, sj, qsc, qc):
        if not (_c_array_2d(q, types.int16) and _c_array_2d(k, types.uint8) and _c_array_2d(s, types.float32)
                and _c_array_1d(qsc, types.float32) and _c_array_1d(qc, types.float32)):
            return None
        return types.void(q, g, k, r0, r1, s, sj, qsc, qc), _dots_int4_codegen(ng, T, IW)

    return dots_int4


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
def code_order(D: int, IW: int = IVEC) -> np.ndarray:
    """The channel at each position of the code layout of IW lanes (module doc), [D] int64: the
    plain twin of `_code_vectors`, for tests, for reading a layout, and for the kernel's q16."""
    H, out = D // 2, np.empty(D, np.int64)
    full = H // (2 * IW) * (2 * IW)
    for c in range(0, H, 2 * IW):
        E = 2 * IW if c < full else IW
        for b in range(c, c + E):
            for h in range(2):
                out[c + b + h * E] = 32 * (b // 16) + 16 * h + b % 16
    return out


def _code_vectors(builder, intp, H, IW, W, run, store):
    """A vector in the code layout of IW lanes for rows of H bytes, written whole: run(ch) gives
    the W lanes of channels ch .. ch+W (W ≤ 8 or W = IW = 16, so a run never leaves a half
    group), store(pos, x) gets them joined into the vectors of 2·IW lanes at positions pos ..
    (`code_order`: a chunk of E = 2·IW bytes at c is positions 2c .. 2c+E, its low nibbles'
    channels, and 2c+E .. 2c+2E, its high ones'; a last chunk of IW bytes is one vector)."""
    from numba.core import cgutils

    def chunk(c, E):
        seg = min(E, 16)
        parts = {0: [], 1: []}  # per nibble half: its runs, in position order
        for xr in range(0, E, seg):
            x0 = builder.add(c, intp(xr))
            ch0 = builder.add(builder.shl(builder.ashr(x0, intp(4)), intp(5)), builder.and_(x0, intp(15)))
            for h in range(2):
                for i in range(0, seg, W):
                    parts[h].append(run(builder.add(ch0, intp(16 * h + i))))
        if E == 2 * IW:  # positions 2c .. 2c+E: the low nibbles' runs; 2c+E .. 2c+2E: the high ones'
            store(builder.add(c, c), _concat(builder, parts[0]))
            store(builder.add(builder.add(c, c), intp(E)), _concat(builder, parts[1]))
        else:  # E = IW: both halves in one vector
            store(builder.add(c, c), _concat(builder, parts[0] + parts[1]))

    full = builder.mul(builder.sdiv(H, intp(2 * IW)), intp(2 * IW))
    with cgutils.for_range_slice(builder, intp(0), full, intp(2 * IW), intp) as (c, _):
        chunk(c, 2 * IW)
    with cgutils.for_range_slice(builder, full, H, intp(IW), intp) as (c, _):
        chunk(c, IW)


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

        def run(ch):  # round(s / b) of channels ch .. ch+W
            return builder.fptosi(V.rint(builder.fmul(V.load_bf16(ks.data, builder.add(base, ch)), invv)), V.i16v)

        def store(pos, x):
            builder.store(x, _vec_ptr(builder, u16.data, pos, x.type), align=2)

        # stored as whole vectors of 2·IW lanes, as `make_block_query` loads them (a load that
        # spans several narrower stores still in flight is not forwarded from them: it waits)
        _code_vectors(builder, intp, builder.sdiv(D, intp(2)), IW, W, run, store)
        builder.store(b, builder.gep(bsc.data, [intp(0)], inbounds=True))
        return context.get_dummy_value()

    return codegen


def make_block_scales(W: int = VEC, IW: int = IVEC):
    """An intrinsic block_scales(ks, kz, row, u16, zs, bsc): what one block's key scales s =
    ks[row] and zeros z = kz[row] give every head's q' (`make_block_query`): bsc[0] = b = max s /
    32767 (1 where max s ≤ TINY), u16 = round(s / b) in the code layout of IW lanes (`code_order`),
    zs = z + 7.5 s (channel order: the zero points' share of a score plus the rounding bias's
    counterweight, module doc).

    ks, kz [R, D] uint16 (bf16 bits, s ≥ 0); u16 [D] int16; zs [D], bsc [≥ 1] float32; all
    C-contiguous; D % 32 == 0, W ≤ 8 or W = IW. No bounds checks."""

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

    q16 [G, D] int16 (q rounded once a step: qn ≈ qa · q16, in the code layout of IW lanes); qa
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
