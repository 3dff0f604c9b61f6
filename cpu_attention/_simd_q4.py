"""SIMD micro-kernel for the host experts' int4 weights (`experts_kernels`): one weight row's dot
product with an int8-quantized x, in integer vpdpbusd (LLVM vector IR, a Numba intrinsic).

x is quantized once a call, per token and group of 64 (a float32 scale max |x| / 127, as llama.cpp's
Q8 blocks), and laid out to match the codes' bytes: byte j of a group's 32 holds weight j (low
nibble) and weight 32 + j (high nibble), so `xlo[32 g + j] = xq[64 g + j]` and `xhi[32 g + j] =
xq[64 g + 32 + j]`. A vector of W int32 lanes takes 4W bytes of codes: their low nibbles against
xlo and their high nibbles against xhi, two vpdpbusd (unsigned codes 0..15 × signed x) into the
lanes, 8 lanes a group; the codes' offset of 8 enters as −8 Σ xq of the group in the group's first
lane (`corr`); then the lanes go to float32 and are scaled by their group's weight scale times x's
scale, summed over the row in float32 lanes, once horizontally at its end. Both halves of a token
live in one int8 row: xlo then xhi. Exact integer sums within
a group. Where the CPU has no VNNI, `_simd_vnni._dpbusd` does the same with pmaddubsw + pmaddwd
(no pair saturates: codes are below 16).
"""
from __future__ import annotations

from numba import types
from numba.extending import intrinsic

from cpu_attention._simd import IVEC, _args, _ir, _lane_sums
from cpu_attention._simd_vnni import DPBUSD, _dpbusd, _ptr

W_LANES = IVEC  # int32 lanes a vector
GROUP_LANES = 8  # lanes of a group: 32 bytes of codes
SUPPORTED = W_LANES >= GROUP_LANES  # else the float kernel (`experts_kernels._dot`)


def _codegen(W, name):
    gpv = W // GROUP_LANES  # groups a vector

    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        q, qo, x, lo_o, hi_o, corr, co, xsc, so, wsc, wo, nvec = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        i32v, f32v = ir.VectorType(ir.IntType(32), W), ir.VectorType(ir.FloatType(), W)
        f32g = ir.VectorType(ir.FloatType(), gpv)
        nib = ir.Constant(i32v, [0x0F0F0F0F] * W)
        four = ir.Constant(i32v, [4] * W)
        spread = ir.Constant(ir.VectorType(ir.IntType(32), W), [lane // GROUP_LANES for lane in range(W)])
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32v, [f32v] * 3), f"llvm.fmuladd.v{W}f32")
        acc = cgutils.alloca_once_value(builder, ir.Constant(f32v, None))
        with cgutils.for_range(builder, nvec, intp=intp) as loop:
            c = loop.index
            byte = builder.mul(c, intp(4 * W))
            v = builder.load(_ptr(builder, q.data, builder.add(qo, byte), i32v), align=1)
            lo = builder.and_(v, nib)
            hi = builder.and_(builder.lshr(v, four), nib)
            a = builder.load(_ptr(builder, x.data, builder.add(lo_o, byte), i32v), align=1)
            b = builder.load(_ptr(builder, x.data, builder.add(hi_o, byte), i32v), align=1)
            s = builder.load(_ptr(builder, corr.data, builder.mul(builder.add(co, builder.mul(c, intp(W))), intp(4)), i32v),
                             align=4)
            s = _dpbusd(builder, s, lo, a, name, small_b=True)
            s = _dpbusd(builder, s, hi, b, name, small_b=True)
            g = builder.mul(c, intp(gpv))
            ws = builder.load(_ptr(builder, wsc.data, builder.mul(builder.add(wo, g), intp(4)), f32g), align=4)
            xs = builder.load(_ptr(builder, xsc.data, builder.mul(builder.add(so, g), intp(4)), f32g), align=4)
            sc = builder.fmul(ws, xs)
            scale = builder.shuffle_vector(sc, sc, spread)
            builder.store(builder.call(fma, [builder.sitofp(s, f32v), scale, builder.load(acc)]), acc)
        total = _lane_sums(builder, [builder.load(acc)], builder.fadd)[0]
        return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))

    return codegen


def make_row_dot(W: int = W_LANES, name: str | None = DPBUSD):
    """An intrinsic row_dot(q, qo, x, lo_o, hi_o, corr, co, xsc, so, wsc, wo, nvec) → float32: the
    dot product of the int4 row whose codes start at q.flat[qo] (nvec·4W bytes, scales at
    wsc.flat[wo]) with the token whose quantized halves start at x.flat[lo_o] and x.flat[hi_o]
    (corrections at corr.flat[co], 8 int32 a group; scales at xsc.flat[so]). C-contiguous arrays:
    q uint8, x int8, corr int32, xsc and wsc float32. No bounds checks."""

    @intrinsic
    def row_dot(typingctx, q, qo, x, lo_o, hi_o, corr, co, xsc, so, wsc, wo, nvec):
        arrays = ((q, types.uint8), (x, types.int8), (corr, types.int32), (xsc, types.float32), (wsc, types.float32))
        if not all(isinstance(a, types.Array) and a.dtype == dt and a.layout == "C" for a, dt in arrays):
            return None
        return types.float32(q, qo, x, lo_o, hi_o, corr, co, xsc, so, wsc, wo, nvec), _codegen(W, name)

    return row_dot
