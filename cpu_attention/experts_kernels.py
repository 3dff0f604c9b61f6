"""The Numba kernels behind `cpu_attention.experts`: a layer's host-resident experts over 4-bit
weights, for the tokens routed to them. The format, the torch twin and the wrappers are in
`experts.py`, which imports this module on first use.

One call computes every (token, expert) pair whose expert the host holds:

    pairs grouped by expert (each expert's weights are read once for all its tokens)
    act[p, j] = silu(x[t_p] · gate_j) · (x[t_p] · up_j)          over (group, row j) in parallel
    out[t, o] = Σ_{p: t_p = t} w_p · (act[p] · down_o)             over rows o in parallel

`run_descriptor` is the same call behind a C entry point (`entry_address`): the CUDA driver calls
it from a stream (a host node of the step's graph, `cuLaunchHostFunc`) with a pointer to an int64
descriptor holding the arrays' addresses and shapes, so it runs without Python and without the GIL
while the GPU computes its own experts.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import carray, cfunc, njit, prange, types
from numba.extending import intrinsic

from cpu_attention._numba import JIT

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


@njit(parallel=True, **JIT)
def _experts(x, w, tok, pw_slot, starts, gexp, G, gu_q, gu_s, d_q, d_s, act, out, xsum, asum):
    F = d_q.shape[2] * 2
    H = out.shape[1]
    K = w.shape[1]
    P = starts[G]
    _group_sums(x, x.shape[0], xsum)
    for r in prange(G * F):
        g = r // F
        j = r - g * F
        e = gexp[g]
        for p in range(starts[g], starts[g + 1]):
            a = _dot(gu_q, gu_s, e, j, x, xsum, tok[p])
            b = _dot(gu_q, gu_s, e, F + j, x, xsum, tok[p])
            act[p, j] = a / (np.float32(1.0) + np.exp(-a)) * b
    _group_sums(act, P, asum)
    for o in prange(H):  # each output row owned by one thread: the sum over pairs needs no second pass
        for n in range(out.shape[0]):
            out[n, o] = np.float32(0.0)
        for g in range(G):
            e = gexp[g]
            for p in range(starts[g], starts[g + 1]):
                sl = pw_slot[p]
                out[tok[p], o] += _dot(d_q, d_s, e, o, act, asum, p) * w[sl // K, sl - (sl // K) * K]


@njit(**JIT)
def run(x, ids, w, gu_q, gu_s, d_q, d_s, tok, pw_slot, starts, gexp, act, out, xsum, asum):
    """out [N, H] = Σ over the host's pairs of w · expert(x); see the module docstring. Scratch:
    tok, pw_slot [≥ N·k] int64, starts [≥ E + 1], gexp [≥ E], act [≥ N·k, F], xsum [≥ N, H/64],
    asum [≥ N·k, F/64] f32."""
    P, G = group_pairs(ids, gu_q.shape[0], tok, pw_slot, starts, gexp)
    _experts(x, w, tok, pw_slot, starts, gexp, G, gu_q, gu_s, d_q, d_s, act, out, xsum, asum)


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
 FIELDS) = range(22)


@njit(nogil=True, fastmath=JIT["fastmath"])  # not cached: it reads addresses
def run_descriptor(d):
    N, K, H, F, E = d[N_], d[K_], d[H_], d[F_], d[E_]
    numba.set_num_threads(d[THREADS_])
    f32, i32, i64, u8 = np.float32(0), np.int32(0), np.int64(0), np.uint8(0)
    x = carray(_ptr(d[X_], f32), (N, H))
    ids = carray(_ptr(d[IDS_], i32), (N, K))
    w = carray(_ptr(d[W_], f32), (N, K))
    gu_q = carray(_ptr(d[GUQ_], u8), (E, 2 * F, H // 2))
    gu_s = carray(_ptr(d[GUS_], f32), (E, 2 * F, H // GROUP))
    d_q = carray(_ptr(d[DQ_], u8), (E, H, F // 2))
    d_s = carray(_ptr(d[DS_], f32), (E, H, F // GROUP))
    tok = carray(_ptr(d[TOK_], i64), (N * K,))
    pws = carray(_ptr(d[PWS_], i64), (N * K,))
    starts = carray(_ptr(d[STARTS_], i64), (E + 1,))
    gexp = carray(_ptr(d[GEXP_], i64), (E,))
    act = carray(_ptr(d[ACT_], f32), (N * K, F))
    out = carray(_ptr(d[OUT_], f32), (N, H))
    xsum = carray(_ptr(d[XSUM_], f32), (N, H // GROUP))
    asum = carray(_ptr(d[ASUM_], f32), (N * K, F // GROUP))
    run(x, ids, w, gu_q, gu_s, d_q, d_s, tok, pws, starts, gexp, act, out, xsum, asum)


@cfunc(types.void(types.CPointer(types.int64)), nogil=True)
def _entry(p):
    run_descriptor(carray(p, (FIELDS,)))


def entry_address() -> int:
    """The C entry point `void f(int64_t *descriptor)` (for cuLaunchHostFunc)."""
    return _entry.address
