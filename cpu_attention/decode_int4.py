"""int4 decode kernel (`decode_int4`): integer dot products over the 4-bit codes (`_simd_int4`).

Per tile (whole blocks, as bf16 / int8, `decode_tiles`): per block, q times the block's
per-channel key scales as int16 (q rounded once a step, the scales once a block, their product
by one pmulhrsw a vector; the zero points' share of the scores is one float per head), scored
against the codes widened in registers; per tile, the softmax weights times the tokens' value
scales rounded to VALUE_PIECES bytes per head, and the codes of quads of 4 tokens summed against
them in int32 by vpdpbusd (the zero points' share added per group of 32 channels). A block still
being filled is read from its bf16 tail by plain float loops. The output is rotated back (int4
V is stored rotated, `rotation.py`) after the merge, by the thread that merges.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import prange

from cpu_attention._numba import JIT, line_elems, prefetch, widen
from cpu_attention._simd import IVEC, VEC
from cpu_attention._simd_int4 import SUM_TOKENS, VALUE_PIECES, make_accumulate_int4, make_scores_int4, pair_order
from cpu_attention._simd_int4_factors import Q16, TINY, make_block_query, make_block_scales
from cpu_attention._simd_int4_weights import make_scales_copy, make_value_factors
from cpu_attention.decode_items import _claim_item, _empty_pairs, _finish_item, _keep_partial, _work_queue
from cpu_attention.decode_tiles import _softmax_tile, _tile_len
from cpu_attention.layout import INT4_GROUP

# int4 micro-kernels: integer dot products over the 4-bit codes (`_simd_int4`) and their integer
# factors (`_simd_int4_factors`, keys; `_simd_int4_weights`, values)
_I4SC1, _I4SC2, _I4SC3, _I4SC4 = (make_scores_int4(ng) for ng in (1, 2, 3, 4))
_I4ACC1, _I4ACC2, _I4ACC3, _I4ACC4 = (make_accumulate_int4(ng) for ng in (1, 2, 3, 4))
_I4BQ1, _I4BQ2, _I4BQ3, _I4BQ4 = (make_block_query(ng) for ng in (1, 2, 3, 4))
_block_scales, _value_factors, _scales_copy = make_block_scales(), make_value_factors(), make_scales_copy()
PAD_SCORE = np.float32(-1e30)  # a padding column's score: its softmax weight is 0
PREFETCH_BLOCKS = 4  # blocks ahead of the one being scored whose key and value codes go to L2 meanwhile


@numba.njit(**JIT)  # not inlined: once an item (the kernel compiles faster)
def _query16(qn, order, q16, qa):
    """q rounded once a step for `_key_factors`: q16[g] = round(qn[g] / qa[g]) in pair order
    (order = `_simd_int4.pair_order(D)`), qa[g] = max|qn[g]| / 32767 (1 for an all but zero row)."""
    for g in range(qn.shape[0]):
        mx = np.float32(0.0)
        for d in range(qn.shape[1]):
            mx = max(mx, abs(qn[g, d]))
        a = mx / Q16 if mx > TINY else np.float32(1.0)
        inv = np.float32(1.0) / a
        for p in range(qn.shape[1]):
            q16[g, p] = np.int16(np.rint(qn[g, order[p]] * inv))
        qa[g] = a


@numba.njit(inline="always", **JIT)
def _key_factors(q16, qa, qn, ks, kz, row, u16, zs, bsc, qp, qsc, qcon, R):
    """One block's query qp, qsc, qcon for all G heads (`make_block_scales`, then `make_block_query`
    in groups of four heads and R = G % 4 more), from q16, qa (`_query16`); u16, zs, bsc scratch."""
    _block_scales(ks, kz, row, u16, zs, bsc)
    G = qn.shape[0]
    g = 0
    while g + 4 <= G:
        _I4BQ4(q16, qa, u16, bsc, zs, qn, g, qp, qsc, qcon)
        g += 4
    if R == 3:
        _I4BQ3(q16, qa, u16, bsc, zs, qn, g, qp, qsc, qcon)
    elif R == 2:
        _I4BQ2(q16, qa, u16, bsc, zs, qn, g, qp, qsc, qcon)
    elif R == 1:
        _I4BQ1(q16, qa, u16, bsc, zs, qn, g, qp, qsc, qcon)


@numba.njit(inline="always", **JIT)
def _scores_int4(qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, R):
    """`make_scores_int4` for all G heads (groups of four, then R = G % 4 more): s[:, col + j] for
    the block's tokens off + j, j < nb (its keys at byte kb of k), prefetching bytes pk of k and pv
    of v (a later block's) into L2 and pv1 of v (the next block's) into L1 meanwhile."""
    G = qp.shape[0]
    g = 0
    while g + 4 <= G:
        _I4SC4(qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g)
        g += 4
    if R == 3:
        _I4SC3(qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g)
    elif R == 2:
        _I4SC2(qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g)
    elif R == 1:
        _I4SC1(qp, qsc, qcon, k, kb, BS, off, nb, v, pk, pv, pv1, s, col, g)


@numba.njit(inline="always", **JIT)
def _accumulate_quads_int4(wq, wsc, zsum, v, quads, nq, acc, R):
    """acc[g] += wsc[g] · Σ_c w[g, :, c] · code of column c + zsum[g] over the tile's nq quads of 4
    columns (their codes at byte quads[u] of v; per group of 32 channels), all G heads in groups of
    four (then R = G % 4 more)."""
    G = acc.shape[0]
    g = 0
    while g + 4 <= G:
        _I4ACC4(wq, wsc, zsum, g, v, quads, nq, acc)
        g += 4
    if R == 3:
        _I4ACC3(wq, wsc, zsum, g, v, quads, nq, acc)
    elif R == 2:
        _I4ACC2(wq, wsc, zsum, g, v, quads, nq, acc)
    elif R == 1:
        _I4ACC1(wq, wsc, zsum, g, v, quads, nq, acc)


@numba.njit(inline="always", **JIT)
def _prefetch_span(a, i0, n):
    """Prefetch the cache lines of a.flat[i0:i0 + n] (a C-contiguous)."""
    for i in range(i0, i0 + n, line_elems(a)):
        prefetch(a, i)


@numba.njit(**JIT)  # not inlined: once an item
def _prefetch_first(k, vflat, ks2, kz2, vs2, vz2, bt, b, h, t0, t1, Hkv, BS, kregion, vregion):
    """An item's first PREFETCH_BLOCKS blocks: their key and value codes and scales. The walk
    prefetches each later block while it scores the one PREFETCH_BLOCKS before it; without this
    the first blocks of every item come from DRAM on demand."""
    D, NG = ks2.shape[1], vs2.shape[1]
    for bi in range(t0 // BS, min(t0 // BS + PREFETCH_BLOCKS, (t1 + BS - 1) // BS)):
        bh = bt[b, bi] * Hkv + h
        _prefetch_span(k, bh * kregion, kregion)
        _prefetch_span(vflat, bh * vregion, vregion)
        _prefetch_span(ks2, bh * D, D)
        _prefetch_span(kz2, bh * D, D)
        _prefetch_span(vs2, bh * BS * NG, BS * NG)
        _prefetch_span(vz2, bh * BS * NG, BS * NG)


@numba.njit(**JIT)  # not inlined: a block's tail only (the kernel compiles faster)
def _tail_scores(qn, x, n, s, c):
    """s[:, c + j] = qn · x[j] for j < n, x [n, D] a tail's rows (uint16 bf16 bits). Plain loops, not
    the float micro-kernels: a tail is at most one block of a sequence, and those kernels' G
    variants would add ~9 s to this kernel's compile."""
    for j in range(n):
        xr = x[j]
        for g in range(qn.shape[0]):
            a = np.float32(0.0)
            for d in range(x.shape[1]):
                a += qn[g, d] * widen(xr[d])
            s[g, c + j] = a


@numba.njit(**JIT)  # not inlined: a block's tail only (the kernel compiles faster)
def _tail_values(s, c, x, n, acc):
    """acc[g] += Σ_j s[g, c + j] · x[j] for j < n (x as in `_tail_scores`)."""
    for j in range(n):
        xr = x[j]
        for g in range(acc.shape[0]):
            p = s[g, c + j]
            for d in range(x.shape[1]):
                acc[g, d] += p * widen(xr[d])


@numba.njit(parallel=True, **JIT)
def decode_int4(k, v, ks, kz, vs, vz, tk, tv, tail, q, scale, signs, P, rc, bt, items, order, pair_start, out, lse,
                rest, threads):
    """k [NB, Hkv, D/8, BS, 4] uint8 (`int4.py`'s VNNI key order) with ks, kz [NB, Hkv, D] uint16
    (bf16 bits: per block and channel); v [NB, Hkv, BS4/4, D/2, 4] uint8 holding V @ R in quads of
    4 tokens (`int4.py`'s VNNI value order; BS4 = BS rounded up to 4) with vs, vz [NB, Hkv, BS,
    D/32] (per token and group); a block b with tail[b] >= 0 is not complete and is read from
    the bf16 tails tk, tv [S, Hkv, BS, D] (uint16) instead; q [B, Hq, D] f32, times scale here;
    signs, P, rc: the rotation (`rotation.numba_args`); rest: `decode_tiles.rest_heads(G)`;
    threads: as `decode_float`'s. D % 32 == 0. Writes out [B, Hq, D], lse [B, Hq]: each
    (sequence, kv head) merged by the thread that finishes its last item (`_finish_item`).

    An item's first PREFETCH_BLOCKS blocks are prefetched as it is claimed (`_prefetch_first`).
    Per tile (whole blocks, as bf16 / int8): block by block, the key factors (`_key_factors`: q
    times the block's scales, as int16, from q16 made once per item by `_query16`) and the scores
    by integer dot products over the codes, W tokens a vector (`make_scores_int4`), or for a block
    read from its tail, plain float loops (`_tail_scores`); one `_softmax_tile` step; the value
    factors (`value_factors`: weights times the tokens' group scales, in VALUE_PIECES bytes) and
    the value sums over the whole tile in int32, a quad of 4 tokens at a time (`make_accumulate_int4`),
    their zero points' share added per group, a tail's rows by `_tail_values`. The tile's columns
    follow the quads: a block's tokens start at a column ≡ their offset mod 4 (offsets are 0 or a
    multiple of SUM_TOKENS), and a block that ends inside a quad leaves the rest of it as padding
    columns of weight 0. V's output Σ p (vR) = (Σ p v) R is rotated back after the merge, by the
    thread that merges."""
    R = len(rest)  # G % 4, a compile-time constant
    NI = items.shape[0]
    NB, Hkv, BQ, Hb, _ = v.shape
    BS = vs.shape[2]
    D = 2 * Hb
    kregion = BS * Hb  # bytes of one (block, head)'s key codes
    vregion = BQ * 4 * Hb  # and of its value codes (BS4 tokens)
    NG = D // INT4_GROUP
    G = q.shape[1] // Hkv
    TL = min(_tile_len(BS), SUM_TOKENS)  # (blocks of more than SUM_TOKENS tokens span tiles)
    TC = TL + 3 * (TL // BS + 2)  # columns: a tile's tokens and the padding that rounds each block to quads
    TLV = -(-TC // VEC) * VEC  # the value factors are computed VEC tokens at a time
    vflat = v.reshape(NB * Hkv * vregion)
    ks2, kz2 = ks.reshape(NB * Hkv, D), kz.reshape(NB * Hkv, D)  # row blk·Hkv + h
    vs2, vz2 = vs.reshape(NB * Hkv * BS, NG), vz.reshape(NB * Hkv * BS, NG)
    channels = pair_order(D)  # q16's channel order
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    NT, queue, done = _work_queue(threads, NI, pair_start)
    _empty_pairs(pair_start, G, out, lse)
    for _th in prange(NT):
        s = np.empty((G, max(TC + IVEC, TLV)), np.float32)  # a block's last score vector is stored whole
        qn = np.empty((G, D), np.float32)
        q16, qa = np.empty((G, D), np.int16), np.empty(G, np.float32)
        u16, zs, bsc = np.empty(D, np.int16), np.empty(D, np.float32), np.empty(1, np.float32)
        qp = np.empty((G, D), np.int16)
        qsc = np.empty(G, np.float32)
        qcon = np.empty(G, np.float32)
        vsc = np.empty((NG, TLV), np.float32)  # the tile's value scales and zeros, per group
        vzr = np.empty((NG, TLV), np.float32)
        wq = np.empty((VALUE_PIECES, G, NG, TLV), np.uint8)
        wsc = np.empty((G, NG), np.float32)
        zsum = np.empty((G, NG), np.float32)
        quads = np.empty(TC // 4 + 1, np.int64)  # the tile's value quads: byte offsets in vflat
        m = np.empty(G, np.float32)
        l = np.empty(G, np.float32)
        acc = np.empty((G, D), np.float32)
        tails = np.empty((TL, 4), np.int64)  # a tile's blocks read from their tails: (column, block, offset, tokens)
        tr = np.empty((D, G), np.float32)  # the output rotation's scratch (`_finish_item`)
        while True:
            it, b, h, t0, t1 = _claim_item(queue, order, items, m, l, acc)
            if it < 0:
                break
            for g in range(G):
                for d in range(D):
                    qn[g, d] = q[b, h * G + g, d] * scale
            _query16(qn, channels, q16, qa)
            _prefetch_first(k, vflat, ks2, kz2, vs2, vz2, bt, b, h, t0, t1, Hkv, BS, kregion, vregion)
            bi, off = t0 // BS, t0 % BS  # token t's block (its index in the table) and offset, walked without divisions
            nbt = (t1 + BS - 1) // BS  # the item's blocks end there
            t = t0
            while t < t1:
                n = min(TL, t1 - t)
                nt = 0
                u = 0  # tokens of the tile done
                c = 0  # its columns used (a multiple of 4 between blocks)
                while u < n:
                    blk = bt[b, bi]
                    nb = min(BS - off, n - u)
                    bh = blk * Hkv + h
                    r0 = bh * BS + off
                    nbi, noff = (bi + 1, 0) if off + nb == BS else (bi, off + nb)
                    pbh = bh  # the next block's scales now, its values while this one is scored
                    # the block PREFETCH_BLOCKS on: its codes, into L2
                    qbh = bt[b, bi + PREFETCH_BLOCKS] * Hkv + h if bi + PREFETCH_BLOCKS < nbt else bh
                    if t + u + nb < t1:
                        pbh = bt[b, nbi] * Hkv + h
                        pr = pbh * BS
                        if noff == 0:
                            _prefetch_span(ks2, pbh * D, D)
                            _prefetch_span(kz2, pbh * D, D)
                            _prefetch_span(vs2, pr * NG, BS * NG)
                            _prefetch_span(vz2, pr * NG, BS * NG)
                    nq = (nb + 3) // 4
                    for j in range(nq):
                        quads[c // 4 + j] = bh * vregion + (off // 4 + j) * 4 * Hb
                    if tail[blk] >= 0:
                        tails[nt, 0], tails[nt, 1], tails[nt, 2], tails[nt, 3] = c, blk, off, nb
                        nt += 1
                        _tail_scores(qn, tk[tail[blk], h, off:off + nb], nb, s, c)
                        for r in range(NG):  # its codes are stale: weight 0
                            for j in range(nb):
                                vsc[r, c + j] = 0.0
                                vzr[r, c + j] = 0.0
                    else:
                        _key_factors(q16, qa, qn, ks2, kz2, bh, u16, zs, bsc, qp, qsc, qcon, R)
                        _scores_int4(qp, qsc, qcon, k, bh * kregion, BS, off, nb, v, qbh * kregion, qbh * vregion,
                                     pbh * vregion, s, c, R)
                        _scales_copy(vs2, vz2, r0, nb, vsc, vzr, c)
                    for j in range(nb, 4 * nq):  # the quad's padding: weight 0
                        for g in range(G):
                            s[g, c + j] = PAD_SCORE
                        for r in range(NG):
                            vsc[r, c + j] = 0.0
                            vzr[r, c + j] = 0.0
                    bi, off = nbi, noff
                    u += nb
                    c += 4 * nq
                _softmax_tile(s, c, m, l, acc)
                _value_factors(s, vsc, vzr, c, wq, wsc, zsum)
                _accumulate_quads_int4(wq, wsc, zsum, vflat, quads, c // 4, acc, R)
                for i in range(nt):
                    tc, tb, to, tn = tails[i, 0], tails[i, 1], tails[i, 2], tails[i, 3]
                    _tail_values(s, tc, tv[tail[tb], h, to:to + tn], tn, acc)
                t += n
            _keep_partial(it, acc, m, l, part_o, part_m, part_l)
            _finish_item(b, h, pair_start, done, part_o, part_m, part_l, out, lse, signs, P, rc, tr)
