"""SIMD micro-kernels for int4 decode: the value weights the value sums take (LLVM vector IR).

Per tile, the weights p_t s_tg (softmax weight times the token's value scale of group g) rounded
to one byte (`make_value_factors`; VALUE_PIECES 2 keeps 16 bits in two, as int8's), from the
tile's scales gathered by `make_scales_copy`, and the zero points' share per group; the helpers
and the bias rule (subtract 7.5 Σ e) are `_simd_int4_factors`'.

Rounding: a weight keeps 1/255 of the tile's largest p · s of its head, half of that its
rounding error. That is coarse next to the int8 path's 16 bits, and on purpose: the codes it
multiplies have 16 levels, and the weights' error adds 3e-4–1e-3 to the output (relative,
kernel against its float64 twin over the same codes, the tests' random data; 4e-3–9e-3 where a
few tokens carry a tile, as in tests/test_offload.py's case) where int4 itself is 1e-2–4e-2 from
unquantized attention, and SmolLM2's argmax agreement with bf16 KV stayed 0.97–0.98; the value
sums take 11 instructions a token and kv head with one byte, 19 with two.
"""
from __future__ import annotations

from numba import types
from numba.extending import intrinsic

from cpu_attention._simd import VEC, _args, _c_array_2d, _ir, _shuffle, _splat, _vec_ptr
from cpu_attention._simd_int4 import VALUE_PIECES
from cpu_attention._simd_int4_factors import MID, _Vec


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
