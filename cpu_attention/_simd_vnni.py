"""SIMD micro-kernels for int8 decode over the pool's VNNI byte order (LLVM vector IR).

The int8 pool stores a block's keys as [D/4, BS, 4] and its values as [BS/4, D, 4]
(`layout.py`): four consecutive bytes are four channels of one key, or one channel of four
consecutive tokens' values. x86's vpdpbusd (AVX-512 VNNI) multiplies four unsigned bytes by
four signed bytes and adds the four products to a 32-bit lane, so

- scores (`make_scores`): one load holds W tokens × 4 channels of keys, one broadcast 4
  channels of q, and a vpdpbusd adds those 4 channels' products to each of the W tokens'
  scores: no horizontal sums at all, W tokens' scores come out in one register;
- values (`make_values`): one load holds W channels × 4 tokens of values, one broadcast the
  4 tokens' weights, and a vpdpbusd adds the 4 weighted tokens to W channels of the output.

Both are exact integer sums. vpdpbusd takes one unsigned and one signed operand: keys are
read as unsigned by flipping their sign bit (k + 128, one xor a load), the shift paid back by
starting each score at -128 Σ q; weights are >= 0 anyway. q is kept to 16 bits as two
byte-sized pieces (x = 256 hi + lo), one vpdpbusd per piece, combined once per W tokens in
float32; the weights are one unsigned byte each (`decode_int8._softmax_split`: 8 bits against
the tile's largest weight), one vpdpbusd.

The IR is generic: vpdpbusd is the x86 intrinsic where the CPU Numba compiles for has AVX-512
VNNI and 16-lane vectors, pmaddubsw + pmaddwd where it has AVX2 or AVX-512BW (`_dpbusd`), plain IR
(widen, multiply, add) elsewhere, correct on any target.

The score kernel also prefetches a later block's keys and values, into L2 (prefetcht1), not L1:
an L1 prefetch holds one of the core's few L1 miss buffers until its line comes, which caps the
lines in flight; into L2, one thread read int8 KV out of DRAM 21% faster here (Zen 4: 27.5 vs
34.8 ns per token and head; the same in cache; bench/RESULTS.md). Numba's cache does not see an
edit of this file: the kernels built from it (`decode_int8`) keep their cached code until their
own file changes or the cache is cleared.
"""
from __future__ import annotations

from numba import types
from numba.extending import intrinsic

from cpu_attention._simd import IVEC, _FEATURES, _args, _ir, _splat

W_LANES = IVEC  # int32 lanes a vector: tokens a score chunk, channels a value chunk
# vpdpbusd where the target has it at this width, else None (plain IR)
DPBUSD = "llvm.x86.avx512.vpdpbusd.512" if "avx512vnni" in _FEATURES and W_LANES == 16 else None
# without VNNI: pmaddubsw (pairs of unsigned × signed bytes into int16, saturating) and pmaddwd
# (pairs of int16 into int32), by int32 lanes a vector, where the target has them (`_dpbusd`)
MADDUBS = {lanes: names for lanes, names, feature in (
    (8, ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"), "avx2"),
    (16, ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512"), "avx512bw")) if feature in _FEATURES}
VALUE_CHUNKS = 2  # C: output vectors a head a value pass (4 heads × C accumulators + C + 4 registers)


def _dpbusd(builder, acc, a, b, name, small_b=False):
    """acc + per lane the sum of 4 products of a's unsigned bytes and b's signed bytes (a, b as
    <W x i32> holding 4 bytes a lane): x86 vpdpbusd; without it (name None), where the target has
    pmaddubsw (`MADDUBS`: AVX2, AVX-512BW), a's bytes split into their low 7 bits and their top bit
    so that no int16 pair sum saturates (127·128·2 < 2^15), each through pmaddubsw and pmaddwd
    (8 instructions; the plain IR below measured ~6x slower than that on AVX2); else plain IR.
    small_b: b's bytes are within ±63 (int4 codes), so a whole byte of a goes through one pmaddubsw
    (255·63·2 < 2^15: no pair saturates)."""
    ir, cgutils = _ir()
    if name is not None:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(acc.type, [acc.type] * 3), name)
        return builder.call(fn, [acc, a, b])
    W = acc.type.count
    if W in MADDUBS:
        i8v, i16v = ir.VectorType(ir.IntType(8), 4 * W), ir.VectorType(ir.IntType(16), 2 * W)
        ubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16v, [i8v, i8v]), MADDUBS[W][0])
        wd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(acc.type, [i16v, i16v]), MADDUBS[W][1])
        splat = lambda x, ty, n: ir.Constant(ty, [x] * n)  # noqa: E731
        bb = builder.bitcast(b, i8v)
        if small_b:
            parts = ((a, 1),)
        else:
            low = builder.and_(a, splat(0x7F7F7F7F, acc.type, W))
            top = builder.and_(builder.lshr(a, splat(7, acc.type, W)), splat(0x01010101, acc.type, W))
            parts = ((low, 1), (top, 128))
        for part, weight in parts:
            pairs = builder.call(ubs, [builder.bitcast(part, i8v), bb])
            acc = builder.add(acc, builder.call(wd, [pairs, splat(weight, i16v, 2 * W)]))
        return acc
    i8v, i32w = ir.VectorType(ir.IntType(8), 4 * W), ir.VectorType(ir.IntType(32), 4 * W)
    p = builder.mul(builder.zext(builder.bitcast(a, i8v), i32w), builder.sext(builder.bitcast(b, i8v), i32w))
    for _ in range(2):  # sum adjacent pairs twice: 4W products → W sums of 4
        n = p.type.count // 2
        ev = ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(0, 2 * n, 2)))
        od = ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(1, 2 * n, 2)))
        p = builder.add(builder.shuffle_vector(p, p, ev), builder.shuffle_vector(p, p, od))
    return builder.add(acc, p)


def _ptr(builder, base, byte_offset, ty):
    """(ty *) ((i8 *) base + byte_offset)."""
    ir, _ = _ir()
    i8p = builder.bitcast(base, ir.IntType(8).as_pointer())
    return builder.bitcast(builder.gep(i8p, [byte_offset], inbounds=True), ty.as_pointer())


def _at(builder, arr, index):
    """arr.flat[index] of a C-contiguous Numba array struct (no bounds check)."""
    return builder.load(builder.gep(arr.data, [index], inbounds=True))


def _piece_splats(builder, arr, rows, at, W):
    """For each head i and piece p, the 4 bytes at element rows[i][p] + at of arr (int8 / uint8
    pieces, `_split_q`'s or `_softmax_split`'s) as one 32-bit lane splat over W lanes."""
    ir, _ = _ir()
    i32 = ir.IntType(32)
    return [[_splat(builder, builder.load(_ptr(builder, arr.data, builder.add(r, at), i32), align=1), W) for r in row]
            for row in rows]


def _fold_pieces(builder, hi, lo):
    """256 hi + lo of two <W x i32> integer sums, as float32 (one rounding)."""
    ir, cgutils = _ir()
    f32v = ir.VectorType(ir.FloatType(), hi.type.count)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32v, [f32v] * 3),
                                         f"llvm.fmuladd.v{hi.type.count}f32")
    return builder.call(fma, [builder.sitofp(hi, f32v), ir.Constant(f32v, [256.0] * hi.type.count),
                              builder.sitofp(lo, f32v)])


def _scores_codegen(ng, W, name):
    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, g = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        G, D = builder.extract_value(qp.shape, 1), builder.extract_value(qp.shape, 2)
        S = builder.extract_value(s.shape, 1)
        i32, i32v, f32v = ir.IntType(32), ir.VectorType(ir.IntType(32), W), ir.VectorType(ir.FloatType(), W)
        flip = ir.Constant(i32v, [0x80808080 - (1 << 32)] * W)
        heads = [builder.add(g, intp(i)) for i in range(ng)]
        # q pieces: flat index of (piece p, head i, channel 0)
        qrow = [[builder.mul(builder.add(builder.mul(intp(p), G), heads[i]), D) for p in range(2)] for i in range(ng)]
        row_bytes = builder.mul(BS, intp(4))  # bytes between a chunk's channel groups
        i8p = ir.IntType(8).as_pointer()
        pref = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                              "llvm.prefetch")
        regs = [[[cgutils.alloca_once(builder, i32v) for _ in range(2)] for _ in range(2)] for _ in range(ng)]

        def chunks(c, T):  # s[g+i, (c+t) W ...] for t < T
            kb = [_at(builder, kbase, builder.add(c, intp(t))) for t in range(T)]
            pb = [_at(builder, pf, builder.add(c, intp(t))) for t in range(T)]
            for i in range(ng):
                for p in range(2):
                    start = _splat(builder, _at(builder, qc, builder.add(builder.mul(intp(p), G), heads[i])), W)
                    for t in range(T):
                        builder.store(start, regs[i][p][t])
            with cgutils.for_range_slice(builder, intp(0), builder.sdiv(D, intp(4)), intp(1), intp) as (dg, _):
                off = builder.mul(dg, row_bytes)
                xs = []
                for t in range(T):
                    x = builder.load(_ptr(builder, k.data, builder.add(kb[t], off), i32v), align=1)
                    xs.append(builder.xor(x, flip))
                    at = builder.add(pb[t], builder.mul(dg, intp(4 * W)))
                    for arr in (k, v):
                        builder.call(pref, [_ptr(builder, arr.data, at, ir.IntType(8)), i32(0), i32(2), i32(1)])  # to L2
                qv = _piece_splats(builder, qp, qrow, builder.mul(dg, intp(4)), W)
                for i in range(ng):
                    for p in range(2):
                        for t in range(T):
                            builder.store(_dpbusd(builder, builder.load(regs[i][p][t]), xs[t], qv[i][p], name),
                                          regs[i][p][t])
            for t in range(T):
                ksc = builder.load(_ptr(builder, ks.data, builder.mul(_at(builder, ksbase, builder.add(c, intp(t))),
                                                                      intp(4)), f32v), align=4)
                col = builder.mul(builder.add(c, intp(t)), intp(W))
                for i in range(ng):
                    sc = builder.fmul(_fold_pieces(builder, builder.load(regs[i][0][t]), builder.load(regs[i][1][t])),
                                      builder.fmul(ksc, _splat(builder, _at(builder, qsc, heads[i]), W)))
                    dst = builder.gep(s.data, [builder.add(builder.mul(heads[i], S), col)], inbounds=True)
                    builder.store(sc, builder.bitcast(dst, f32v.as_pointer()), align=4)

        pairs = builder.sdiv(nch, intp(2))
        with cgutils.for_range_slice(builder, intp(0), builder.mul(pairs, intp(2)), intp(2), intp) as (c, _):
            chunks(c, 2)
        with builder.if_then(builder.icmp_signed("!=", builder.srem(nch, intp(2)), intp(0))):
            chunks(builder.sub(nch, intp(1)), 1)
        return context.get_dummy_value()

    return codegen


def make_scores(ng: int, W: int = W_LANES, name: str | None = DPBUSD):
    """An intrinsic scores(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, g): for heads
    i < ng and chunks c < nch of W tokens, s[g+i, cW + t] = (256 Σ hi·k + Σ lo·k) · qsc[g+i] ·
    ks.flat[ksbase[c] + t], k the chunk's keys.

    qp int8 [2, G, D]: q's pieces (hi, lo) in channel order; qc int32 [2, G]: each piece's
    -128 Σ_d piece (pays back the keys' flipped sign bit); qsc float32 [G]. k: an int8 array
    in the VNNI key order (any shape, C-contiguous), kbase [nch] int64 the byte offset of each
    chunk's first 4 bytes (channel group 0, its first token); channel group j of it is 4 BS
    bytes further. ks: the token scales (float32, any shape), ksbase [nch] the element offset
    of each chunk's first token's. pf [nch]: byte offsets in k and in v (the values, int8, any
    shape) of D·W bytes each to prefetch while each chunk is scored (a later block's).
    s [G, S] float32, S >= nch W. Chunks run past a block's last token read codes and scales
    of the same block (their scores are garbage, the caller ignores them). No bounds checks."""

    @intrinsic
    def scores(typingctx, qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, g):
        if not (_c(qp, types.int8, 3) and _c(qc, types.int32, 2) and _c(qsc, types.float32, 1)
                and _c(k, types.int8) and _c(v, types.int8) and _c(kbase, types.int64, 1) and _c(ks, types.float32)
                and _c(ksbase, types.int64, 1) and _c(pf, types.int64, 1) and _c(s, types.float32, 2)):
            return None
        return types.void(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, g), _scores_codegen(ng, W, name)

    return scores


def _values_codegen(ng, C, W, name):
    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        wp, wsc, v, gbase, ngr, acc, g = _args(context, builder, sig, args)
        intp = context.get_value_type(types.intp)
        NP = builder.extract_value(wp.shape, 1)
        D = builder.extract_value(acc.shape, 1)
        i32v, f32v = ir.VectorType(ir.IntType(32), W), ir.VectorType(ir.FloatType(), W)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32v, [f32v] * 3), f"llvm.fmuladd.v{W}f32")
        heads = [builder.add(g, intp(i)) for i in range(ng)]
        wrow = [[builder.mul(heads[i], NP)] for i in range(ng)]
        regs = [[cgutils.alloca_once(builder, i32v) for _ in range(C)] for _ in range(ng)]
        zero = ir.Constant(i32v, None)

        def one_pass(c0, cc):  # acc[g+i, c0 : c0 + cc W] += wsc[g+i] Σ_u w[g+i, 4u:4u+4] · v[group u, same]
            for i in range(ng):
                for c in range(cc):
                    builder.store(zero, regs[i][c])
            with cgutils.for_range_slice(builder, intp(0), ngr, intp(1), intp) as (u, _):
                base = builder.add(_at(builder, gbase, u), builder.mul(c0, intp(4)))
                xs = [builder.load(_ptr(builder, v.data, builder.add(base, intp(4 * W * c)), i32v), align=1)
                      for c in range(cc)]
                wv = _piece_splats(builder, wp, wrow, builder.mul(u, intp(4)), W)
                for i in range(ng):
                    for c in range(cc):
                        builder.store(_dpbusd(builder, builder.load(regs[i][c]), wv[i][0], xs[c], name), regs[i][c])
            for i in range(ng):
                sc = _splat(builder, _at(builder, wsc, heads[i]), W)
                for c in range(cc):
                    at = builder.gep(acc.data, [builder.add(builder.mul(heads[i], D), builder.add(c0, intp(c * W)))],
                                     inbounds=True)
                    ptr = builder.bitcast(at, f32v.as_pointer())
                    tot = builder.sitofp(builder.load(regs[i][c]), f32v)
                    builder.store(builder.call(fma, [sc, tot, builder.load(ptr, align=4)]), ptr, align=4)

        full = builder.mul(builder.sdiv(D, intp(C * W)), intp(C * W))
        with cgutils.for_range_slice(builder, intp(0), full, intp(C * W), intp) as (c0, _):
            one_pass(c0, C)
        with cgutils.for_range_slice(builder, full, D, intp(W), intp) as (c0, _):
            one_pass(c0, 1)
        return context.get_dummy_value()

    return codegen


def make_values(ng: int, C: int = VALUE_CHUNKS, W: int = W_LANES, name: str | None = DPBUSD):
    """An intrinsic values(wp, wsc, v, gbase, ngr, acc, g): for heads i < ng,
    acc[g+i] += wsc[g+i] · Σ_{u<ngr} Σ_{j<4} wp[g+i, 4u+j] · v[group u][:, j], the sums exact in
    int32, C vectors of W channels a head at a time in registers.

    wp uint8 [G, NP]: the weights, token 4u+j of the tile at column 4u+j; wsc float32 [G]. v:
    an int8 array in the VNNI value order (any shape, C-contiguous), gbase [ngr] int64 the byte
    offset of each group of 4 tokens ([D, 4] bytes: channel d's 4 tokens at 4d). acc [G, D]
    float32, D % W == 0. No bounds checks."""

    @intrinsic
    def values(typingctx, wp, wsc, v, gbase, ngr, acc, g):
        if not (_c(wp, types.uint8, 2) and _c(wsc, types.float32, 1) and _c(v, types.int8)
                and _c(gbase, types.int64, 1) and _c(acc, types.float32, 2)):
            return None
        return types.void(wp, wsc, v, gbase, ngr, acc, g), _values_codegen(ng, C, W, name)

    return values


def _c(t, dtype, ndim=None) -> bool:
    return (isinstance(t, types.Array) and t.dtype == dtype and t.layout == "C"
            and (ndim is None or t.ndim == ndim))
