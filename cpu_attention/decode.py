"""Numba decode attention over the paged host KV pool (bf16, int8, int4), flash-decoding style.

Work split: a work item is (sequence b, kv head h, token range [t0, t1)). Items of one
(b, h) are consecutive; long sequences are cut into several ranges so batch 1 × 32k keeps
every core busy, and each item returns a partial (acc [G, D], running max m, sum l) that a
second parallel loop merges by log-sum-exp. All G = Hq / Hkv query heads of a kv head are
done together, so each K/V byte is read from DRAM once.

bf16 and int8, per tile (whole blocks, about TOKENS_PER_TILE tokens): the scores of all G
heads block by block into s [G, tile] (`_tile_scores`), one online-softmax step for the whole
tile (`_softmax_tile`: max, one rescale of the accumulator, a vectorized polynomial exp),
then the V accumulation block by block (`_tile_accumulate`). The two hot loops are vector
micro-kernels written as LLVM IR (`_simd.make_dots`, `make_accumulate`): a pass scores
DOT_TOKENS tokens × up to four heads with every partial sum in registers, reduced together
by a shuffle butterfly, and accumulates a block's tokens into up to four heads × a few
vectors of the accumulator held in registers. bf16 is widened by a shift into the high half;
int8 keys are scored in integers (q rounded to int16 per head, x86 pmaddwd / vpdpwssd), the
key token scales then multiply the scores and the value token scales the weights, not the
D codes. int8 K and V are stored rotated (`layout.py`): `decode_attention` rotates q before
the kernel and the output back after it, the kernel never sees R. While a block is scored,
the next block's rows are prefetched a few rows a pass.
Head dims that are not a multiple of the vector width go to `decode_*_any`: the same
algorithm one block a tile with LLVM's vectorized loops (`_scores`, `_accumulate`).

int4, per tile (whole blocks, as bf16 / int8), with integer dot products over the 4-bit codes
(`_simd_int4`): per block, q times the block's per-channel key scales rounded to int16 (the
zero points' share of the scores is one float per head), scored against the codes widened in
registers; per tile, the softmax weights times the tokens' value scales rounded to int16 per
head, and the codes of token pairs summed against them in int32 (the zero points' share added
per group of 32 channels). A block still being filled is read from its bf16 tail by the float
kernels. The output is rotated back (int4 V is stored rotated, `rotation.py`) once per
(sequence, head), after the merge.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from numba import prange

from cpu_attention import rotation
from cpu_attention._numba import (
    JIT, bits_to_f32, exp_neg, f32_to_bits, hadamard_unrotate, line_elems, prefetch, resolve_threads, rotate_rows,
    unrotate_rows, widen,
)
from cpu_attention._simd import (
    DOT_TOKENS, IVEC, VEC, from_madd_layout, from_pair_layout, make_accumulate, make_accumulate_int8, make_dots,
    to_pair_layout,
)
from cpu_attention._simd_int4 import (
    SUM_TOKENS, make_accumulate_int4, make_dots_int4, make_key_factors, make_scales_copy, make_value_factors,
)
from cpu_attention.layout import INT4_GROUP, HostKVPool, KVDtype
from cpu_attention.reference import decode_attention_ref

TILE = 32  # `decode_*_any`: tokens a tile
TOKENS_PER_TILE = 64  # bf16/int8/int4: tokens scored per online-softmax step (whole blocks)
ITEMS_PER_THREAD = 4  # equal-sized items per thread: balances Numba's static schedule
MIN_CHUNK = 256  # tokens; below this the merge and per-item setup start to show
NEG_INF = np.float32(-np.inf)


@numba.njit(nogil=True, cache=True)
def _plan(seq_lens, num_kv_heads, chunk):
    """Work items [NI, 4] = (b, h, t0, t1) and the first item of each (b, h) pair."""
    B = seq_lens.shape[0]
    n_items = 0
    for b in range(B):
        n_items += num_kv_heads * ((seq_lens[b] + chunk - 1) // chunk)
    items = np.empty((n_items, 4), np.int64)
    pair_start = np.empty(B * num_kv_heads + 1, np.int64)
    i = 0
    for b in range(B):
        n = seq_lens[b]
        for h in range(num_kv_heads):
            pair_start[b * num_kv_heads + h] = i
            t0 = 0
            while t0 < n:
                t1 = min(t0 + chunk, n)
                items[i, 0] = b
                items[i, 1] = h
                items[i, 2] = t0
                items[i, 3] = t1
                i += 1
                t0 = t1
    pair_start[B * num_kv_heads] = i
    return items, pair_start


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
    the floats do (negative floats' magnitude bits flipped): an integer max vectorizes, while a
    float one without fastmath's no-NaN flag stays a scalar chain of one compare per element."""
    mx = np.int32(-(2**31))
    for j in range(n):
        b = np.int32(f32_to_bits(x[j]))
        mx = max(mx, b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF)))
    return bits_to_f32(mx ^ ((mx >> np.int32(31)) & np.int32(0x7FFFFFFF))) if n > 0 else NEG_INF


@numba.njit(inline="always", **JIT)
def _softmax_tile(s, n, m, l, acc):
    """Online softmax step over a tile of n scores s [G, TILE] → weights in place; the running
    max m [G], sum l [G] and accumulator acc [G, D] are rescaled once per tile, not per token."""
    G, D = acc.shape
    for g in range(G):
        sg = s[g]
        mx = _row_max(sg, n)
        if mx > m[g]:
            corr = exp_neg(m[g] - mx)  # 0 while m is -inf
            l[g] *= corr
            ag = acc[g]
            for d in range(D):
                ag[d] *= corr
            m[g] = mx
        mg = m[g]
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
def _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse):
    """Merge the items of (b, h) = divmod(p, Hkv) into out[b, h*G:(h+1)*G], lse[...]."""
    Hkv = out.shape[1] // G
    b, h = p // Hkv, p % Hkv
    i0, i1 = pair_start[p], pair_start[p + 1]
    D = out.shape[2]
    for g in range(G):
        hq = h * G + g
        if i1 == i0:
            for d in range(D):
                out[b, hq, d] = 0.0
            lse[b, hq] = NEG_INF
            continue
        M = NEG_INF
        for i in range(i0, i1):
            M = max(M, part_m[i, g])
        L = np.float32(0.0)
        for d in range(D):
            out[b, hq, d] = 0.0
        for i in range(i0, i1):
            w = np.exp(part_m[i, g] - M)
            L += w * part_l[i, g]
            for d in range(D):
                out[b, hq, d] += w * part_o[i, g, d]
        inv = np.float32(1.0) / L
        for d in range(D):
            out[b, hq, d] *= inv
        lse[b, hq] = M + np.log(L)


# Vector micro-kernels for the bf16 / int8 paths (`_simd.make_dots` / `make_accumulate`),
# one specialization per head-group size; tiles span whole blocks.
_DOT1, _DOT2, _DOT3, _DOT4 = (make_dots(ng) for ng in (1, 2, 3, 4))
_ACC1, _ACC2, _ACC3, _ACC4 = (make_accumulate(ng) for ng in (1, 2, 3, 4))
_IACC1, _IACC2, _IACC3, _IACC4 = (make_accumulate_int8(ng) for ng in (1, 2, 3, 4))
INT_SUM_TOKENS = 256  # tokens an int8 value pass sums in int32: 256 · 32767 · 127 < 2^31
Q16 = np.float32(32767.0)  # int16 levels of a quantized query's largest element
TINY = np.float32(1e-30)  # below this a row's int16 scale (max / 32767) would leave float32's normal range


@numba.njit(inline="always", **JIT)
def _tile_len(BS):
    """Tokens of a tile: whole blocks, about TOKENS_PER_TILE."""
    return max(TOKENS_PER_TILE // BS, 1) * BS


@numba.njit(inline="always", **JIT)
def _dots_rows(q, kb, r0, r1, s, sj, pk, pv, p0, p1):
    """s[:, sj + j - r0] = q · kb[j] for rows r0 <= j < r1 of one block, all G heads: heads in
    groups of four (then 3, 2 or 1), DOT_TOKENS tokens a pass, the pass's K rows reused by every
    group from L1. q int16 (and kb int8): integer scores, unscaled. Each pass also prefetches
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
        r = G - g
        if r == 3:
            _DOT3(q, g, kb, j, r1, s, c)
        elif r == 2:
            _DOT2(q, g, kb, j, r1, s, c)
        elif r == 1:
            _DOT1(q, g, kb, j, r1, s, c)


@numba.njit(inline="always", **JIT)
def _accumulate_rows(p, pj, vb, r0, n, acc):
    """acc[g] += Σ_t p[g, pj + t] · vb[r0 + t] for t < n (rows of one block), all G heads in
    groups of four (then 3, 2 or 1)."""
    G = acc.shape[0]
    g = 0
    while g + 4 <= G:
        _ACC4(p, g, pj, vb, r0, n, acc)
        g += 4
    r = G - g
    if r == 3:
        _ACC3(p, g, pj, vb, r0, n, acc)
    elif r == 2:
        _ACC2(p, g, pj, vb, r0, n, acc)
    elif r == 1:
        _ACC1(p, g, pj, vb, r0, n, acc)


@numba.njit(inline="always", **JIT)
def _prefetch_rows(a, r0, r1):
    """Prefetch rows r0 <= j < r1 of a 2-D C-contiguous array (contiguous memory)."""
    W = a.shape[1]
    for i in range(r0 * W, r1 * W, line_elems(a)):
        prefetch(a, i)


@numba.njit(inline="always", **JIT)
def _tile_scores(q, k, v, h, bt, b, t, n, t1, BS, s):
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
        _dots_rows(q, k[blk, h], off, off + nb, s, u, k[pblk, h], v[pblk, h], poff, poff + pn)
        u += nb


@numba.njit(inline="always", **JIT)
def _tile_accumulate(p, v, h, bt, b, t, n, BS, acc):
    """acc += p[:, :n] · V of tokens t .. t+n-1, block by block."""
    u = 0
    while u < n:
        blk, off = bt[b, (t + u) // BS], (t + u) % BS
        nb = min(BS - off, n - u)
        _accumulate_rows(p, u, v[blk, h], off, nb, acc)
        u += nb


@numba.njit(inline="always", **JIT)
def _accumulate_rows_int8(w16, wsc, pj, vb, r0, n, acc):
    """`_accumulate_rows` for int8 values and int16 weights (scales wsc [G]), acc in the madd layout."""
    G = acc.shape[0]
    g = 0
    while g + 4 <= G:
        _IACC4(w16, wsc, g, pj, vb, r0, n, acc)
        g += 4
    r = G - g
    if r == 3:
        _IACC3(w16, wsc, g, pj, vb, r0, n, acc)
    elif r == 2:
        _IACC2(w16, wsc, g, pj, vb, r0, n, acc)
    elif r == 1:
        _IACC1(w16, wsc, g, pj, vb, r0, n, acc)


@numba.njit(inline="always", **JIT)
def _tile_accumulate_int8(w16, wsc, v, h, bt, b, t, n, BS, acc):
    """acc += wsc · (w16[:, :n] · V) of tokens t .. t+n-1, block by block, INT_SUM_TOKENS at most a pass."""
    u = 0
    while u < n:
        blk, off = bt[b, (t + u) // BS], (t + u) % BS
        nb = min(BS - off, n - u, INT_SUM_TOKENS)
        _accumulate_rows_int8(w16, wsc, u, v[blk, h], off, nb, acc)
        u += nb


@numba.njit(inline="always", **JIT)
def _quantize_weights(p, vsc, n, w16, wsc):
    """w16[g, j] = round(p[g, j] vsc[j] / wsc[g]) for j < n, wsc[g] = max_j p[g, j] vsc[j] / 32767:
    a tile's softmax weights times the value token scales as int16 per head (relative error
    ≤ 2^-16 of the tile's largest weight), for the integer value sums."""
    G = p.shape[0]
    for g in range(G):
        mx = np.uint32(0)
        for j in range(n):  # the weights are >= 0, so their bits order as they do: a max that vectorizes
            mx = max(mx, f32_to_bits(p[g, j] * vsc[j]))
        wmax = bits_to_f32(mx)
        # a tile ~70 below the running max (or empty): weights of 1e-30 and less become 0 rather
        # than scaled by an overflowing 1 / wsc
        sc = wmax / Q16 if wmax > TINY else np.float32(1.0)
        wsc[g] = sc
        inv = np.float32(1.0) / sc
        for j in range(n):
            w16[g, j] = np.int16(np.rint(p[g, j] * vsc[j] * inv))


@numba.njit(inline="always", **JIT)
def _quantize_q(qh, q16, qsc):
    """q16[g] = round(qh[g] / qsc[g]) with qsc[g] = max|qh[g]| / 32767: int16 queries for the
    integer scores (relative error ≤ 2^-16 of the largest element, far below int8 K's)."""
    G, D = qh.shape
    for g in range(G):
        mx = np.float32(0.0)
        for d in range(D):
            mx = max(mx, abs(qh[g, d]))
        sc = mx / Q16 if mx > TINY else np.float32(1.0)
        qsc[g] = sc
        inv = np.float32(1.0) / sc
        for d in range(D):
            q16[g, d] = np.int16(np.rint(qh[g, d] * inv))


@numba.njit(parallel=True, **JIT)
def decode_float(k, v, q, bt, items, pair_start, out, lse):
    """k, v [NB, Hkv, BS, D] uint16 (bf16 bits); q [B, Hq, D] f32 pre-scaled;
    bt [B, MB]; items/pair_start from _plan; writes out [B, Hq, D], lse [B, Hq].
    D % VEC == 0 (else `decode_float_any`). q and the accumulator are kept in the pair layout
    in which bf16 rows are widened (`_simd.to_pair_layout`)."""
    NI = items.shape[0]
    BS, D = k.shape[2], k.shape[3]
    G = q.shape[1] // k.shape[1]
    TL = _tile_len(BS)
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    for it in prange(NI):
        b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        s = np.empty((G, TL + DOT_TOKENS), np.float32)
        m = np.full(G, NEG_INF, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, D), np.float32)  # pair layout, as qh
        qh = np.empty((G, D), np.float32)
        to_pair_layout(q[b, h * G:(h + 1) * G], qh)
        t = t0
        while t < t1:
            n = min(TL, t1 - t)
            _tile_scores(qh, k, v, h, bt, b, t, n, t1, BS, s)
            _softmax_tile(s, n, m, l, acc)
            _tile_accumulate(s, v, h, bt, b, t, n, BS, acc)
            t += n
        from_pair_layout(acc, part_o[it])
        part_m[it] = m
        part_l[it] = l
    for p in prange(pair_start.shape[0] - 1):
        _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)


@numba.njit(parallel=True, **JIT)
def decode_int8(k, v, ks, vs, q, bt, items, pair_start, out, lse):
    """k, v [NB, Hkv, BS, D] int8; ks, vs [NB, Hkv, BS] f32; rest as decode_float.
    Scores in integers (int16 q · int8 k, `_quantize_q`), then × q scale × token scale; the
    weights × the V token scales in int16 (`_quantize_weights`) and the value sums in integers
    too (`make_accumulate_int8`), into an accumulator in the madd layout. D % (2 IVEC) == 0
    and D % VEC == 0 (else `decode_int8_any`)."""
    NI = items.shape[0]
    BS, D = k.shape[2], k.shape[3]
    G = q.shape[1] // k.shape[1]
    TL = _tile_len(BS)
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    for it in prange(NI):
        b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        s = np.empty((G, TL + DOT_TOKENS), np.float32)
        w16 = np.empty((G, TL), np.int16)
        wsc = np.empty(G, np.float32)
        ksc = np.empty(TL, np.float32)
        vsc = np.empty(TL, np.float32)
        q16 = np.empty((G, D), np.int16)
        qsc = np.empty(G, np.float32)
        m = np.full(G, NEG_INF, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, D), np.float32)  # madd layout
        _quantize_q(q[b, h * G:(h + 1) * G], q16, qsc)
        t = t0
        while t < t1:
            n = min(TL, t1 - t)
            u = 0
            while u < n:  # the tile's token scales, contiguous; the next tile's are prefetched
                blk, off = bt[b, (t + u) // BS], (t + u) % BS
                nb = min(BS - off, n - u)
                for j in range(nb):
                    ksc[u + j] = ks[blk, h, off + j]
                    vsc[u + j] = vs[blk, h, off + j]
                tn = t + n + u
                if tn < t1:
                    prefetch(ks[bt[b, tn // BS], h], tn % BS)
                    prefetch(vs[bt[b, tn // BS], h], tn % BS)
                u += nb
            _tile_scores(q16, k, v, h, bt, b, t, n, t1, BS, s)
            for g in range(G):
                for j in range(n):
                    s[g, j] *= qsc[g] * ksc[j]
            _softmax_tile(s, n, m, l, acc)
            _quantize_weights(s, vsc, n, w16, wsc)
            _tile_accumulate_int8(w16, wsc, v, h, bt, b, t, n, BS, acc)
            t += n
        from_madd_layout(acc, part_o[it])
        part_m[it] = m
        part_l[it] = l
    for p in prange(pair_start.shape[0] - 1):
        _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)


@numba.njit(parallel=True, **JIT)
def decode_float_any(k, v, q, bt, items, pair_start, out, lse):
    """`decode_float` for any head dim: one block a tile, LLVM's vectorized loops (`_scores`,
    `_accumulate`) instead of the vector micro-kernels."""
    NI = items.shape[0]
    BS, D = k.shape[2], k.shape[3]
    G = q.shape[1] // k.shape[1]
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    for it in prange(NI):
        b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        s = np.empty((G, TILE), np.float32)
        m = np.full(G, NEG_INF, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, D), np.float32)
        qh = q[b, h * G:(h + 1) * G]
        t = t0
        blk, off, n = _next_tile(bt, b, t, t1, BS)
        while t < t1:
            nblk, noff, nn = _next_tile(bt, b, t + n, t1, BS) if t + n < t1 else (blk, off, 0)
            _scores(qh, k[blk, h, off:off + n], n, s, k[nblk, h, noff:], v[nblk, h, noff:], nn)
            _softmax_tile(s, n, m, l, acc)
            _accumulate(s, v[blk, h, off:off + n], n, acc)
            t += n
            blk, off, n = nblk, noff, nn
        part_o[it] = acc
        part_m[it] = m
        part_l[it] = l
    for p in prange(pair_start.shape[0] - 1):
        _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)


@numba.njit(parallel=True, **JIT)
def decode_int8_any(k, v, ks, vs, q, bt, items, pair_start, out, lse):
    """`decode_int8` for any head dim: float scores, one block a tile, as `decode_float_any`."""
    NI = items.shape[0]
    BS, D = k.shape[2], k.shape[3]
    G = q.shape[1] // k.shape[1]
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    for it in prange(NI):
        b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        s = np.empty((G, TILE), np.float32)
        pw = np.empty((G, TILE), np.float32)
        m = np.full(G, NEG_INF, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, D), np.float32)
        qh = q[b, h * G:(h + 1) * G]
        t = t0
        blk, off, n = _next_tile(bt, b, t, t1, BS)
        while t < t1:
            nblk, noff, nn = _next_tile(bt, b, t + n, t1, BS) if t + n < t1 else (blk, off, 0)
            if noff == 0 and nn > 0:
                prefetch(ks[nblk, h], 0)
                prefetch(vs[nblk, h], 0)
            _scores(qh, k[blk, h, off:off + n], n, s, k[nblk, h, noff:], v[nblk, h, noff:], nn)
            ksc, vsc = ks[blk, h, off:off + n], vs[blk, h, off:off + n]
            for g in range(G):
                for j in range(n):
                    s[g, j] *= ksc[j]
            _softmax_tile(s, n, m, l, acc)
            for g in range(G):
                for j in range(n):
                    pw[g, j] = s[g, j] * vsc[j]
            _accumulate(pw, v[blk, h, off:off + n], n, acc)
            t += n
            blk, off, n = nblk, noff, nn
        part_o[it] = acc
        part_m[it] = m
        part_l[it] = l
    for p in prange(pair_start.shape[0] - 1):
        _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)


# int4 micro-kernels (`_simd_int4`): integer dot products over the 4-bit codes
_I4DOT1, _I4DOT2, _I4DOT3, _I4DOT4 = (make_dots_int4(ng) for ng in (1, 2, 3, 4))
_I4ACC1, _I4ACC2, _I4ACC3, _I4ACC4 = (make_accumulate_int4(ng) for ng in (1, 2, 3, 4))
_I4KF1, _I4KF2, _I4KF3, _I4KF4 = (make_key_factors(ng) for ng in (1, 2, 3, 4))
_value_factors, _scales_copy = make_value_factors(), make_scales_copy()


@numba.njit(inline="always", **JIT)
def _key_factors(qn, ks, kz, row, q16, qsc, qcon):
    """`make_key_factors` for all G heads: groups of four, then 3, 2 or 1."""
    G = qn.shape[0]
    g = 0
    while g + 4 <= G:
        _I4KF4(qn, g, ks, kz, row, q16, qsc, qcon)
        g += 4
    r = G - g
    if r == 3:
        _I4KF3(qn, g, ks, kz, row, q16, qsc, qcon)
    elif r == 2:
        _I4KF2(qn, g, ks, kz, row, q16, qsc, qcon)
    elif r == 1:
        _I4KF1(qn, g, ks, kz, row, q16, qsc, qcon)


@numba.njit(inline="always", **JIT)
def _dots_rows_int4(q16, kb, r0, r1, s, sj, qsc, qcon, pk, pv, p0, p1):
    """`_dots_rows` for packed int4 key rows kb [BS, D/2]: s[:, sj + j - r0] = qsc · (q16 · codes of
    kb[j]) + qcon for r0 <= j < r1, all G heads, prefetching rows p0.. < p1 of pk and pv meanwhile."""
    G = q16.shape[0]
    for j in range(r0, r1, DOT_TOKENS):
        pj = p0 + j - r0
        pe = min(pj + DOT_TOKENS, p1)
        if pj < pe:
            _prefetch_rows(pk, pj, pe)
            _prefetch_rows(pv, pj, pe)
        c = sj + j - r0
        g = 0
        while g + 4 <= G:
            _I4DOT4(q16, g, kb, j, r1, s, c, qsc, qcon)
            g += 4
        r = G - g
        if r == 3:
            _I4DOT3(q16, g, kb, j, r1, s, c, qsc, qcon)
        elif r == 2:
            _I4DOT2(q16, g, kb, j, r1, s, c, qsc, qcon)
        elif r == 1:
            _I4DOT1(q16, g, kb, j, r1, s, c, qsc, qcon)


@numba.njit(inline="always", **JIT)
def _accumulate_rows_int4(w16, wsc, zsum, v, rows, n, acc):
    """acc[g] += wsc[g] · Σ_t w16[g, :, t] · codes of v[rows[t]] + zsum[g] for t < n (per group of 32
    channels), all G heads in groups of four (then 3, 2 or 1)."""
    G = acc.shape[0]
    g = 0
    while g + 4 <= G:
        _I4ACC4(w16, wsc, zsum, g, v, rows, n, acc)
        g += 4
    r = G - g
    if r == 3:
        _I4ACC3(w16, wsc, zsum, g, v, rows, n, acc)
    elif r == 2:
        _I4ACC2(w16, wsc, zsum, g, v, rows, n, acc)
    elif r == 1:
        _I4ACC1(w16, wsc, zsum, g, v, rows, n, acc)


@numba.njit(inline="always", **JIT)
def _prefetch_span(a, i0, n):
    """Prefetch the cache lines of a.flat[i0:i0 + n] (a C-contiguous)."""
    for i in range(i0, i0 + n, line_elems(a)):
        prefetch(a, i)


@numba.njit(inline="always", **JIT)
def _widen_rows(x, n, out):
    """Rows x [n, D] (uint16 bf16 bits) → out[:n] float32."""
    for j in range(n):
        xr, o = x[j], out[j]
        for d in range(x.shape[1]):
            o[d] = widen(xr[d])


@numba.njit(parallel=True, **JIT)
def decode_int4(k, v, ks, kz, vs, vz, tk, tv, tail, q, bt, items, pair_start, out, lse, signs, P, c):
    """k [NB, Hkv, BS, D/2] uint8 with ks, kz [NB, Hkv, D] uint16 (bf16 bits: per block and
    channel); v [NB, Hkv, BS, D/2] uint8 holding V @ R with vs, vz [NB, Hkv, BS, D/32] (per
    token and group); a block b with tail[b] >= 0 is not complete and is read from the bf16
    tails tk, tv [S, Hkv, BS, D] (uint16) instead; q [B, Hq, D] f32 pre-scaled; signs, P, c:
    the rotation R (`_numba.hadamard_unrotate`). D % 32 == 0.

    Per tile (whole blocks, as bf16 / int8): block by block, the key factors (`key_factors`: q
    times the block's scales, as int16) and the scores by integer dot products over the codes
    (`make_dots_int4`), or for a block read from its tail, widened rows and the float kernels;
    one `_softmax_tile` step; the value factors (`value_factors`: weights times the tokens' group
    scales, as int16) and the value sums over the whole tile in int32 (`make_accumulate_int4`),
    their zero points' share added per group, a tail's rows by the float kernel. V's output
    Σ p (vR) = (Σ p v) R is rotated back once per (sequence, head), after the merge."""
    NI = items.shape[0]
    NB, Hkv, BS, Hb = k.shape
    D = 2 * Hb
    NG = D // INT4_GROUP
    G = q.shape[1] // Hkv
    TL = min(_tile_len(BS), SUM_TOKENS)  # (blocks of more than SUM_TOKENS tokens span tiles)
    TLV = -(-TL // VEC) * VEC  # the value factors are computed VEC tokens at a time
    # rows and per-block vectors by index, not by views (each view is a reference count update)
    krows, vrows = k.reshape(NB * Hkv * BS, Hb), v.reshape(NB * Hkv * BS, Hb)  # row (blk·Hkv + h)·BS + off
    ks2, kz2 = ks.reshape(NB * Hkv, D), kz.reshape(NB * Hkv, D)  # row blk·Hkv + h
    vs2, vz2 = vs.reshape(NB * Hkv * BS, NG), vz.reshape(NB * Hkv * BS, NG)
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    for it in prange(NI):
        b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        s = np.empty((G, max(TL + DOT_TOKENS, TLV)), np.float32)
        qn = np.empty((G, D), np.float32)
        for g in range(G):
            for d in range(D):
                qn[g, d] = q[b, h * G + g, d]
        q16 = np.empty((G, D), np.int16)
        qsc = np.empty(G, np.float32)
        qcon = np.empty(G, np.float32)
        vsc = np.empty((NG, TLV), np.float32)  # the tile's value scales and zeros, per group
        vzr = np.empty((NG, TLV), np.float32)
        w16 = np.empty((G, NG, TLV), np.int16)
        wsc = np.empty((G, NG), np.float32)
        zsum = np.empty((G, NG), np.float32)
        rows = np.empty(TL, np.int64)
        rf = np.empty((BS, D), np.float32)  # a tail's rows, widened
        m = np.full(G, NEG_INF, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, D), np.float32)
        t = t0
        while t < t1:
            n = min(TL, t1 - t)
            tails = False
            u = 0
            while u < n:
                blk, off = bt[b, (t + u) // BS], (t + u) % BS
                nb = min(BS - off, n - u)
                bh = blk * Hkv + h
                tn = t + u + nb  # the next block's first token
                pr, pn = 0, 0
                if tn < t1:  # the next block: its scales now, its rows while this block is scored
                    pbh = bt[b, tn // BS] * Hkv + h
                    pr, pn = pbh * BS, min(BS, t1 - tn, nb)
                    _prefetch_span(ks2, pbh * D, D)
                    _prefetch_span(kz2, pbh * D, D)
                    _prefetch_span(vs2, pr * NG, BS * NG)
                    _prefetch_span(vz2, pr * NG, BS * NG)
                r0 = bh * BS + off
                for j in range(nb):
                    rows[u + j] = r0 + j
                if tail[blk] >= 0:
                    tails = True
                    _widen_rows(tk[tail[blk], h, off:off + nb], nb, rf)
                    _dots_rows(qn, rf, 0, nb, s, u, rf, rf, 0, 0)
                    for r in range(NG):  # its codes are stale: weight 0
                        for j in range(nb):
                            vsc[r, u + j] = 0.0
                            vzr[r, u + j] = 0.0
                else:
                    _key_factors(qn, ks2, kz2, bh, q16, qsc, qcon)
                    _dots_rows_int4(q16, krows, r0, r0 + nb, s, u, qsc, qcon, krows, vrows, pr, pr + pn)
                    _scales_copy(vs2, vz2, r0, nb, vsc, vzr, u)
                u += nb
            _softmax_tile(s, n, m, l, acc)
            _value_factors(s, vsc, vzr, n, w16, wsc, zsum)
            _accumulate_rows_int4(w16, wsc, zsum, vrows, rows, n, acc)
            u = 0
            while tails and u < n:
                blk, off = bt[b, (t + u) // BS], (t + u) % BS
                nb = min(BS - off, n - u)
                if tail[blk] >= 0:
                    _widen_rows(tv[tail[blk], h, off:off + nb], nb, rf)
                    _accumulate_rows(s, u, rf, 0, nb, acc)
                u += nb
            t += n
        part_o[it] = acc
        part_m[it] = m
        part_l[it] = l
    for p in prange(pair_start.shape[0] - 1):
        _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)
        for g in range(G):
            hadamard_unrotate(out[p // Hkv, (p % Hkv) * G + g], signs, P, c)


def _numpy(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """t as a C-contiguous numpy array of dtype (no copy when it is one already)."""
    if t.dtype != dtype or not t.is_contiguous() or t.requires_grad:
        t = t.detach().to(dtype).contiguous()
    return t.numpy()


@functools.lru_cache(maxsize=16)
def _work_items(seq_lens: tuple[int, ...], num_kv_heads: int, block_size: int, threads: int):
    """_plan's (items, pair_start) for these lengths, memoized: a decode step calls the kernel
    once per layer with the same lengths. The arrays are shared: read them only."""
    sl = np.array(seq_lens, np.int64)
    return _plan(sl, num_kv_heads, chunk_tokens(sl, num_kv_heads, block_size, threads))


def chunk_tokens(seq_lens: np.ndarray, num_kv_heads: int, block_size: int, threads: int) -> int:
    """Token range of one work item: ~ITEMS_PER_THREAD items a thread, block-aligned.

    Numba's static schedule gives each thread an equal count of items, so the chunk is then
    shrunk (a few steps at most) until the longest sequence splits into equal pieces and the
    item count is a multiple of `threads`: 2048 tokens × 3 kv heads on 2 threads as 9 items
    of ≤ 768 tokens leave one thread 3584 token-heads and the other 2560; 12 of 512 split evenly."""
    lens = seq_lens.tolist()
    total, longest = sum(lens) * num_kv_heads, max(lens, default=0)
    if longest == 0:
        return block_size
    chunk = max(-(-total // (ITEMS_PER_THREAD * threads)), MIN_CHUNK)
    p0 = max(-(-longest // chunk), 1)  # pieces of the longest sequence
    first = None
    for p in range(p0, p0 + threads):
        c = -(-(-(-longest // p)) // block_size) * block_size  # ceil(longest / p), block-aligned
        if p > p0 and c < MIN_CHUNK:
            break
        first = first or c
        if (num_kv_heads * sum(-(-n // c) for n in lens)) % threads == 0:
            return c
    return first


class DecodeWork:
    """What one decode step's host-tier attention needs besides q, computed once and reused by
    every layer: block tables and lengths as numpy, the work items, the thread count."""

    def __init__(self, pool: HostKVPool, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 threads: int | None = None):
        self.threads = resolve_threads(threads)
        self.bt = block_tables.detach().to(torch.int32).contiguous().numpy()  # [B, max_blocks]
        self.lens = seq_lens.detach().to(torch.int64).contiguous().numpy()  # [B]
        self.items, self.pair_start = _work_items(tuple(self.lens.tolist()), pool.num_kv_heads, pool.block_size,
                                                  self.threads)


def decode_attention(
    pool: HostKVPool,
    layer: int,
    q: torch.Tensor,  # [B, Hq, D]
    block_tables: torch.Tensor | None,  # [B, max_blocks] int32 (None: given by work)
    seq_lens: torch.Tensor | None,  # [B]
    scale: float,
    threads: int | None = None,
    work: DecodeWork | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per sequence over its host-tier tokens → (out [B,Hq,D] f32, lse [B,Hq] f32).

    work: the step's DecodeWork (tables, lengths, threads), so the layers of one step share it;
    out: float32 tensors [B, Hq, D], [B, Hq] to write into (e.g. pinned staging buffers).
    Safe to call from a worker thread: the kernel runs without the GIL.
    """
    B, Hq, D = q.shape
    Hkv = pool.num_kv_heads
    if D != pool.head_dim or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool (Hkv {Hkv}, D {pool.head_dim})")
    if pool.dtype is KVDtype.F32:  # exact pools exist for checks: the twin is enough
        if work is not None:
            block_tables, seq_lens = torch.from_numpy(work.bt), torch.from_numpy(work.lens)
        o, lse = decode_attention_ref(pool, layer, q, block_tables, seq_lens, scale)
        if out is None:
            return o, lse
        out[0].copy_(o)
        out[1].copy_(lse)
        return out
    # numpy, not torch, between the caller and the kernel: this runs once per layer and
    # decode step, and each small torch op costs microseconds
    if work is None:
        bt = _numpy(block_tables, torch.int32)
        items, pair_start = _work_items(tuple(seq_lens.tolist()), Hkv, pool.block_size, resolve_threads(threads))
    else:
        resolve_threads(work.threads)  # thread counts are per calling thread in Numba
        bt, items, pair_start = work.bt, work.items, work.pair_start
    qn = _numpy(q, torch.float32) * np.float32(scale)
    if out is None:
        out = (torch.empty((B, Hq, D), dtype=torch.float32), torch.empty((B, Hq), dtype=torch.float32))
    on, ln = out[0].numpy(), out[1].numpy()
    a = pool.arrays
    if pool.dtype is KVDtype.BF16:
        kernel = decode_float if D % VEC == 0 else decode_float_any
        kernel(a["k"][layer], a["v"][layer], qn, bt, items, pair_start, on, ln)
    elif pool.dtype is KVDtype.INT8:  # K and V stored rotated: q · k = (q R) · (k R), Σ p (v R) = (Σ p v) R
        rot = rotation.numba_args(D)
        rotate_rows(qn.reshape(-1, D), *rot)
        kernel = decode_int8 if D % VEC == 0 and D % (2 * IVEC) == 0 else decode_int8_any
        kernel(a["k"][layer], a["v"][layer], a["k_scale"][layer], a["v_scale"][layer], qn, bt, items, pair_start,
               on, ln)
        unrotate_rows(on.reshape(-1, D), *rot)
    else:
        t = pool.tails.arrays
        decode_int4(a["k"][layer], a["v"][layer], a["k_scale"][layer], a["k_zero"][layer], a["v_scale"][layer],
                    a["v_zero"][layer], t["k"], t["v"], t["slot"][layer], qn, bt, items, pair_start, on, ln,
                    *rotation.numba_args(D))
    return out
