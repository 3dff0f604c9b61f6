"""The Numba kernels behind `cpu_attention.experts`: a layer's host-resident experts over 4-bit
weights, for the tokens routed to them. The format, the torch twin and the wrappers are in
`experts.py`, which imports this module on first use.

One call computes every (token, expert) pair whose expert the host holds:

    pairs grouped by expert (each expert's weights are read once for all its tokens)
    act[p, j] = silu(x[t_p] · gate_j) · (x[t_p] · up_j)          over (group, row j) in parallel
    out[t, o] = Σ_{p: t_p = t} w_p · (act[p] · down_o)             over rows o in parallel

Where the shapes allow (`vnni_shapes`), x and act are quantized to int8 a group of 64 first and
each row's dot product is integer vector code (`_simd_q4`: vpdpbusd on AVX-512 VNNI): the float
path converts every code to float32 and is compute-bound at a third of DRAM's rate on the GPU host.

`run_descriptor` is the same call behind a C entry point, adding its time-stamp cycles and its
(token, expert) pairs to counters the engine's timers read, (`entry_address`): the CUDA driver calls
it from a stream (a host node of the step's graph, `cuLaunchHostFunc`) with a pointer to an int64
descriptor holding the arrays' addresses and shapes, so it runs without Python and without the GIL
while the GPU computes its own experts.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
from numba import carray, cfunc, njit, prange, types
from numba.extending import intrinsic

from cpu_attention._numba import JIT
from cpu_attention._simd_q4 import SUPPORTED, W_LANES, make_row_dot

OUT_ROWS = 32  # output rows a task of pass 3 (as experts_pool.CHUNK)
STREAMS = 8  # experts whose rows pass 3 reads side by side (a decode token's top-k: Qwen3's 8, Mixtral's 2)
GROUP = 64  # weights a scale; a group's 64 codes are 32 bytes: code j in the low nibble of byte j, code 32 + j in the high


@njit(inline="always", **JIT)
def _dot(q, s, e, row, x, xsum, n):
    """Σ_i W_e[row, i] · x[n, i] for W_e as 4-bit codes q [E, O, I/2] and scales s [E, O, I/64];
    xsum [N, I/64]: x's sums over each group (the codes' offset of 8 times them is subtracted once
    a group). The codes are widened as int32: Numba's default int64 made LLVM convert them with
    64-bit lanes, at half the speed (measured: 4.2 against 8.7 GB/s a core)."""
    acc = np.float32(0.0)
    for b in range(s.shape[2]):
        part = np.float32(0.0)
        base = 32 * b
        for j in range(32):
            c = np.int32(q[e, row, base + j])
            lo = np.float32(np.int32(c & np.int32(15)))
            hi = np.float32(np.int32(c >> np.int32(4)))
            part += lo * x[n, 2 * base + j] + hi * x[n, 2 * base + 32 + j]
        acc += (part - np.float32(8.0) * xsum[n, b]) * s[e, row, b]
    return acc


_row_dot = make_row_dot()


def vnni_shapes(hidden: int, inter: int) -> bool:
    """Whether the integer micro-kernel takes these experts (rows of whole vectors of codes)."""
    return SUPPORTED and hidden % (8 * W_LANES) == 0 and inter % (8 * W_LANES) == 0


@njit(inline="always", **JIT)
def _quantize(x, n, xq, corr, xsc):
    """Row n of x [·, I] f32 → int8 per group of 64 (scale max |x| / 127): xq[n] holds the groups'
    first halves (xlo) then their second halves (xhi), corr[n, 8 g] = −8 Σ of group g's values
    (the rest of its 8 lanes 0), xsc[n, g] its scale (`_simd_q4`)."""
    half = x.shape[1] // 2
    for g in range(x.shape[1] // GROUP):
        m = np.float32(0.0)
        for j in range(GROUP):
            m = max(m, abs(x[n, GROUP * g + j]))
        s = m / np.float32(127.0) if m > 0 else np.float32(1.0)
        inv = np.float32(1.0) / s
        tot = np.int32(0)
        for j in range(32):
            a = np.int32(np.round(x[n, GROUP * g + j] * inv))
            b = np.int32(np.round(x[n, GROUP * g + 32 + j] * inv))
            xq[n, 32 * g + j] = a
            xq[n, half + 32 * g + j] = b
            tot += a + b
        xsc[n, g] = s
        corr[n, 8 * g] = np.int32(-8) * tot
        for j in range(1, 8):
            corr[n, 8 * g + j] = 0


@njit(inline="always", **JIT)
def _group_sums(x, rows, out):
    """out[n, b] = Σ of x[n]'s b-th group of 64, for its first `rows` rows."""
    for n in range(rows):
        for b in range(out.shape[1]):
            t = np.float32(0.0)
            for j in range(GROUP):
                t += x[n, GROUP * b + j]
            out[n, b] = t


@njit(**JIT)
def group_pairs(ids, E, tok, pw_slot, starts, gexp):
    """ids [N, k] (the host's expert index a slot routes to, −1: not the host's) → pairs sorted by
    expert: tok [P] their token, pw_slot [P] their flat slot n·k + s; groups g: experts gexp [G],
    pairs starts[g] .. starts[g+1]. Returns (P, G)."""
    N, K = ids.shape
    count = np.zeros(E + 1, np.int64)
    for n in range(N):
        for s in range(K):
            e = ids[n, s]
            if e >= 0:
                count[e + 1] += 1
    for e in range(E):
        count[e + 1] += count[e]
    P = count[E]
    fill = count[:E].copy()
    for n in range(N):
        for s in range(K):
            e = ids[n, s]
            if e >= 0:
                p = fill[e]
                tok[p] = n
                pw_slot[p] = n * K + s
                fill[e] += 1
    G = 0
    for e in range(E):
        if count[e + 1] > count[e]:
            gexp[G] = e
            starts[G] = count[e]
            G += 1
    starts[G] = P
    return P, G


@njit(inline="always", **JIT)
def act_row(r, x, tok, starts, gexp, gu_q, gu_s, act, xsum, xq, xcorr, vnni):
    """Pass 1 for row r of the groups' gate/up rows (group r // F, row j = r % F): for each of the
    group's pairs p, act[p, j] = silu(x[t_p] · gate_j) · (x[t_p] · up_j)."""
    F = act.shape[1]
    H = x.shape[1]
    GH, nh = H // GROUP, H // (8 * W_LANES)
    g = r // F
    j = r - g * F
    e = gexp[g]
    for p in range(starts[g], starts[g + 1]):
        t = tok[p]
        if vnni:
            ra, rb = e * 2 * F + j, e * 2 * F + F + j
            a = _row_dot(gu_q, ra * (H // 2), xq, t * H, t * H + H // 2, xcorr, t * GH * 8, xsum, t * GH, gu_s,
                         ra * GH, nh)
            b = _row_dot(gu_q, rb * (H // 2), xq, t * H, t * H + H // 2, xcorr, t * GH * 8, xsum, t * GH, gu_s,
                         rb * GH, nh)
        else:
            a = _dot(gu_q, gu_s, e, j, x, xsum, t)
            b = _dot(gu_q, gu_s, e, F + j, x, xsum, t)
        act[p, j] = a / (np.float32(1.0) + np.exp(-a)) * b


@njit(inline="always", **JIT)
def act_prep(p, act, asum, aq, acorr, vnni):
    """Pass 2 for pair p: its act row quantized (vnni) or its group sums (`_quantize`, `_group_sums`)."""
    if vnni:
        _quantize(act, p, aq, acorr, asum)
    else:
        for b in range(asum.shape[1]):
            t = np.float32(0.0)
            for j in range(GROUP):
                t += act[p, GROUP * b + j]
            asum[p, b] = t


@njit(inline="always", **JIT)
def out_rows(o0, o1, w, tok, pw_slot, starts, gexp, G, d_q, d_s, act, out, asum, aq, acorr, vnni):
    """Pass 3 for output rows o0 <= o < o1: out[n, o] = Σ over the pairs p of token n of w_p ·
    (act[p] · down_o). STREAMS experts at a time, row by row among them: their rows of the range
    are read as that many streams side by side. All G experts at once (a batch's tokens route to
    many) took 17.5 ms a call for 8 tokens over 64 experts on 2 cores, against 8 × 0.64 for one
    token over 4 (the same bytes a token): the hardware prefetchers lose track of that many
    streams; one expert at a time cost one token 20% (each short stream ramps up alone)."""
    F = act.shape[1]
    H = out.shape[1]
    K = w.shape[1]
    GF, nf = F // GROUP, F // (8 * W_LANES)
    for n in range(out.shape[0]):
        for o in range(o0, o1):
            out[n, o] = np.float32(0.0)
    for g0 in range(0, G, STREAMS):
        for o in range(o0, o1):
            for g in range(g0, min(g0 + STREAMS, G)):
                e = gexp[g]
                for p in range(starts[g], starts[g + 1]):
                    sl = pw_slot[p]
                    if vnni:
                        ro = e * H + o
                        y = _row_dot(d_q, ro * (F // 2), aq, p * F, p * F + F // 2, acorr, p * GF * 8, asum, p * GF,
                                     d_s, ro * GF, nf)
                    else:
                        y = _dot(d_q, d_s, e, o, act, asum, p)
                    out[tok[p], o] += y * w[sl // K, sl - (sl // K) * K]


@njit(inline="always", **JIT)
def prepare_x(x, xsum, xq, xcorr, vnni):
    """Before pass 1: x's rows quantized (vnni) or their group sums."""
    if vnni:
        for n in range(x.shape[0]):
            _quantize(x, n, xq, xcorr, xsum)
    else:
        _group_sums(x, x.shape[0], xsum)


@njit(parallel=True, **JIT)
def _experts(x, w, tok, pw_slot, starts, gexp, G, gu_q, gu_s, d_q, d_s, act, out, xsum, asum, xq, xcorr, aq, acorr,
             vnni):
    """vnni: x and act quantized to int8 and the rows' dot products in integer vector code
    (`_simd_q4`; xsum and asum then hold the quantization scales); else float32 (`_dot`)."""
    prepare_x(x, xsum, xq, xcorr, vnni)
    for r in prange(G * act.shape[1]):
        act_row(r, x, tok, starts, gexp, gu_q, gu_s, act, xsum, xq, xcorr, vnni)
    for p in prange(starts[G]):
        act_prep(p, act, asum, aq, acorr, vnni)
    H = out.shape[1]
    for c in prange((H + OUT_ROWS - 1) // OUT_ROWS):  # each output row owned by one thread: no second pass
        out_rows(c * OUT_ROWS, min(c * OUT_ROWS + OUT_ROWS, H), w, tok, pw_slot, starts, gexp, G, d_q, d_s, act, out,
                 asum, aq, acorr, vnni)


@njit(**JIT)
def run(x, ids, w, gu_q, gu_s, d_q, d_s, tok, pw_slot, starts, gexp, act, out, xsum, asum, xq, xcorr, aq, acorr,
        vnni):
    """out [N, H] = Σ over the host's pairs of w · expert(x); see the module docstring. Scratch:
    tok, pw_slot [≥ N·k] int64, starts [≥ E + 1], gexp [≥ E], act [≥ N·k, F], xsum [≥ N, H/64],
    asum [≥ N·k, F/64] f32, xq [≥ N, H] and aq [≥ N·k, F] int8, xcorr [≥ N, H/8] and
    acorr [≥ N·k, F/8] int32 (the last four for vnni: `vnni_shapes`). Returns the (token, expert) pairs."""
    P, G = group_pairs(ids, gu_q.shape[0], tok, pw_slot, starts, gexp)
    _experts(x, w, tok, pw_slot, starts, gexp, G, gu_q, gu_s, d_q, d_s, act, out, xsum, asum, xq, xcorr, aq, acorr,
             vnni)
    return P


@intrinsic
def _ptr(typingctx, addr, kind):
    """An address (int64) as a typed pointer: kind is a sample value of the element type."""
    dtype = kind
    sig = types.CPointer(dtype)(types.int64, kind)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


# descriptor fields (int64): the shapes, then the arrays' addresses
(N_, K_, H_, F_, E_, THREADS_, X_, IDS_, W_, GUQ_, GUS_, DQ_, DS_, TOK_, PWS_, STARTS_, GEXP_, ACT_, OUT_, XSUM_, ASUM_,
 XQ_, XCORR_, AQ_, ACORR_, VNNI_, CYCLES_, POOL_, FIELDS) = range(29)


@intrinsic
def cycles(typingctx):
    """The CPU's time-stamp counter (LLVM's readcyclecounter: rdtsc on x86)."""
    def codegen(context, builder, signature, args):
        from llvmlite import ir

        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), []))
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(inline="always", nogil=True, fastmath=JIT["fastmath"])
def views(d):
    """The arrays a descriptor d (int64 [FIELDS]) names, in `run`'s order from x to acorr."""
    N, K, H, F, E = d[N_], d[K_], d[H_], d[F_], d[E_]
    f32, i32, i64, u8, i8 = np.float32(0), np.int32(0), np.int64(0), np.uint8(0), np.int8(0)
    return (carray(_ptr(d[X_], f32), (N, H)),
            carray(_ptr(d[IDS_], i32), (N, K)),
            carray(_ptr(d[W_], f32), (N, K)),
            carray(_ptr(d[GUQ_], u8), (E, 2 * F, H // 2)),
            carray(_ptr(d[GUS_], f32), (E, 2 * F, H // GROUP)),
            carray(_ptr(d[DQ_], u8), (E, H, F // 2)),
            carray(_ptr(d[DS_], f32), (E, H, F // GROUP)),
            carray(_ptr(d[TOK_], i64), (N * K,)),
            carray(_ptr(d[PWS_], i64), (N * K,)),
            carray(_ptr(d[STARTS_], i64), (E + 1,)),
            carray(_ptr(d[GEXP_], i64), (E,)),
            carray(_ptr(d[ACT_], f32), (N * K, F)),
            carray(_ptr(d[OUT_], f32), (N, H)),
            carray(_ptr(d[XSUM_], f32), (N, H // GROUP)),
            carray(_ptr(d[ASUM_], f32), (N * K, F // GROUP)),
            carray(_ptr(d[XQ_], i8), (N, H)),
            carray(_ptr(d[XCORR_], i32), (N, H // 8)),
            carray(_ptr(d[AQ_], i8), (N * K, F)),
            carray(_ptr(d[ACORR_], i32), (N * K, F // 8)))


@njit(nogil=True, fastmath=JIT["fastmath"])  # not cached: it reads addresses
def run_descriptor(d):
    numba.set_num_threads(d[THREADS_])
    x, ids, w, gu_q, gu_s, d_q, d_s, tok, pws, starts, gexp, act, out, xsum, asum, xq, xcorr, aq, acorr = views(d)
    spent = carray(_ptr(d[CYCLES_], np.int64(0)), (2,))  # where the calls' cycles and pairs add up
    t0 = cycles()
    spent[1] += run(x, ids, w, gu_q, gu_s, d_q, d_s, tok, pws, starts, gexp, act, out, xsum, asum, xq, xcorr, aq, acorr,
                    d[VNNI_] != 0)
    spent[0] += cycles() - t0


@functools.cache
def _entry():
    """The compiled entry point, kept alive here: compiled on first use (it cannot be cached, as it
    reads addresses), only where experts are computed beside a GPU."""

    @cfunc(types.void(types.CPointer(types.int64)), nogil=True)
    def entry(p):
        run_descriptor(carray(p, (FIELDS,)))

    return entry


def entry_address() -> int:
    """The C entry point `void f(int64_t *descriptor)` (for cuLaunchHostFunc)."""
    return _entry().address
