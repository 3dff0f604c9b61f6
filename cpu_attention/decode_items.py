"""The decode kernels' work items (`decode_bf16`, `decode_int8`, `decode_int4`): the queue
threads claim items from, each item's partial (acc [G, D], running max m, sum l), and the merge
of one (sequence, kv head)'s partials by log-sum-exp, done by the thread that finishes its last
item (`_finish_item`)."""
from __future__ import annotations

import numba
import numpy as np
from numba import prange

from cpu_attention._hadamard import hadamard_rows
from cpu_attention._numba import JIT, arrive, claim

NEG_INF = np.float32(-np.inf)


@numba.njit(inline="always", **JIT)
def _work_queue(threads, NI, pair_start):
    """A kernel's work queue over its NI items: (the threads to start, at most one an item; the
    counter of the next unclaimed item, on a cache line of its own, for `_claim_item`; the items
    finished per (sequence, kv head) pair, for `_finish_item`)."""
    return min(threads, NI), np.zeros(16, np.int64), np.zeros(pair_start.shape[0] - 1, np.int64)


@numba.njit(**JIT)  # not inlined: once a call
def _empty_pairs(pair_start, G, out, lse):
    """out 0 and lse -inf for each (sequence, kv head) with no items (an empty sequence): the
    merge of `_finish_item` runs only when a pair's last item ends."""
    Hkv = out.shape[1] // G
    for p in range(pair_start.shape[0] - 1):
        if pair_start[p + 1] == pair_start[p]:
            b, h = p // Hkv, p % Hkv
            for g in range(h * G, (h + 1) * G):
                lse[b, g] = NEG_INF
                for d in range(out.shape[2]):
                    out[b, g, d] = 0.0


@numba.njit(inline="always", **JIT)
def _claim_item(queue, order, items, m, l, acc):
    """The next unclaimed item for the calling thread (`_numba.claim`; order: the queue's order of
    the items, `decode.final_wave`): (it, b, h, t0, t1) with the running max m [G] reset to -inf,
    the sum l [G] and accumulator acc [G, D] to 0 (scratch a thread allocates once and reuses for
    every item it claims); it = -1 when none is left."""
    c = claim(queue)
    if c >= order.shape[0]:
        return -1, 0, 0, 0, 0
    it = order[c]
    for g in range(m.shape[0]):
        m[g] = NEG_INF
        l[g] = 0
        for d in range(acc.shape[1]):
            acc[g, d] = 0
    return it, items[it, 0], items[it, 1], items[it, 2], items[it, 3]


@numba.njit(**JIT)  # not inlined: a call per item, and acc None prunes its branch
def _keep_partial(it, acc, m, l, part_o, part_m, part_l):
    """part_o[it], part_m[it], part_l[it] = acc, m, l (acc None: part_o[it] is written already), by
    loops: an array assigned to a slice compiles Numba's shape-mismatch message, ~4 s of string code."""
    G = m.shape[0]
    for g in range(G):
        part_m[it, g] = m[g]
        part_l[it, g] = l[g]
    if acc is not None:
        for g in range(G):
            for d in range(acc.shape[1]):
                part_o[it, g, d] = acc[g, d]


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


@numba.njit(**JIT)  # not inlined: once an item; signs None (bf16) prunes the rotation
def _finish_item(b, h, pair_start, done, part_o, part_m, part_l, out, lse, signs, P, c, t):
    """Called once an item's partial is kept (`_keep_partial`): the thread that finishes the last
    item of (sequence b, kv head h) merges that pair's partials into out, lse (`_merge_pair`) and,
    where signs is given, turns its G output rows back from the rotation V is stored in (row @
    R.T: `_hadamard.hadamard_rows`, t [D, G] its scratch). So the merge runs inside the kernel's one
    parallel region, spread over the threads as pairs complete: no second region, and no pass
    over the partials after the last item. done [pairs]: the items finished per pair, zeros at
    the call's start."""
    G = part_m.shape[1]
    p = b * (out.shape[1] // G) + h
    if arrive(done, p) != pair_start[p + 1] - pair_start[p] - 1:
        return
    _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)
    if signs is not None:
        hadamard_rows(out[b], h * G, G, signs, P, c, True, t)


@numba.njit(parallel=True, **JIT)
def merge_items(pair_start, part_o, part_m, part_l, out, lse):
    """Merge each (sequence, kv head)'s items into out, lse (`_merge_pair`), in parallel over the
    pairs: the `decode_*_any` kernels' merge (the fast ones merge in `_finish_item`); its own
    function, as a second prange loop inside a kernel adds 2–4 s to that kernel's compile."""
    G = part_m.shape[1]
    for p in prange(pair_start.shape[0] - 1):
        _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)
