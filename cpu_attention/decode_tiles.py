"""The steps the decode kernels (`decode_bf16`, `decode_int8`, `decode_int4`) are built from.

A kernel walks its work item's tokens a tile at a time (whole blocks, about TOKENS_PER_TILE
tokens): the scores of all G heads block by block into s [G, tile] (`_tile_scores`), one
online-softmax step for the whole tile (`_softmax_tile`: max, one rescale of the accumulator,
a vectorized polynomial exp), then the V accumulation block by block (`_tile_accumulate`). The
two hot loops are vector micro-kernels written as LLVM IR (`_simd.make_dots`,
`make_accumulate`): a pass scores DOT_TOKENS tokens × up to four heads with every partial sum
in registers, reduced together by a shuffle butterfly, and accumulates a block's tokens into
up to four heads × a few vectors of the accumulator held in registers. While a block is
scored, the next block's rows are prefetched a few rows a pass. An item ends as a partial,
merged with its pair's others by `decode_items`.

Head dims that are not a multiple of the vector width go to `decode_*_any`: the same
algorithm one block a tile with LLVM's vectorized loops (`_scores`, `_accumulate`,
`_next_tile`). int8 shares the online softmax, the partials and their merge; its scores and
value sums are its own (`decode_int8`, over the VNNI byte order).
"""
from __future__ import annotations

import numba
import numpy as np

from cpu_attention._numba import (
    JIT, bits_to_f32, exp_neg, f32_to_bits, line_elems, prefetch, widen,
)
from cpu_attention.decode_items import NEG_INF
from cpu_attention._simd import DOT_TOKENS, make_accumulate, make_dots

TILE = 32  # `decode_*_any`: tokens a tile
TOKENS_PER_TILE = 64  # bf16/int4: tokens scored per online-softmax step (whole blocks)
# Vector micro-kernels for the bf16 path (`_simd.make_dots` / `make_accumulate`),
# one specialization per head-group size; tiles span whole blocks.
_DOT1, _DOT2, _DOT3, _DOT4 = (make_dots(ng) for ng in (1, 2, 3, 4))
_ACC1, _ACC2, _ACC3, _ACC4 = (make_accumulate(ng) for ng in (1, 2, 3, 4))


@numba.njit(inline="always", **JIT)
def _scores(q, kt, n, s, pk, pv, pn):
    """s[g, j] = q[g] · widen(kt[j]) for j < n. q [G, D] f32; kt [n, D] uint16 (bf16 bits),
    int8 or f32. Heads go four at a time, then one group of the remaining 3, 2 or 1, each
    group sharing every K element load (`_scores_group`; the group size is a literal at each
    call so every call inlines its own specialized copy)."""
    G = q.shape[0]
    g = 0
    while g + 4 <= G:
        _scores_group(q, g, 4, kt, n, s, pk, pv, pn)
        g += 4
    if G - g == 3:
        _scores_group(q, g, 3, kt, n, s, pk, pv, pn)
    elif G - g == 2:
        _scores_group(q, g, 2, kt, n, s, pk, pv, pn)
    elif G - g == 1:
        _scores_group(q, g, 1, kt, n, s, pk, pv, pn)


@numba.njit(inline="always", **JIT)
def _scores_group(q, g, ng, kt, n, s, pk, pv, pn):
    """s[g + i, j] for heads i < ng ≤ 4, two tokens a pass: each K element is loaded and
    widened once for 2·ng FMAs. ng must be a constant at the call site: LLVM then folds the
    `ng > i` tests away and keeps only the accumulators in use. An odd last token is done
    twice (its pair is itself) rather than by a second copy of the loop. Loops over D use
    loop counters only (Numba's wraparound code on computed indices stops LLVM vectorizing).
    While the first group runs, rows j < pn of the next tile (pk, pv) are prefetched, one
    row per token, so the next tile's DRAM reads overlap this tile's arithmetic."""
    D = q.shape[1]
    q0, q1, q2, q3 = q[g], q[g + min(1, ng - 1)], q[g + min(2, ng - 1)], q[g + min(3, ng - 1)]
    s0, s1, s2, s3 = s[g], s[g + min(1, ng - 1)], s[g + min(2, ng - 1)], s[g + min(3, ng - 1)]
    for j in range(0, n, 2):
        j1 = min(j + 1, n - 1)
        if g == 0:
            for jj in range(j, min(j + 2, pn)):
                _prefetch_row(pk, jj)
                _prefetch_row(pv, jj)
        kr, kr1 = kt[j], kt[j1]
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        for d in range(D):
            x = widen(kr[d])
            y = widen(kr1[d])
            a0 += q0[d] * x
            b0 += q0[d] * y
            if ng > 1:
                a1 += q1[d] * x
                b1 += q1[d] * y
            if ng > 2:
                a2 += q2[d] * x
                b2 += q2[d] * y
            if ng > 3:
                a3 += q3[d] * x
                b3 += q3[d] * y
        s0[j], s0[j1] = a0, b0
        if ng > 1:
            s1[j], s1[j1] = a1, b1
        if ng > 2:
            s2[j], s2[j1] = a2, b2
        if ng > 3:
            s3[j], s3[j1] = a3, b3


@numba.njit(inline="always", **JIT)
def _row_max(x, n):
    """max(x[:n]) (-inf if n == 0) for finite or -inf float32 x, as a max over int32 keys that order as
    the floats do (`_key`): an integer max vectorizes, while a float one without fastmath's no-NaN
    flag stays a scalar chain of one compare per element."""
    mx = np.int32(-(2**31))
    for j in range(n):
        mx = max(mx, _key(x[j]))
    return _unkey(mx) if n > 0 else NEG_INF


@numba.njit(inline="always", **JIT)
def _key(x):
    """An int32 that orders as the float32 x does (negative floats' magnitude bits flipped)."""
    b = np.int32(f32_to_bits(x))
    return b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))


@numba.njit(inline="always", **JIT)
def _unkey(k):
    """The float32 whose `_key` is k."""
    return bits_to_f32(k ^ ((k >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@numba.njit(inline="always", **JIT)
def _raise_max(sg, n, g, m, l, acc):
    """Head g's running max m[g] raised to the max of its tile's n scores sg (`_raise_to`)."""
    return _raise_to(_row_max(sg, n), g, m, l, acc)


@numba.njit(inline="always", **JIT)
def _raise_to(mx, g, m, l, acc):
    """Head g's running max m[g] raised to mx, its sum l[g] and accumulator acc[g] rescaled to
    match (once per tile, not per token); → the new m[g]."""
    if mx > m[g]:
        corr = exp_neg(m[g] - mx)  # 0 while m is -inf
        l[g] *= corr
        ag = acc[g]
        for d in range(ag.shape[0]):
            ag[d] *= corr
        m[g] = mx
    return m[g]


@numba.njit(inline="always", **JIT)
def _softmax_tile(s, n, m, l, acc):
    """Online softmax step over a tile of n scores s [G, TILE] → weights in place; the running
    max m [G], sum l [G] and accumulator acc [G, D] are rescaled once per tile (`_raise_max`)."""
    for g in range(acc.shape[0]):
        sg = s[g]
        mg = _raise_max(sg, n, g, m, l, acc)
        tot = np.float32(0.0)
        for j in range(n):  # polynomial exp: vectorizes, libm's expf would not
            p = exp_neg(sg[j] - mg)
            sg[j] = p
            tot += p
        l[g] += tot


@numba.njit(inline="always", **JIT)
def _accumulate(p, vt, n, acc):
    """acc[g] += Σ_j p[g, j] · widen(vt[j]) for j < n, in head groups as `_scores`."""
    G = acc.shape[0]
    g = 0
    while g + 4 <= G:
        _accumulate_group(p, vt, n, acc, g, 4)
        g += 4
    if G - g == 3:
        _accumulate_group(p, vt, n, acc, g, 3)
    elif G - g == 2:
        _accumulate_group(p, vt, n, acc, g, 2)
    elif G - g == 1:
        _accumulate_group(p, vt, n, acc, g, 1)


@numba.njit(inline="always", **JIT)
def _accumulate_group(p, vt, n, acc, g, ng):
    """Heads g..g+ng (ng ≤ 4, a call-site constant as in `_scores_group`) × two tokens a
    pass: each V element is widened once per pass and each acc vector is loaded and stored
    once per two tokens. An odd last token pairs with itself at weight 0."""
    D = acc.shape[1]
    a0, a1, a2, a3 = acc[g], acc[g + min(1, ng - 1)], acc[g + min(2, ng - 1)], acc[g + min(3, ng - 1)]
    p0, p1, p2, p3 = p[g], p[g + min(1, ng - 1)], p[g + min(2, ng - 1)], p[g + min(3, ng - 1)]
    for j in range(0, n, 2):
        j1 = min(j + 1, n - 1)
        v0, v1 = vt[j], vt[j1]
        odd = j1 == j  # the pair is the token itself: its second weight is 0
        w00, w10, w20, w30 = p0[j], p1[j], p2[j], p3[j]
        w01 = np.float32(0.0) if odd else p0[j1]
        w11 = np.float32(0.0) if odd else p1[j1]
        w21 = np.float32(0.0) if odd else p2[j1]
        w31 = np.float32(0.0) if odd else p3[j1]
        for d in range(D):
            x0 = widen(v0[d])
            x1 = widen(v1[d])
            a0[d] += w00 * x0 + w01 * x1
            if ng > 1:
                a1[d] += w10 * x0 + w11 * x1
            if ng > 2:
                a2[d] += w20 * x0 + w21 * x1
            if ng > 3:
                a3[d] += w30 * x0 + w31 * x1


@numba.njit(inline="always", **JIT)
def _prefetch_row(a, j):
    """Prefetch row j of a 2-D C-contiguous array, one cache line at a time."""
    W = a.shape[1]
    for i in range(j * W, (j + 1) * W, line_elems(a)):
        prefetch(a, i)


@numba.njit(inline="always", **JIT)
def _next_tile(bt, b, t, t1, BS):
    """(block, offset, tokens) of the tile starting at token t of sequence b, ending by t1."""
    off = t % BS
    return bt[b, t // BS], off, min(BS - off, t1 - t, TILE)


@numba.njit(inline="always", **JIT)
def _tile_len(BS):
    """Tokens of a tile: whole blocks, about TOKENS_PER_TILE."""
    return max(TOKENS_PER_TILE // BS, 1) * BS


def rest_heads(G: int) -> tuple[int, ...]:
    """The kernels' `rest` argument: a tuple of G % 4 zeros. The kernels do a kv head's G query
    heads in groups of four, then the G % 4 left over with a micro-kernel for 3, 2 or 1; `len(rest)`
    is a constant when Numba compiles a kernel (one compile per G % 4), so the unused micro-kernels
    are pruned before typing instead of compiled, ~5 s less of an int4 kernel's compile."""
    return (0,) * (G % 4)


@numba.njit(inline="always", **JIT)
def _dots_rows(q, kb, r0, r1, s, sj, pk, pv, p0, p1, R):
    """s[:, sj + j - r0] = q · kb[j] for rows r0 <= j < r1 of one block, all G heads: heads in
    groups of four (then R = G % 4 more, a compile-time constant: `rest_heads`), DOT_TOKENS
    tokens a pass, the pass's K rows reused by every group from L1. Each pass also prefetches
    as many rows p0 + j - r0 < p1 of pk and pv (a later block): spread out like this, the
    prefetches overlap the arithmetic (issued a block at a time, they measured ~15% slower)."""
    G = q.shape[0]
    for j in range(r0, r1, DOT_TOKENS):
        pj = p0 + j - r0
        pe = min(pj + DOT_TOKENS, p1)
        if pj < pe:
            _prefetch_rows(pk, pj, pe)
            _prefetch_rows(pv, pj, pe)
        c = sj + j - r0
        g = 0
        while g + 4 <= G:
            _DOT4(q, g, kb, j, r1, s, c)
            g += 4
        if R == 3:
            _DOT3(q, g, kb, j, r1, s, c)
        elif R == 2:
            _DOT2(q, g, kb, j, r1, s, c)
        elif R == 1:
            _DOT1(q, g, kb, j, r1, s, c)


@numba.njit(inline="always", **JIT)
def _accumulate_rows(p, pj, vb, r0, n, acc, R):
    """acc[g] += Σ_t p[g, pj + t] · vb[r0 + t] for t < n (rows of one block), all G heads in
    groups of four (then R = G % 4 more)."""
    G = acc.shape[0]
    g = 0
    while g + 4 <= G:
        _ACC4(p, g, pj, vb, r0, n, acc)
        g += 4
    if R == 3:
        _ACC3(p, g, pj, vb, r0, n, acc)
    elif R == 2:
        _ACC2(p, g, pj, vb, r0, n, acc)
    elif R == 1:
        _ACC1(p, g, pj, vb, r0, n, acc)


@numba.njit(inline="always", **JIT)
def _prefetch_rows(a, r0, r1):
    """Prefetch rows r0 <= j < r1 of a 2-D C-contiguous array (contiguous memory)."""
    W = a.shape[1]
    for i in range(r0 * W, r1 * W, line_elems(a)):
        prefetch(a, i)


@numba.njit(inline="always", **JIT)
def _tile_scores(q, k, v, h, bt, b, t, n, t1, BS, s, R):
    """s[:, :n] = scores of tokens t .. t+n-1, block by block; meanwhile the K and V rows one
    block further on (up to t1) are prefetched, so their reads overlap this arithmetic (a
    tile further measured the same; no prefetch ~25% slower with the KV in L3)."""
    u = 0
    while u < n:
        blk, off = bt[b, (t + u) // BS], (t + u) % BS
        nb = min(BS - off, n - u)
        tn = t + u + BS
        pblk, poff, pn = blk, 0, 0
        if tn < t1:
            pblk, poff = bt[b, tn // BS], tn % BS
            pn = min(BS - poff, t1 - tn, nb)
        _dots_rows(q, k[blk, h], off, off + nb, s, u, k[pblk, h], v[pblk, h], poff, poff + pn, R)
        u += nb


@numba.njit(inline="always", **JIT)
def _tile_accumulate(p, v, h, bt, b, t, n, BS, acc, R):
    """acc += p[:, :n] · V of tokens t .. t+n-1, block by block."""
    u = 0
    while u < n:
        blk, off = bt[b, (t + u) // BS], (t + u) % BS
        nb = min(BS - off, n - u)
        _accumulate_rows(p, u, v[blk, h], off, nb, acc, R)
        u += nb
