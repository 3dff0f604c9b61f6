"""int8 decode kernels: `decode_int8` (vpdpbusd over the pool's VNNI byte order: head dims and
block sizes a multiple of the vector width) and `decode_int8_any` (any head dim % 4 == 0 and
block size), built from `decode_tiles`' steps.

Both scores and value sums are exact integer sums (`_simd_vnni`): q rounded to 16 bits per head
and split in two signed bytes (`_split_q`); a tile's softmax weights times the value token
scales rounded to one unsigned byte per head against the tile's largest (`_softmax_split`). The
key token scales multiply the scores, W tokens a vector, inside the score kernel. K and V are
stored rotated (`layout.py`): `decode_int8` rotates each (sequence, kv head)'s q rows once, as
its threads start, and the pair's output as it merges it, inside its one parallel region; for
`decode_int8_any` `DecodeWork.run` does both, before the kernel and after it. Where the CPU has
AMX, from `TILE_MIN_HEADS` query rows a kv head on (a speculative run's), the scores and value
sums are tile products instead (`_amx`, `_tiles_step`), the rest the same.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import prange

from cpu_attention._amx import ROWS, TILES, release, scores_tiles, values_tiles
from cpu_attention._numba import (
    JIT, arrive, bits_to_f32, claim, exp_neg, f32_to_bits, load_acquire, prefetch, prefetch_l2,
)
from cpu_attention._hadamard import hadamard_rows
from cpu_attention._simd_vnni import W_LANES, make_scores, make_values
from cpu_attention.decode_items import (
    NEG_INF, _claim_item, _empty_pairs, _finish_item, _keep_partial, _work_queue, merge_items,
)
from cpu_attention.decode_tiles import TILE, _key, _next_tile, _raise_max, _raise_to, _softmax_tile, _unkey

_SC1, _SC2, _SC3, _SC4 = (make_scores(ng) for ng in (1, 2, 3, 4))
_VA1, _VA2, _VA3, _VA4 = (make_values(ng) for ng in (1, 2, 3, 4))
W = W_LANES  # tokens a score chunk, channels a value chunk
INT8_TILE = 128  # tokens an online-softmax step (whole blocks)
# blocks ahead of the one being scored whose K, V and token scales are prefetched (1, 2, 4 and 8
# measured on the GPU host: none stood out of the run-to-run spread, bench/RESULTS.md)
PREFETCH_BLOCKS = 4
Q16 = np.float32(32000.0)  # levels of a quantized query's largest element: hi = (x + 128) >> 8 stays in int8
W8 = np.float32(255.0)  # levels of a tile's largest weight (one unsigned byte)
TINY = np.float32(1e-30)  # below this a row's 16-bit scale (max / levels) would leave float32's normal range
# query rows a kv head from which `decode_int8` takes AMX tile products (`_amx`) where the CPU has them
# (None: never): at 32 (a run of 8 rows of 4 heads) 0-10% faster on the GPU host, at 16 up to 18% slower,
# at 4 17-44% slower (bench/RESULTS.md)
TILE_MIN_HEADS = 32 if TILES else None


def use_tiles(G: int, D: int, BS: int) -> bool:
    """Whether `decode_int8` attends G query rows a kv head with tile products (`TILE_MIN_HEADS`;
    the tiles' shapes: D % 64 == 0, BS % 16 == 0, BS <= 64; score chunks of 16 tokens)."""
    return (TILE_MIN_HEADS is not None and G >= TILE_MIN_HEADS and W == 16 and D % 64 == 0 and BS % 16 == 0
            and BS <= 64)


@numba.njit(inline="always", **JIT)
def _split_q(qh, qp, qc, qsc):
    """x = round(qh[g] / qsc[g]) with qsc[g] = max|qh[g]| / Q16, as x = 256 hi + lo with hi, lo
    int8 (qp[0, g], qp[1, g]); qc[p, g] = -128 Σ_d qp[p, g, d] (the score kernel's start, which
    pays back reading the keys as unsigned). Relative error ≤ 2^-16 of the largest element."""
    G, D = qh.shape
    for g in range(G):
        mx = np.float32(0.0)
        for d in range(D):
            mx = max(mx, abs(qh[g, d]))
        sc = mx / Q16 if mx > TINY else np.float32(1.0)
        qsc[g] = sc
        inv = np.float32(1.0) / sc
        th, tl = 0, 0
        for d in range(D):
            x = np.int32(np.rint(qh[g, d] * inv))
            hi = (x + np.int32(128)) >> np.int32(8)
            lo = x - (hi << np.int32(8))
            qp[0, g, d] = np.int8(hi)
            qp[1, g, d] = np.int8(lo)
            th += hi
            tl += lo
        qc[0, g] = np.int32(-128 * th)
        qc[1, g] = np.int32(-128 * tl)


@numba.njit(inline="always", **JIT)
def _softmax_split(s, vsc, n, npad, m, l, acc, wp, wsc):
    """The online softmax step of `_softmax_tile` (`_raise_max`) over a tile's n scores s [G, :n],
    its weights p times the value token scales rounded to one byte per head against the tile's
    largest: wp[g, j] = round(p[g, j] vsc[j] / wsc[g]) (uint8; zeros for n <= j < npad), wsc[g] =
    max_j p[g, j] vsc[j] / 255. A weight's rounding is at most 1/510 of its tile's largest, and
    random over the tile's tokens: the output moved by ~1e-3 of its norm against the float64
    twin (weights in 16 bits as two bytes: ~5e-6, and 4–9% slower, bench/RESULTS.md)."""
    for g in range(acc.shape[0]):
        _split_row(s[g], vsc, n, npad, _raise_max(s[g], n, g, m, l, acc), g, l, wp, wsc)


@numba.njit(inline="always", **JIT)
def _split_row(sg, vsc, n, npad, mg, g, l, wp, wsc):
    """`_softmax_split` for head g whose running max is already mg: the products p·vsc go into sg
    in place, then a second pass rounds them into wp[g]; l[g] and wsc[g] updated."""
    tot = np.float32(0.0)
    wmax = np.uint32(0)
    for j in range(n):
        p = exp_neg(sg[j] - mg)
        tot += p
        x = p * vsc[j]
        sg[j] = x
        wmax = max(wmax, f32_to_bits(x))  # x >= 0: its bits order as it does
    mx = bits_to_f32(wmax)
    sc = mx / W8 if mx > TINY else np.float32(1.0)
    inv = np.float32(1.0) / sc
    for j in range(n):
        wp[g, j] = np.uint8(np.int32(np.rint(sg[j] * inv)))
    for j in range(n, npad):
        wp[g, j] = 0
    l[g] += tot
    wsc[g] = sc


@numba.njit(inline="always", **JIT)
def _fold_split(ci, ksc, qsc, s, vsc, n, npad, m, l, acc, wp, wsc):
    """`_softmax_split` over the tile products' integer pieces ci [2, G, :n]: each head's scores
    (256 hi + lo) · ksc[j] · qsc[g] and their max in one pass, then its weights (`_split_row`)."""
    for g in range(acc.shape[0]):
        sg, q = s[g], qsc[g]
        mk = np.int32(-(2**31))
        for j in range(n):
            x = (np.float32(ci[0, g, j]) * np.float32(256.0) + np.float32(ci[1, g, j])) * (ksc[j] * q)
            sg[j] = x
            mk = max(mk, _key(x))
        _split_row(sg, vsc, n, npad, _raise_to(_unkey(mk), g, m, l, acc), g, l, wp, wsc)


@numba.njit(inline="always", **JIT)
def _scores_heads(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, R):
    """`make_scores` for all G heads: groups of four, then R = G % 4 (`rest_heads`)."""
    G = qsc.shape[0]
    g = 0
    while g + 4 <= G:
        _SC4(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, g)
        g += 4
    if R == 3:
        _SC3(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, g)
    elif R == 2:
        _SC2(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, g)
    elif R == 1:
        _SC1(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, g)


@numba.njit(inline="always", **JIT)
def _values_heads(wp, wsc, v, gbase, ngr, acc, R):
    """`make_values` for all G heads: groups of four, then R = G % 4."""
    G = acc.shape[0]
    g = 0
    while g + 4 <= G:
        _VA4(wp, wsc, v, gbase, ngr, acc, g)
        g += 4
    if R == 3:
        _VA3(wp, wsc, v, gbase, ngr, acc, g)
    elif R == 2:
        _VA2(wp, wsc, v, gbase, ngr, acc, g)
    elif R == 1:
        _VA1(wp, wsc, v, gbase, ngr, acc, g)


@numba.njit(inline="always", **JIT)
def _buffers(G, TL):
    """A thread's scratch (for every item it claims) for tiles of up to TL tokens: s [G, TL]
    scores, wp [G, TL] and wsc [G] the weights and their scales, vsc [TL] value token scales, and
    the tile's addresses (`_tile_addresses`)."""
    return (np.empty((G, TL), np.float32), np.empty((G, TL), np.uint8), np.empty(G, np.float32),
            np.empty(TL, np.float32), np.empty(TL // W, np.int64), np.empty(TL // W, np.int64),
            np.empty(TL // W, np.int64), np.empty(TL // 4, np.int64))


@numba.njit(inline="always", **JIT)
def _tile_rows(G):
    """Query rows a tile product takes: G split into equal groups of at most ROWS (the last group
    starts at G - rows, overlapping the one before where rows does not divide G)."""
    groups = (G + ROWS - 1) // ROWS
    return (G + groups - 1) // groups


@numba.njit(inline="always", **JIT)
def _tiles_step(qp, qsc, k, v, kbase, ks, ksbase, pf, nch, gbase, BS, n, s, vsc, ksc, m, l, acc, wp, wsc, ci, vi):
    """One tile of n tokens (whole blocks, `_tile_addresses`) by tile products (`_amx`): the
    scores' two integer pieces into ci, `_tile_rows` heads and two groups of W = 16 tokens at a
    time; the scores, the online softmax and the weights in one byte (`_fold_split`, zeros to the
    last block's end); the value sums into vi, added to acc times each head's weight scale. The
    K and V of the block `ahead` blocks on are prefetched into L2 first (`make_scores` does it
    between its loads)."""
    G, D = acc.shape
    for c in range(nch):
        for x in range(0, W * D, 64):
            prefetch_l2(k, pf[c] + x)
            prefetch_l2(v, pf[c] + x)
    rows = _tile_rows(G)
    scores_tiles(qp, k, kbase, nch, BS, ci, rows)
    ksf = ks.reshape(-1)
    for c in range(nch):
        for t in range(W):
            ksc[c * W + t] = ksf[ksbase[c] + t]
    nb = (n + BS - 1) // BS
    _fold_split(ci, ksc, qsc, s, vsc, n, nb * BS, m, l, acc, wp, wsc)
    values_tiles(wp, v, gbase, nb, BS, vi, rows)
    for g in range(G):
        for d in range(D):
            acc[g, d] += np.float32(vi[g, d]) * wsc[g]


@numba.njit(**JIT)  # not inlined: once a thread and call
def _prepare_queries(q, scale, signs, P, rc, prep, ready, qp, qc, qsc, qr, tr):
    """Take (sequence, kv head) pairs p off the counter prep until none is left: the pair's G rows
    of q times scale, rotated (`_hadamard.hadamard_rows` in qr [G, D], tr [D, G] its scratch) and
    split (`_split_q`) into qp[p], qc[p], qsc[p]; ready[p] set once they are written. Each thread
    does this before it claims items, so q is prepared once a pair, not once an item (1 × 32k: 16
    items a pair), on all threads at once. A thread whose item's pair is not ready yet waits for
    it; the thread preparing it never waits, so the wait always ends."""
    G, D = qr.shape
    Hkv = q.shape[1] // G
    while True:
        p = claim(prep)
        if p >= ready.shape[0]:
            return
        b, h = p // Hkv, p % Hkv
        for g in range(G):
            for d in range(D):
                qr[g, d] = q[b, h * G + g, d] * scale
        hadamard_rows(qr, 0, G, signs, P, rc, False, tr)
        _split_q(qr, qp[p], qc[p], qsc[p])
        arrive(ready, p)


@numba.njit(inline="always", **JIT)
def _tile_addresses(ks, vs, bt, b, h, t, n, t1, ahead, D, kbase, ksbase, pf, gbase, vsc):
    """Where the tile of tokens t .. t+n-1 (whole blocks from t; t1: the item's end) of sequence
    b, kv head h lies, for `make_scores` and `make_values`: per chunk of W tokens its keys' byte
    offset kbase, its scales' offset ksbase and the offset pf of the block `ahead` blocks on
    (prefetched meanwhile; its token scales are prefetched here); per group of 4 tokens its
    values' byte offset gbase; the value token scales copied to vsc. Returns (chunks, groups)."""
    Hkv, BS = ks.shape[1], ks.shape[2]
    region = D * BS  # bytes of one (block, head)'s keys, and of its values
    nbt = (t1 + BS - 1) // BS
    nch, ngr = 0, 0
    for i in range((n + BS - 1) // BS):
        bi = t // BS + i
        blk = bt[b, bi]
        bh = blk * Hkv + h  # (block, head): its keys and values are the bytes from bh · region
        pbh = bt[b, bi + ahead] * Hkv + h if bi + ahead < nbt else bh
        for x in range(0, BS, 16):  # a line holds 16 token scales
            prefetch(ks, pbh * BS + x)
            prefetch(vs, pbh * BS + x)
        nt = min(BS, n - i * BS)
        for c in range((nt + W - 1) // W):
            kbase[nch] = bh * region + c * 4 * W
            ksbase[nch] = bh * BS + c * W
            pf[nch] = pbh * region + c * W * D
            nch += 1
        for j in range(nt):
            vsc[i * BS + j] = vs[blk, h, j]
        for u in range((nt + 3) // 4):
            gbase[ngr] = bh * region + u * 4 * D
            ngr += 1
    return nch, ngr


@numba.njit(**JIT)  # not inlined: once an item
def _prefetch_first(k, v, ks, vs, bt, b, h, t0, t1, ahead):
    """An item's first `ahead` blocks: their K, V and token scales. The walk prefetches each later
    block while it scores the one `ahead` before it (`_tile_addresses`); without this the first
    blocks of every item come from DRAM on demand."""
    Hkv, BS = ks.shape[1], ks.shape[2]
    region = 4 * k.shape[2] * BS  # bytes of one (block, head)'s keys, and of its values
    for bi in range(t0 // BS, min(t0 // BS + ahead, (t1 + BS - 1) // BS)):
        bh = bt[b, bi] * Hkv + h
        for x in range(0, region, 64):
            prefetch(k, bh * region + x)
            prefetch(v, bh * region + x)
        for x in range(0, BS, 16):
            prefetch(ks, bh * BS + x)
            prefetch(vs, bh * BS + x)


@numba.njit(parallel=True, **JIT)
def decode_int8(k, v, ks, vs, q, scale, signs, P, rc, bt, items, order, pair_start, out, lse, tile, ahead, rest,
                threads, tiles):
    """k [NB, Hkv, D/4, BS, 4], v [NB, Hkv, BS/4, D, 4] int8 (the VNNI order, `layout.py`), both
    stored rotated; ks, vs [NB, Hkv, BS] f32; q [B, Hq, D] f32 as it comes: each (sequence, kv
    head)'s rows are taken times scale, rotated (signs, P, rc: `rotation.numba_args`) and split
    once, by the threads before they claim items (`_prepare_queries`), and the thread that
    merges a pair turns its output back (`_finish_item`); items, order, pair_start from
    `decode._work_items`; rest and threads as decode_float. A tile of whole blocks (about `tile`
    tokens, `INT8_TILE`) at a time: its scores W tokens a vector (`make_scores`; meanwhile the K
    and V of the block `ahead` blocks on are prefetched, `PREFETCH_BLOCKS`, and an item's first
    `ahead` blocks as it is claimed, `_prefetch_first`), the online softmax with the weights in
    one byte (`_softmax_split`), the value sums (`make_values`); with `tiles` True (`use_tiles`)
    the scores and value sums are tile products instead (`_tiles_step`). `tiles` None: Numba
    prunes the tile path, so the kernel compiles without it (the tile path adds ~10 s to the
    first compile on two cores).
    BS % W == 0 and D % W == 0 (else `decode_int8_any`); items start at block boundaries."""
    R = len(rest)  # G % 4, a compile-time constant
    NI = items.shape[0]
    Hkv, D, BS = k.shape[1], 4 * k.shape[2], k.shape[3]
    G = q.shape[1] // Hkv
    TL = max(tile // BS, 1) * BS
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    NT, queue, done = _work_queue(threads, NI, pair_start)
    _empty_pairs(pair_start, G, out, lse)
    NP = pair_start.shape[0] - 1
    prep, ready = np.zeros(16, np.int64), np.zeros(NP, np.int64)
    qp_all, qc_all = np.empty((NP, 2, G, D), np.int8), np.empty((NP, 2, G), np.int32)  # q's pieces per pair
    qsc_all = np.empty((NP, G), np.float32)
    for _th in prange(NT):
        s, wp, wsc, vsc, kbase, ksbase, pf, gbase = _buffers(G, TL)
        m = np.empty(G, np.float32)
        l = np.empty(G, np.float32)
        acc = np.empty((G, D), np.float32)
        tr = np.empty((D, G), np.float32)  # the rotations' scratch (`hadamard_rows`)
        TT = 0 if tiles is None else TL  # the tile path's integer sums and key token scales
        ci, vi, ksc = np.empty((2, G, TT), np.int32), np.empty((G, D if TT else 0), np.int32), np.empty(TT, np.float32)
        _prepare_queries(q, scale, signs, P, rc, prep, ready, qp_all, qc_all, qsc_all, np.empty((G, D), np.float32), tr)
        while True:
            it, b, h, t0, t1 = _claim_item(queue, order, items, m, l, acc)
            if it < 0:
                break
            _prefetch_first(k, v, ks, vs, bt, b, h, t0, t1, ahead)
            p = b * Hkv + h
            while load_acquire(ready, p) == 0:  # its q is still being prepared by another thread
                pass
            qp, qc, qsc = qp_all[p], qc_all[p], qsc_all[p]
            t = t0
            while t < t1:
                n = min(TL, t1 - t)
                nch, ngr = _tile_addresses(ks, vs, bt, b, h, t, n, t1, ahead, D, kbase, ksbase, pf, gbase, vsc)
                if tiles is not None:
                    _tiles_step(qp, qsc, k, v, kbase, ks, ksbase, pf, nch, gbase, BS, n, s, vsc, ksc, m, l, acc, wp,
                                wsc, ci, vi)
                else:
                    _scores_heads(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, R)
                    _softmax_split(s, vsc, n, 4 * ngr, m, l, acc, wp, wsc)
                    _values_heads(wp, wsc, v, gbase, ngr, acc, R)
                t += n
            _keep_partial(it, acc, m, l, part_o, part_m, part_l)
            _finish_item(b, h, pair_start, done, part_o, part_m, part_l, out, lse, signs, P, rc, tr)
        if tiles is not None:  # the thread's tile state, loaded by each tile product call
            release()


@numba.njit(parallel=True, **JIT)
def decode_int8_any(k, v, ks, vs, q, bt, items, pair_start, out, lse):
    """`decode_int8` for any head dim (% 4) and block size: float scores over the VNNI order by
    plain loops, a block (at most TILE tokens) a tile."""
    NI = items.shape[0]
    Hkv, D, BS = k.shape[1], 4 * k.shape[2], k.shape[3]
    G = q.shape[1] // Hkv
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
        while t < t1:
            blk, off, n = _next_tile(bt, b, t, t1, BS)
            kb, vb = k[blk, h], v[blk, h]
            for g in range(G):
                for j in range(n):
                    x = np.float32(0.0)
                    for c in range(D // 4):
                        for e in range(4):
                            x += qh[g, 4 * c + e] * np.float32(kb[c, off + j, e])
                    s[g, j] = x * ks[blk, h, off + j]
            _softmax_tile(s, n, m, l, acc)
            for j in range(n):
                u, e, sc = (off + j) // 4, (off + j) % 4, vs[blk, h, off + j]
                for g in range(G):
                    w = s[g, j] * sc
                    for d in range(D):
                        acc[g, d] += w * np.float32(vb[u, d, e])
            t += n
        _keep_partial(it, acc, m, l, part_o, part_m, part_l)
    merge_items(pair_start, part_o, part_m, part_l, out, lse)
