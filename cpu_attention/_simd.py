"""SIMD micro-kernels for the bf16 / int8 decode paths, written as LLVM vector IR (Numba intrinsics).

The decode kernels' two hot loops as explicit vectors. LLVM's loop vectorizer, given the plain
loops, pays per 16-token block: loop setup and runtime alias checks, a full horizontal sum per
(token, head) dot product, and a load and store of the accumulator per token pair. Here:

- `make_dots`: a pass scores T tokens × up to 4 heads with all T·ng partial sums in registers
  over the head dim, reduced together by a butterfly of shuffles (~2 shuffles and 1 add per
  dot product instead of ~8 instructions each).
- `make_accumulate`: up to 4 heads × C vectors of the output accumulator held in registers
  over a block's tokens, one broadcast weight per head and token.

bf16 rows are widened two vectors a load (even elements by a shift, odd ones by a mask), so q
and the accumulator of bf16 values live in a "pair layout", a permutation within chunks of the
head dim undone once per work item (`from_pair_layout`). The int8 kernels' micro-kernels
(`_simd_vnni`) and int4's (`_simd_int4`, `_simd_int4_factors`, `_simd_int4_weights`) build on
the helpers here; pmaddwd (`_madd`) is int4's.

Shapes are chosen for the CPU Numba compiles for (its feature string is part of Numba's cache
key): VEC float32 lanes a register (16 with AVX-512, 8 with AVX/AVX2, 4 otherwise), T tokens a
score pass and C accumulator vectors a value pass so that the registers in use fit (32 zmm or
16 ymm registers). The IR is generic except pmaddwd, which is the x86 intrinsic where the host
has it and plain IR otherwise: the same code is correct on any CPU LLVM targets.
"""
from __future__ import annotations

import os

import numba
from numba import types
from numba.extending import intrinsic


def _compile_features() -> frozenset[str]:
    """The instruction sets Numba compiles for: the user's NUMBA_CPU_FEATURES, else the host's. A
    property of the machine, not a setting: `_numba.configure` only tunes the vector preference
    of the same features, so VEC below is the same whether it has run or not."""
    from numba.core.codegen import get_host_cpu_features

    feats = os.environ.get("NUMBA_CPU_FEATURES") or get_host_cpu_features()
    return frozenset(f[1:] for f in feats.split(",") if f.startswith("+"))


_FEATURES = _compile_features()
VEC = 16 if "avx512f" in _FEATURES else 8 if "avx" in _FEATURES else 4  # float32 lanes a register
# pmaddwd (int16 pairs → int32) of the widest register, else None: plain IR that LLVM lowers
# as it can (correct anywhere, fast where it recognises the pattern)
_MADD = (("llvm.x86.avx512.pmaddw.d.512", 16) if "avx512bw" in _FEATURES else
         ("llvm.x86.avx2.pmadd.wd", 8) if "avx2" in _FEATURES else
         ("llvm.x86.sse2.pmadd.wd", 4) if "sse2" in _FEATURES else (None, VEC))
IVEC = _MADD[1]  # int32 lanes of one integer vector (pmaddwd's, vpdpbusd's)
# pmulhrsw (int16 × int16 → round(a b / 2^15)) on 2·IVEC lanes, else None: plain IR
_MULHRS = ("llvm.x86.avx512.pmul.hr.sw.512" if "avx512bw" in _FEATURES else
           "llvm.x86.avx2.pmul.hr.sw" if "avx2" in _FEATURES else
           "llvm.x86.ssse3.pmul.hr.sw.128" if "ssse3" in _FEATURES else None, 2 * IVEC)
DOT_TOKENS = 4 if VEC >= 16 else 2  # T: tokens a score-kernel pass (T·4 accumulators must fit)
ACC_CHUNKS = 4 if VEC >= 16 else 2  # C: accumulator vectors per head a value-kernel pass


def _ir():
    from llvmlite import ir
    from numba.core import cgutils

    return ir, cgutils


def _vec_ptr(builder, base, index, vty):
    """&base[index] as a pointer to vector type vty."""
    return builder.bitcast(builder.gep(base, [index], inbounds=True), vty.as_pointer())


def _load_widened(builder, dtype, base, index, lanes):
    """lanes elements at base[index] (uint16 bf16 bits, int8 or float32) → <lanes x float>."""
    ir, _ = _ir()
    f32v = ir.VectorType(ir.FloatType(), lanes)
    if dtype == types.float32:
        return builder.load(_vec_ptr(builder, base, index, f32v), align=4)
    if dtype == types.uint16:
        raw = builder.load(_vec_ptr(builder, base, index, ir.VectorType(ir.IntType(16), lanes)), align=2)
        wide = builder.zext(raw, ir.VectorType(ir.IntType(32), lanes))
        return builder.bitcast(builder.shl(wide, ir.Constant(wide.type, [16] * lanes)), f32v)
    raw = builder.load(_vec_ptr(builder, base, index, ir.VectorType(ir.IntType(8), lanes)), align=1)
    return builder.sitofp(raw, f32v)


def _widen_chunk(builder, dtype, base, index, lanes, paired):
    """The elements at base[index:] as float32 vectors of `lanes`, each with its offset in the
    chunk: one vector, or for `paired` uint16 (bf16 bits) 2·lanes elements in one load, split
    into the even elements (shifted into the high half) and the odd ones (masked in place):
    one instruction a vector instead of a widening move and a shift. The pair layout (each
    2·lanes chunk as its evens then its odds) is what q and the accumulator then use."""
    ir, _ = _ir()
    if not paired:
        return [(_load_widened(builder, dtype, base, index, lanes), 0)]
    i32v, f32v = ir.VectorType(ir.IntType(32), lanes), ir.VectorType(ir.FloatType(), lanes)
    raw = builder.load(_vec_ptr(builder, base, index, i32v), align=2)
    even = builder.shl(raw, ir.Constant(i32v, [16] * lanes))
    odd = builder.and_(raw, ir.Constant(i32v, [0xFFFF0000 - (1 << 32)] * lanes))
    return [(builder.bitcast(even, f32v), 0), (builder.bitcast(odd, f32v), lanes)]


def _d_loops(builder, intp, D, W, paired, body):
    """body(c, pr) over the head dim D: chunks of 2W in pair layout (pr true) while they fit
    when `paired`, then chunks of W."""
    from numba.core import cgutils

    start = intp(0)
    if paired:
        start = builder.mul(builder.sdiv(D, intp(2 * W)), intp(2 * W))
        with cgutils.for_range_slice(builder, intp(0), start, intp(2 * W), intp) as (c, _):
            body(c, True)
    with cgutils.for_range_slice(builder, start, D, intp(W), intp) as (c, _):
        body(c, False)


def _splat(builder, x, lanes):
    ir, _ = _ir()
    vty = ir.VectorType(x.type, lanes)
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), x, ir.IntType(32)(0))
    return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                                                                                   [0] * lanes))


def _shuffle(builder, x, y, mask):
    ir, _ = _ir()
    return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(ir.IntType(32), len(mask)), mask))


def _lane_sums(builder, vecs, add):
    """The lane sums of N equal vectors as a few vectors whose lanes, read in order, are those N
    sums in order: a butterfly where each level adds the halves of each source's lanes of two
    vectors into one vector (2 shuffles and 1 add per pair), then within the last vector."""
    ir, _ = _ir()
    L = vecs[0].type.count
    width = 1 << (len(vecs) - 1).bit_length()
    vecs = vecs + [ir.Constant(vecs[0].type, None)] * (width - len(vecs))  # zero sources
    c = L  # lanes each source still spreads over
    while c > 1 and len(vecs) > 1:
        h, per = c // 2, L // c  # per: sources in each vector
        lo = [s * c + i for s in range(per) for i in range(h)]
        hi = [s * c + h + i for s in range(per) for i in range(h)]
        lo, hi = lo + [L + i for i in lo], hi + [L + i for i in hi]
        vecs = [add(_shuffle(builder, x, y, lo), _shuffle(builder, x, y, hi)) for x, y in zip(vecs[0::2], vecs[1::2])]
        c = h
    while c > 1:
        (x,) = vecs
        h, per = c // 2, x.type.count // c
        lo = [s * c + i for s in range(per) for i in range(h)]
        hi = [s * c + h + i for s in range(per) for i in range(h)]
        vecs = [add(_shuffle(builder, x, x, lo), _shuffle(builder, x, x, hi))]
        c = h
    return vecs


def _head_sums(builder, sums, i, T):
    """Head i's T sums as one <T x elem> vector: lanes i*T .. i*T+T-1 of `_lane_sums`' vectors
    read in order (a dot-product kernel's T tokens × heads, reduced together)."""
    ir, _ = _ir()
    Lr = sums[0].type.count
    v, o = sums[i * T // Lr], i * T % Lr
    if o + T <= Lr:  # in one vector
        return v if T == Lr else _shuffle(builder, v, v, list(range(o, o + T)))
    part = ir.Constant(ir.VectorType(v.type.element, T), None)
    for t in range(T):
        lane = builder.extract_element(sums[(i * T + t) // Lr], ir.IntType(32)((i * T + t) % Lr))
        part = builder.insert_element(part, lane, ir.IntType(32)(t))
    return part


def _madd(builder, a, b):
    """<2L x i16> a, b → <L x i32>: a[2i] b[2i] + a[2i+1] b[2i+1] (x86 pmaddwd)."""
    ir, cgutils = _ir()
    L = a.type.count // 2
    name, lanes = _MADD
    i32v = ir.VectorType(ir.IntType(32), L)
    if name is not None and lanes == L:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32v, [a.type, a.type]), name)
        return builder.call(fn, [a, b])
    wide = ir.VectorType(ir.IntType(32), 2 * L)
    p = builder.mul(builder.sext(a, wide), builder.sext(b, wide))
    even, odd = list(range(0, 2 * L, 2)), list(range(1, 2 * L, 2))
    return builder.add(_shuffle(builder, p, p, even), _shuffle(builder, p, p, odd))


def _mulhrs(builder, a, b):
    """<N x i16> a, b → ((a b >> 14) + 1) >> 1 per lane, i.e. a b / 2^15 rounded half up (x86
    pmulhrsw; exact, no overflow unless a = b = -2^15)."""
    ir, cgutils = _ir()
    name, lanes = _MULHRS
    if name is not None and lanes == a.type.count:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type, a.type]), name)
        return builder.call(fn, [a, b])
    wide = ir.VectorType(ir.IntType(32), a.type.count)
    p = builder.mul(builder.sext(a, wide), builder.sext(b, wide))
    one = ir.Constant(wide, [1] * a.type.count)
    p = builder.ashr(builder.add(builder.ashr(p, ir.Constant(wide, [14] * a.type.count)), one), one)
    return builder.trunc(p, a.type)


def _args(context, builder, sig, args):
    """An intrinsic's arguments: arrays as Numba array structs, integers as intp values."""
    out = []
    for t, a in zip(sig.args, args):
        if isinstance(t, types.Array):
            out.append(context.make_array(t)(context, builder, a))
        else:
            out.append(context.cast(builder, a, t, types.intp))
    return out


def _dots_codegen(ng, T, W):
    """Codegen of `dots`: see `make_dots`."""

    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        q, g, k, r0, r1, s, sj = _args(context, builder, sig, args)
        kdtype = sig.args[2].dtype
        intp = context.get_value_type(types.intp)
        D = builder.extract_value(k.shape, 1)
        S = builder.extract_value(s.shape, 1)
        last = builder.sub(r1, intp(1))
        rows = []
        for t in range(T):  # rows past the end repeat the last one (their stores are never read)
            r = builder.add(r0, intp(t))
            rows.append(builder.mul(builder.select(builder.icmp_signed("<", r, r1), r, last), D))
        qrows = [builder.mul(builder.add(g, intp(i)), D) for i in range(ng)]
        avty = ir.VectorType(ir.FloatType(), W)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(avty, [avty] * 3), f"llvm.fmuladd.v{W}f32")
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(avty, None)) for _ in range(T)] for _ in range(ng)]

        def body(c, pr):
            xs = [_widen_chunk(builder, kdtype, k.data, builder.add(r, c), W, pr) for r in rows]
            for p, (_, off) in enumerate(xs[0]):
                for i in range(ng):
                    qv = builder.load(_vec_ptr(builder, q.data, builder.add(qrows[i], builder.add(c, intp(off))),
                                               avty), align=4)
                    for t in range(T):
                        builder.store(builder.call(fma, [qv, xs[t][p][0], builder.load(accs[i][t])]), accs[i][t])

        _d_loops(builder, intp, D, W, kdtype == types.uint16, body)
        sums = _lane_sums(builder, [builder.load(a) for row in accs for a in row], builder.fadd)
        for i in range(ng):
            part = _head_sums(builder, sums, i, T)
            at = builder.add(builder.mul(builder.add(g, intp(i)), S), sj)
            builder.store(part, _vec_ptr(builder, s.data, at, part.type), align=4)
        return context.get_dummy_value()

    return codegen


def make_dots(ng: int, T: int = DOT_TOKENS, W: int = VEC):
    """An intrinsic dots(q, g, k, r0, r1, s, sj): for heads i < ng and tokens t < T,
    s[g+i, sj+t] = q[g+i] · k[min(r0+t, r1-1)].

    q [G, D] float32: k [R, D] uint16 (bf16 bits; then q in the pair layout of W lanes,
    `to_pair_layout`), int8 or float32; W-lane float32 vectors; D % W == 0.
    s [G, S] float32; all C-contiguous. Rows past r1 repeat row r1-1, so a caller may step r0
    by T to r1 and give s at least T-1 spare columns. No bounds checks."""

    @intrinsic
    def dots(typingctx, q, g, k, r0, r1, s, sj):
        if not (_c_array_2d(q, types.float32) and isinstance(k, types.Array)
                and k.dtype in (types.uint16, types.int8, types.float32) and k.ndim == 2 and k.layout == "C"
                and _c_array_2d(s, types.float32)):
            return None
        return types.void(q, g, k, r0, r1, s, sj), _dots_codegen(ng, T, W)

    return dots


def _accumulate_codegen(ng, C, W):
    """Codegen of `accumulate`: see `make_accumulate`."""

    def codegen(context, builder, sig, args):
        ir, cgutils = _ir()
        p, g, pj, v, r0, n, acc = _args(context, builder, sig, args)
        vdtype = sig.args[3].dtype
        intp = context.get_value_type(types.intp)
        f32v = ir.VectorType(ir.FloatType(), W)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32v, [f32v] * 3), f"llvm.fmuladd.v{W}f32")
        D = builder.extract_value(v.shape, 1)
        S = builder.extract_value(p.shape, 1)
        prow = [builder.add(builder.mul(builder.add(g, intp(i)), S), pj) for i in range(ng)]
        arow = [builder.mul(builder.add(g, intp(i)), D) for i in range(ng)]
        regs = [[cgutils.alloca_once(builder, f32v) for _ in range(C)] for _ in range(ng)]

        def one_pass(c0, cc, pr):  # acc[g+i, c0 : c0 + cc*W] += Σ_t p[g+i, pj+t] v[r0+t, same]
            ptrs = [[_vec_ptr(builder, acc.data, builder.add(arow[i], builder.add(c0, intp(c * W))), f32v)
                     for c in range(cc)] for i in range(ng)]
            for i in range(ng):
                for c in range(cc):
                    builder.store(builder.load(ptrs[i][c], align=4), regs[i][c])
            with cgutils.for_range_slice(builder, intp(0), n, intp(1), intp) as (t, _):
                row = builder.add(builder.mul(builder.add(r0, t), D), c0)
                xs = [x for c in range(0, cc, 2 if pr else 1)
                      for x, _ in _widen_chunk(builder, vdtype, v.data, builder.add(row, intp(c * W)), W, pr)]
                for i in range(ng):
                    w = _splat(builder, builder.load(builder.gep(p.data, [builder.add(prow[i], t)], inbounds=True)), W)
                    for c in range(cc):
                        builder.store(builder.call(fma, [w, xs[c], builder.load(regs[i][c])]), regs[i][c])
            for i in range(ng):
                for c in range(cc):
                    builder.store(builder.load(regs[i][c]), ptrs[i][c], align=4)

        # C vectors a pass over the head dim, then one pair (2 vectors) or vector at a time
        paired = vdtype == types.uint16
        full = builder.mul(builder.sdiv(D, intp(C * W)), intp(C * W))
        with cgutils.for_range_slice(builder, intp(0), full, intp(C * W), intp) as (c0, _):
            one_pass(c0, C, paired)
        if paired:
            pairs = builder.mul(builder.sdiv(D, intp(2 * W)), intp(2 * W))
            with cgutils.for_range_slice(builder, full, pairs, intp(2 * W), intp) as (c0, _):
                one_pass(c0, 2, True)
            full = pairs
        with cgutils.for_range_slice(builder, full, D, intp(W), intp) as (c0, _):
            one_pass(c0, 1, False)
        return context.get_dummy_value()

    return codegen


def make_accumulate(ng: int, C: int = ACC_CHUNKS, W: int = VEC):
    """An intrinsic accumulate(p, g, pj, v, r0, n, acc): for heads i < ng,
    acc[g+i] += Σ_{t<n} p[g+i, pj+t] · v[r0+t] (float32), the accumulator held in registers,
    C vectors of W lanes a head at a time, over the n rows.

    p [G, S] float32; v [R, D] uint16 (bf16 bits; then acc is in the pair layout of W lanes,
    `to_pair_layout`, and C even), int8 or float32; acc [G, D] float32; all C-contiguous;
    D % W == 0. No bounds checks."""
    if C % 2:
        raise ValueError(f"C must be even (bf16 values are widened two vectors a load), got {C}")

    @intrinsic
    def accumulate(typingctx, p, g, pj, v, r0, n, acc):
        if not (_c_array_2d(p, types.float32) and isinstance(v, types.Array) and v.ndim == 2 and v.layout == "C"
                and v.dtype in (types.uint16, types.int8, types.float32) and _c_array_2d(acc, types.float32)):
            return None
        return types.void(p, g, pj, v, r0, n, acc), _accumulate_codegen(ng, C, W)

    return accumulate


def _c_array_1d(t, dtype) -> bool:
    return isinstance(t, types.Array) and t.dtype == dtype and t.ndim == 1 and t.layout == "C"


def _c_array_2d(t, dtype) -> bool:
    return isinstance(t, types.Array) and t.dtype == dtype and t.ndim == 2 and t.layout == "C"


@numba.njit(inline="always", nogil=True, cache=True)
def to_pair_layout(x, out):
    """out = x [G, D] in the pair layout of VEC lanes (how bf16 rows are widened, `_widen_chunk`):
    each whole chunk of 2·VEC elements as its even elements, then its odd ones; a last chunk
    of VEC elements as it is."""
    G, D = x.shape
    full = D // (2 * VEC) * (2 * VEC)
    for g in range(G):
        for c in range(0, full, 2 * VEC):
            for i in range(VEC):
                out[g, c + i] = x[g, c + 2 * i]
                out[g, c + VEC + i] = x[g, c + 2 * i + 1]
        for d in range(full, D):
            out[g, d] = x[g, d]


@numba.njit(inline="always", nogil=True, cache=True)
def from_pair_layout(x, out):
    """The inverse of `to_pair_layout`."""
    G, D = x.shape
    full = D // (2 * VEC) * (2 * VEC)
    for g in range(G):
        for c in range(0, full, 2 * VEC):
            for i in range(VEC):
                out[g, c + 2 * i] = x[g, c + i]
                out[g, c + 2 * i + 1] = x[g, c + VEC + i]
        for d in range(full, D):
            out[g, d] = x[g, d]
