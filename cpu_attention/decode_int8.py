"""int8 decode kernels: `decode_int8` (head dims a multiple of the vector widths) and
`decode_int8_any` (any head dim), built from `decode_tiles`' steps.

Keys are scored in integers: q rounded to int16 per head (`_quantize_q`), x86 pmaddwd /
vpdpwssd against the int8 codes; the key token scales then multiply the scores and the value
token scales the weights, not the D codes. The weights times the value scales are rounded to
int16 per head (`_quantize_weights`) and the value sums taken in int32 as well
(`_simd.make_accumulate_int8`), INT_SUM_TOKENS tokens at most a pass. K and V are stored
rotated (`layout.py`): `decode_attention` rotates q before the kernel and the output back
after it, the kernel never sees R.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import prange

from cpu_attention._numba import JIT, bits_to_f32, f32_to_bits, prefetch
from cpu_attention._simd import DOT_TOKENS, from_madd_layout, make_accumulate_int8
from cpu_attention.decode_tiles import (
    NEG_INF, TILE, _accumulate, _keep_partial, merge_items, _next_tile, _scores, _softmax_tile, _tile_len, _tile_scores,
)

_IACC1, _IACC2, _IACC3, _IACC4 = (make_accumulate_int8(ng) for ng in (1, 2, 3, 4))
INT_SUM_TOKENS = 256  # tokens an int8 value pass sums in int32: 256 · 32767 · 127 < 2^31
Q16 = np.float32(32767.0)  # int16 levels of a quantized query's largest element
TINY = np.float32(1e-30)  # below this a row's int16 scale (max / 32767) would leave float32's normal range


@numba.njit(inline="always", **JIT)
def _accumulate_rows_int8(w16, wsc, pj, vb, r0, n, acc, R):
    """`_accumulate_rows` for int8 values and int16 weights (scales wsc [G]), acc in the madd layout."""
    G = acc.shape[0]
    g = 0
    while g + 4 <= G:
        _IACC4(w16, wsc, g, pj, vb, r0, n, acc)
        g += 4
    if R == 3:
        _IACC3(w16, wsc, g, pj, vb, r0, n, acc)
    elif R == 2:
        _IACC2(w16, wsc, g, pj, vb, r0, n, acc)
    elif R == 1:
        _IACC1(w16, wsc, g, pj, vb, r0, n, acc)


@numba.njit(inline="always", **JIT)
def _tile_accumulate_int8(w16, wsc, v, h, bt, b, t, n, BS, acc, R):
    """acc += wsc · (w16[:, :n] · V) of tokens t .. t+n-1, block by block, INT_SUM_TOKENS at most a pass."""
    u = 0
    while u < n:
        blk, off = bt[b, (t + u) // BS], (t + u) % BS
        nb = min(BS - off, n - u, INT_SUM_TOKENS)
        _accumulate_rows_int8(w16, wsc, u, v[blk, h], off, nb, acc, R)
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
def decode_int8(k, v, ks, vs, q, bt, items, pair_start, out, lse, rest):
    """k, v [NB, Hkv, BS, D] int8; ks, vs [NB, Hkv, BS] f32; rest as decode_float.
    Scores in integers (int16 q · int8 k, `_quantize_q`), then × q scale × token scale; the
    weights × the V token scales in int16 (`_quantize_weights`) and the value sums in integers
    too (`make_accumulate_int8`), into an accumulator in the madd layout. D % (2 IVEC) == 0
    and D % VEC == 0 (else `decode_int8_any`)."""
    R = len(rest)  # G % 4, a compile-time constant
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
            _tile_scores(q16, k, v, h, bt, b, t, n, t1, BS, s, R)
            for g in range(G):
                for j in range(n):
                    s[g, j] *= qsc[g] * ksc[j]
            _softmax_tile(s, n, m, l, acc)
            _quantize_weights(s, vsc, n, w16, wsc)
            _tile_accumulate_int8(w16, wsc, v, h, bt, b, t, n, BS, acc, R)
            t += n
        from_madd_layout(acc, part_o[it])
        _keep_partial(it, None, m, l, part_o, part_m, part_l)
    merge_items(pair_start, part_o, part_m, part_l, out, lse)


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
        _keep_partial(it, acc, m, l, part_o, part_m, part_l)
    merge_items(pair_start, part_o, part_m, part_l, out, lse)
