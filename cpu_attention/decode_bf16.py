"""bf16 decode kernels: `decode_float` (head dims a multiple of the vector width) and
`decode_float_any` (any head dim), built from `decode_tiles`' steps.

bf16 rows are widened to float32 by a shift into the high half inside the micro-kernels
(`_simd`), so `decode_float` keeps q and the accumulator in the pair layout the widened rows
come in (`_simd.to_pair_layout`) and turns the accumulator back before the merge.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import prange

from cpu_attention._numba import JIT
from cpu_attention._simd import DOT_TOKENS, from_pair_layout, to_pair_layout
from cpu_attention.decode_items import (
    NEG_INF, _claim_item, _empty_pairs, _finish_item, _keep_partial, _work_queue, merge_items,
)
from cpu_attention.decode_tiles import (
    TILE, _accumulate, _next_tile, _scores, _softmax_tile, _tile_accumulate, _tile_len, _tile_scores,
)


@numba.njit(parallel=True, **JIT)
def decode_float(k, v, q, scale, bt, items, order, pair_start, out, lse, rest, threads):
    """k, v [NB, Hkv, BS, D] uint16 (bf16 bits); q [B, Hq, D] f32, times scale here;
    bt [B, MB]; items, order, pair_start from `decode._work_items`; writes out [B, Hq, D], lse [B, Hq].
    D % VEC == 0 (else `decode_float_any`). q and the accumulator are kept in the pair layout
    in which bf16 rows are widened (`_simd.to_pair_layout`). rest: `decode_tiles.rest_heads(G)`;
    threads: the call's thread count, the work queue's workers (`decode` module docstring).
    Each (sequence, kv head) is merged by the thread that finishes its last item (`_finish_item`)."""
    R = len(rest)  # G % 4, a compile-time constant
    NI = items.shape[0]
    BS, D = k.shape[2], k.shape[3]
    G = q.shape[1] // k.shape[1]
    TL = _tile_len(BS)
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    NT, queue, done = _work_queue(threads, NI, pair_start)
    _empty_pairs(pair_start, G, out, lse)
    for _th in prange(NT):
        s = np.empty((G, TL + DOT_TOKENS), np.float32)
        m = np.empty(G, np.float32)
        l = np.empty(G, np.float32)
        acc = np.empty((G, D), np.float32)  # pair layout, as qh
        qh = np.empty((G, D), np.float32)
        while True:
            it, b, h, t0, t1 = _claim_item(queue, order, items, m, l, acc)
            if it < 0:
                break
            to_pair_layout(q[b, h * G:(h + 1) * G], qh)
            for g in range(G):
                for d in range(D):
                    qh[g, d] *= scale
            t = t0
            while t < t1:
                n = min(TL, t1 - t)
                _tile_scores(qh, k, v, h, bt, b, t, n, t1, BS, s, R)
                _softmax_tile(s, n, m, l, acc)
                _tile_accumulate(s, v, h, bt, b, t, n, BS, acc, R)
                t += n
            from_pair_layout(acc, part_o[it])
            _keep_partial(it, None, m, l, part_o, part_m, part_l)
            _finish_item(b, h, pair_start, done, part_o, part_m, part_l, out, lse, None, 0, 0.0, None)


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
        _keep_partial(it, acc, m, l, part_o, part_m, part_l)
    merge_items(pair_start, part_o, part_m, part_l, out, lse)
