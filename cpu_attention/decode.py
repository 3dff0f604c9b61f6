"""Numba decode attention over the paged host KV pool (bf16, int8, int4), flash-decoding style.

Work split: a work item is (sequence b, kv head h, token range [t0, t1)). Items of one
(b, h) are consecutive; long sequences are cut into several ranges so batch 1 × 32k keeps
every core busy, and each item returns a partial (acc [G, D], running max m, sum l) that a
second parallel loop merges by log-sum-exp. All G = Hq / Hkv query heads of a kv head are
done together, so each K/V byte is read from DRAM once.

Inner loop, per tile (the tokens of one block, at most TILE): the scores of all G heads
(`_scores`: two tokens × four heads a pass, each K element loaded and widened once, bf16 by
a shift into the high half, int8 by a conversion), one online-softmax step for the whole
tile (`_softmax_tile`: max, one rescale of the accumulator, a vectorized polynomial exp),
then the V accumulation (`_accumulate`: four heads × two tokens a pass). int8's per-token
scales multiply the G scores and the G weights, not the D codes. int4 rows are first
widened into L1-resident float32 tiles (up to TILE tokens over one or more blocks) by
straight-line vector code (`widen_nibbles`): code × scale + zero, V's per token and group,
K's per block and channel (a block still being filled is read from its bf16 tail); the
output is rotated back (int4 V is stored rotated, `rotation.py`). While a tile computes, the next tile's rows are
prefetched one row per token.
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from cpu_attention import rotation
from cpu_attention._numba import (
    JIT, exp_neg, hadamard_unrotate, prefetch, resolve_threads, widen, widen_nibbles, widen_nibbles_by,
)
from cpu_attention.layout import INT4_GROUP, HostKVPool, KVDtype
from cpu_attention.reference import decode_attention_ref

TILE = 32  # tokens widened at a time: K and V tiles of 32 × D float32 stay in L1/L2
ITEMS_PER_THREAD = 4  # equal-sized items per thread: balances Numba's static schedule
MIN_CHUNK = 256  # tokens; below this the merge and per-item setup start to show
NEG_INF = np.float32(-np.inf)
HALF_GROUP = INT4_GROUP // 2  # packed bytes per int4 group


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
    int8 or f32. Four heads share each K element load; loops over D use loop counters only
    (Numba's wraparound code on computed indices stops LLVM vectorizing). While the first
    heads run, rows j < pn of the next tile (pk, pv) are prefetched, one row per token, so
    the next tile's DRAM reads overlap this tile's arithmetic."""
    G, D = q.shape
    g = 0
    while g + 4 <= G:
        q0, q1, q2, q3 = q[g], q[g + 1], q[g + 2], q[g + 3]
        s0, s1, s2, s3 = s[g], s[g + 1], s[g + 2], s[g + 3]
        j = 0
        while j + 2 <= n:  # two tokens a pass: each q element load feeds two FMAs
            if g == 0 and j + 1 < pn:
                _prefetch_row(pk, j)
                _prefetch_row(pv, j)
                _prefetch_row(pk, j + 1)
                _prefetch_row(pv, j + 1)
            kr, kr1 = kt[j], kt[j + 1]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
            for d in range(D):
                x = widen(kr[d])
                y = widen(kr1[d])
                a0 += q0[d] * x
                a1 += q1[d] * x
                a2 += q2[d] * x
                a3 += q3[d] * x
                b0 += q0[d] * y
                b1 += q1[d] * y
                b2 += q2[d] * y
                b3 += q3[d] * y
            s0[j], s1[j], s2[j], s3[j] = a0, a1, a2, a3
            s0[j + 1], s1[j + 1], s2[j + 1], s3[j + 1] = b0, b1, b2, b3
            j += 2
        if j < n:
            if g == 0 and j < pn:
                _prefetch_row(pk, j)
                _prefetch_row(pv, j)
            kr = kt[j]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for d in range(D):
                x = widen(kr[d])
                a0 += q0[d] * x
                a1 += q1[d] * x
                a2 += q2[d] * x
                a3 += q3[d] * x
            s0[j], s1[j], s2[j], s3[j] = a0, a1, a2, a3
        g += 4
    while g < G:
        qg, sg = q[g], s[g]
        for j in range(n):
            if g == 0 and j < pn:
                _prefetch_row(pk, j)
                _prefetch_row(pv, j)
            kr = kt[j]
            a = np.float32(0.0)
            for d in range(D):
                a += qg[d] * widen(kr[d])
            sg[j] = a
        g += 1


@numba.njit(inline="always", **JIT)
def _softmax_tile(s, n, m, l, acc):
    """Online softmax step over a tile of n scores s [G, TILE] → weights in place; the running
    max m [G], sum l [G] and accumulator acc [G, D] are rescaled once per tile, not per token."""
    G, D = acc.shape
    for g in range(G):
        sg = s[g]
        mx = NEG_INF
        for j in range(n):
            mx = max(mx, sg[j])
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
    """acc[g] += Σ_j p[g, j] · widen(vt[j]) for j < n: four heads × two tokens a pass, so
    each V element is widened once per pass and each acc vector is loaded and stored once
    per two tokens."""
    G, D = acc.shape
    g = 0
    while g + 4 <= G:
        a0, a1, a2, a3 = acc[g], acc[g + 1], acc[g + 2], acc[g + 3]
        p0, p1, p2, p3 = p[g], p[g + 1], p[g + 2], p[g + 3]
        j = 0
        while j + 2 <= n:
            v0, v1 = vt[j], vt[j + 1]
            w00, w01, w10, w11 = p0[j], p0[j + 1], p1[j], p1[j + 1]
            w20, w21, w30, w31 = p2[j], p2[j + 1], p3[j], p3[j + 1]
            for d in range(D):
                x0 = widen(v0[d])
                x1 = widen(v1[d])
                a0[d] += w00 * x0 + w01 * x1
                a1[d] += w10 * x0 + w11 * x1
                a2[d] += w20 * x0 + w21 * x1
                a3[d] += w30 * x0 + w31 * x1
            j += 2
        if j < n:
            v0 = vt[j]
            w0, w1, w2, w3 = p0[j], p1[j], p2[j], p3[j]
            for d in range(D):
                x0 = widen(v0[d])
                a0[d] += w0 * x0
                a1[d] += w1 * x0
                a2[d] += w2 * x0
                a3[d] += w3 * x0
        g += 4
    while g < G:
        ag, pg = acc[g], p[g]
        for j in range(n):
            v0 = vt[j]
            w0 = pg[j]
            for d in range(D):
                ag[d] += w0 * widen(v0[d])
        g += 1


@numba.njit(inline="always", **JIT)
def _prefetch_row(a, j):
    """Prefetch row j of a 2-D C-contiguous array, one cache line at a time."""
    W = a.shape[1]
    step = max(64 // a.itemsize, 1)
    for i in range(0, W, step):
        prefetch(a, j * W + i)


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


@numba.njit(parallel=True, **JIT)
def decode_float(k, v, q, bt, items, pair_start, out, lse):
    """k, v [NB, Hkv, BS, D] uint16 (bf16 bits); q [B, Hq, D] f32 pre-scaled;
    bt [B, MB]; items/pair_start from _plan; writes out [B, Hq, D], lse [B, Hq]."""
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
def decode_int8(k, v, ks, vs, q, bt, items, pair_start, out, lse):
    """k, v [NB, Hkv, BS, D] int8; ks, vs [NB, Hkv, BS] f32; rest as decode_float.
    The token scales are applied to the G scores (K) and the G weights (V), not to the D codes."""
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


@numba.njit(inline="always", **JIT)
def _widen_int4(x, sc, zr, n, out):
    """Packed rows x [n, D/2] with per-token group scales/zeros sc, zr [n, D/32] (bf16 bits)
    → out[:n] [., D] float32 (code × scale + zero, in element order)."""
    half, NG = x.shape[1], sc.shape[1]
    for j in range(n):
        for gr in range(NG):
            widen_nibbles(x, j * half + gr * HALF_GROUP, widen(sc[j, gr]), widen(zr[j, gr]),
                          out, 2 * j * half + gr * INT4_GROUP)


@numba.njit(inline="always", **JIT)
def _widen_int4_keys(x, aw, zw, n, out):
    """Packed key rows x [n, D/2] → out[:n] [., D] float32: code × aw + zw, with aw, zw [D]
    (float32) the block's per-channel scale and zero."""
    half = x.shape[1]
    for j in range(n):
        for i in range(0, half, HALF_GROUP):
            widen_nibbles_by(x, j * half + i, aw, zw, 2 * i, out, 2 * (j * half + i))


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
    the rotation R (`_numba.hadamard_unrotate`).

    A tile is up to TILE tokens over one or more blocks (widening is per block anyway, and
    the score / softmax / accumulate passes cost less a token over longer tiles). V's output
    Σ p (vR) = (Σ p v) R is rotated back after the merge (in Numba: as a torch GEMM, torch's
    intra-op threads would spin on the kernel's cores)."""
    NI = items.shape[0]
    BS, D = k.shape[2], 2 * k.shape[3]
    Hkv = k.shape[1]
    G = q.shape[1] // Hkv
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    for it in prange(NI):
        b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        kb = np.empty((TILE, D), np.float32)
        vb = np.empty((TILE, D), np.float32)
        aw = np.empty(D, np.float32)
        zw = np.empty(D, np.float32)
        s = np.empty((G, TILE), np.float32)
        m = np.full(G, NEG_INF, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, D), np.float32)
        qh = q[b, h * G:(h + 1) * G]
        t = t0
        while t < t1:
            n = 0
            while n < TILE and t + n < t1:  # the tile's tokens, block by block
                blk, off, nb = _next_tile(bt, b, t + n, t1, BS)
                nb = min(nb, TILE - n)
                ts = tail[blk]
                if ts >= 0:
                    _widen_rows(tk[ts, h, off:off + nb], nb, kb[n:])
                    _widen_rows(tv[ts, h, off:off + nb], nb, vb[n:])
                else:
                    ka, kzr = ks[blk, h], kz[blk, h]
                    for d in range(D):
                        aw[d] = widen(ka[d])
                        zw[d] = widen(kzr[d])
                    _widen_int4_keys(k[blk, h, off:off + nb], aw, zw, nb, kb[n:])
                    _widen_int4(v[blk, h, off:off + nb], vs[blk, h, off:off + nb], vz[blk, h, off:off + nb], nb,
                                vb[n:])
                n += nb
            nblk, noff, nn = _next_tile(bt, b, t + n, t1, BS) if t + n < t1 else (0, 0, 0)
            if noff == 0 and nn > 0:
                _prefetch_row(ks[nblk, h].reshape(1, -1), 0)
                _prefetch_row(kz[nblk, h].reshape(1, -1), 0)
                _prefetch_row(vs[nblk, h].reshape(1, -1), 0)
                _prefetch_row(vz[nblk, h].reshape(1, -1), 0)
            _scores(qh, kb, n, s, k[nblk, h, noff:], v[nblk, h, noff:], nn)
            _softmax_tile(s, n, m, l, acc)
            _accumulate(s, vb, n, acc)
            t += n
        part_o[it] = acc
        part_m[it] = m
        part_l[it] = l
    for p in prange(pair_start.shape[0] - 1):
        _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)
        for g in range(G):
            hadamard_unrotate(out[p // Hkv, (p % Hkv) * G + g], signs, P, c)


def _u16(t: torch.Tensor) -> np.ndarray:
    """A 16-bit tensor's storage as a uint16 numpy view (no copy)."""
    return t.view(torch.int16).numpy().view(np.uint16)


def chunk_tokens(seq_lens: np.ndarray, num_kv_heads: int, block_size: int, threads: int) -> int:
    """Token range of one work item: ~ITEMS_PER_THREAD equal items a thread, block-aligned."""
    total = int(seq_lens.sum()) * num_kv_heads
    chunk = max(-(-total // (ITEMS_PER_THREAD * threads)), MIN_CHUNK)
    return -(-chunk // block_size) * block_size


def decode_attention(
    pool: HostKVPool,
    layer: int,
    q: torch.Tensor,  # [B, Hq, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per sequence over its host-tier tokens → (out [B,Hq,D] f32, lse [B,Hq] f32).

    Safe to call from a worker thread: the kernel runs without the GIL.
    """
    B, Hq, D = q.shape
    Hkv = pool.num_kv_heads
    if D != pool.head_dim or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool (Hkv {Hkv}, D {pool.head_dim})")
    n_threads = resolve_threads(threads)
    qs = q.detach().to(torch.float32) * scale
    qn = qs.contiguous().numpy()
    bt = block_tables.detach().to(torch.int32).contiguous().numpy()
    sl = seq_lens.detach().to(torch.int64).contiguous().numpy()
    items, pair_start = _plan(sl, Hkv, chunk_tokens(sl, Hkv, pool.block_size, n_threads))
    out = torch.empty((B, Hq, D), dtype=torch.float32)
    lse = torch.empty((B, Hq), dtype=torch.float32)
    on, ln = out.numpy(), lse.numpy()
    if pool.dtype is KVDtype.BF16:
        decode_float(_u16(pool.k[layer]), _u16(pool.v[layer]), qn, bt, items, pair_start, on, ln)
    elif pool.dtype is KVDtype.F32:  # exact pools exist for checks: the twin is enough
        return decode_attention_ref(pool, layer, q, block_tables, seq_lens, scale)
    elif pool.dtype is KVDtype.INT8:
        decode_int8(pool.k[layer].numpy(), pool.v[layer].numpy(), pool.k_scale[layer].numpy(),
                    pool.v_scale[layer].numpy(), qn, bt, items, pair_start, on, ln)
    else:
        t = pool.tails
        decode_int4(pool.k[layer].numpy(), pool.v[layer].numpy(), _u16(pool.k_scale[layer]),
                    _u16(pool.k_zero[layer]), _u16(pool.v_scale[layer]), _u16(pool.v_zero[layer]),
                    _u16(t.k), _u16(t.v), t.slot[layer].numpy(), qn, bt, items, pair_start, on, ln, rotation.signs(D).numpy(),
                    rotation.block(D), np.float32(rotation.inv_sqrt(D).item()))
    return out, lse
