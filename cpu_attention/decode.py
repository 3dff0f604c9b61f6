"""Numba decode attention over the paged host KV pool (bf16, int8, int4), flash-decoding style.

Work split: a work item is (sequence b, kv head h, token range [t0, t1)). Items of one
(b, h) are consecutive; long sequences are cut into several ranges so batch 1 × 32k keeps
every core busy, and each item returns a partial (acc [G, D], running max m, sum l) that a
second parallel loop merges by log-sum-exp. All G = Hq / Hkv query heads of a kv head are
done together, so each K/V byte is read from DRAM once.

Inner loop: a tile of up to TILE tokens of one block is widened to float32 in an L1-resident
buffer (bf16: shift into the high half; int8: code × token scale; int4: code × group
scale + group zero), then scores, the online-softmax update and the V accumulation run on
float32 with SIMD over the head dim. int4 widens into a permuted order (even elements then
odd ones, which is how the nibbles come out of the bytes); q is permuted the same way and
the output is un-permuted at the end.
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from cpu_attention._numba import JIT, exp_neg, f16_to_f32, prefetch, resolve_threads, widen
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
def _tile_update(q, kb, vb, n, s, m, l, acc):
    """Online softmax over n widened tokens. q [G, D], kb/vb [TILE, D], s [G, TILE].

    Rows are taken as views and indexed by loop counters only: Numba's negative-index
    wraparound on computed indices would stop LLVM from vectorizing the loops.
    """
    G, D = q.shape
    for g in range(G):
        qg = q[g]
        sg = s[g]
        mx = NEG_INF
        for j in range(n):
            kr = kb[j]
            a = np.float32(0.0)
            for d in range(D):
                a += qg[d] * kr[d]
            sg[j] = a
            mx = max(mx, a)
        ag = acc[g]
        if mx > m[g]:
            corr = np.exp(m[g] - mx) if m[g] > NEG_INF else np.float32(0.0)
            l[g] *= corr
            for d in range(D):
                ag[d] *= corr
            m[g] = mx
        tot = np.float32(0.0)
        mg = m[g]
        for j in range(n):
            p = exp_neg(sg[j] - mg)
            sg[j] = p
            tot += p
        l[g] += tot
        j = 0
        while j + 4 <= n:  # four tokens per pass: one load/store of acc per 4 FMAs
            p0, p1, p2, p3 = sg[j], sg[j + 1], sg[j + 2], sg[j + 3]
            v0, v1, v2, v3 = vb[j], vb[j + 1], vb[j + 2], vb[j + 3]
            for d in range(D):
                ag[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
            j += 4
        while j < n:
            p0 = sg[j]
            v0 = vb[j]
            for d in range(D):
                ag[d] += p0 * v0[d]
            j += 1


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
        kb = np.empty((TILE, D), np.float32)
        vb = np.empty((TILE, D), np.float32)
        s = np.empty((G, TILE), np.float32)
        m = np.full(G, NEG_INF, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, D), np.float32)
        qh = q[b, h * G:(h + 1) * G]
        t = t0
        while t < t1:
            blk, off = bt[b, t // BS], t % BS
            n = min(BS - off, t1 - t, TILE)
            if off == 0 and t + BS < t1:  # next block's rows stream in while this one computes
                nb = bt[b, t // BS + 1]
                _prefetch_rows(k[nb, h])
                _prefetch_rows(v[nb, h])
            for j in range(n):
                kr, vr, ks, vs = kb[j], vb[j], k[blk, h, off + j], v[blk, h, off + j]
                for d in range(D):
                    kr[d] = widen(ks[d])
                for d in range(D):
                    vr[d] = widen(vs[d])
            _tile_update(qh, kb, vb, n, s, m, l, acc)
            t += n
        part_o[it] = acc
        part_m[it] = m
        part_l[it] = l
    for p in prange(pair_start.shape[0] - 1):
        _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)


@numba.njit(parallel=True, **JIT)
def decode_int8(k, v, ks, vs, q, bt, items, pair_start, out, lse):
    """k, v [NB, Hkv, BS, D] int8; ks, vs [NB, Hkv, BS] f32; rest as decode_float."""
    NI = items.shape[0]
    BS, D = k.shape[2], k.shape[3]
    G = q.shape[1] // k.shape[1]
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    for it in prange(NI):
        b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        kb = np.empty((TILE, D), np.float32)
        vb = np.empty((TILE, D), np.float32)
        s = np.empty((G, TILE), np.float32)
        m = np.full(G, NEG_INF, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, D), np.float32)
        qh = q[b, h * G:(h + 1) * G]
        t = t0
        while t < t1:
            blk, off = bt[b, t // BS], t % BS
            n = min(BS - off, t1 - t, TILE)
            if off == 0 and t + BS < t1:
                nb = bt[b, t // BS + 1]
                _prefetch_rows(k[nb, h])
                _prefetch_rows(v[nb, h])
                _prefetch_rows(ks[nb, h])
                _prefetch_rows(vs[nb, h])
            for j in range(n):
                sk, sv = ks[blk, h, off + j], vs[blk, h, off + j]
                kr, vr, kq, vq = kb[j], vb[j], k[blk, h, off + j], v[blk, h, off + j]
                for d in range(D):
                    kr[d] = np.float32(kq[d]) * sk
                for d in range(D):
                    vr[d] = np.float32(vq[d]) * sv
            _tile_update(qh, kb, vb, n, s, m, l, acc)
            t += n
        part_o[it] = acc
        part_m[it] = m
        part_l[it] = l
    for p in prange(pair_start.shape[0] - 1):
        _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)


@numba.njit(inline="always", **JIT)
def _widen_int4(x, sc, zr, blk, h, t, out, j):
    """Token t's packed row x[blk, h, t] [D/2] with its group scales/zeros (f16 bits) →
    out[j] [D] float32, even elements first then odd ones (see module doc). Unsigned
    indices: no wraparound code, so the 16-byte group loops vectorize."""
    half = np.uint64(x.shape[3])
    for gr in range(sc.shape[3]):
        a = f16_to_f32(sc[blk, h, t, gr])
        z = f16_to_f32(zr[blk, h, t, gr])
        g0 = np.uint64(gr) * np.uint64(HALF_GROUP)
        for jj in range(HALF_GROUP):
            i = g0 + np.uint64(jj)
            byte = np.int32(x[blk, h, t, i])
            out[j, i] = np.float32(byte & np.int32(15)) * a + z
            out[j, i + half] = np.float32(byte >> np.int32(4)) * a + z


@numba.njit(inline="always", **JIT)
def _prefetch_rows(a):
    """Prefetch a contiguous array (one block's rows of one head) line by line."""
    step = 64 // a.itemsize
    for i in range(0, a.size, step):
        prefetch(a, i)


@numba.njit(parallel=True, **JIT)
def decode_int4(k, v, ks, vs, kz, vz, q, bt, items, pair_start, out, lse):
    """k, v [NB, Hkv, BS, D/2] uint8; scales/zeros [NB, Hkv, BS, D/32] uint16 (f16 bits);
    q [B, Hq, D] f32 pre-scaled and permuted (evens, odds); out comes back permuted too."""
    NI = items.shape[0]
    BS, D = k.shape[2], 2 * k.shape[3]
    G = q.shape[1] // k.shape[1]
    part_o = np.empty((NI, G, D), np.float32)
    part_m = np.empty((NI, G), np.float32)
    part_l = np.empty((NI, G), np.float32)
    for it in prange(NI):
        b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        kb = np.empty((TILE, D), np.float32)
        vb = np.empty((TILE, D), np.float32)
        s = np.empty((G, TILE), np.float32)
        m = np.full(G, NEG_INF, np.float32)
        l = np.zeros(G, np.float32)
        acc = np.zeros((G, D), np.float32)
        qh = q[b, h * G:(h + 1) * G]
        t = t0
        while t < t1:
            blk, off = bt[b, t // BS], t % BS
            n = min(BS - off, t1 - t, TILE)
            if off == 0 and t + BS < t1:
                nb = bt[b, t // BS + 1]
                _prefetch_rows(k[nb, h])
                _prefetch_rows(v[nb, h])
                _prefetch_rows(ks[nb, h])
                _prefetch_rows(vs[nb, h])
                _prefetch_rows(kz[nb, h])
                _prefetch_rows(vz[nb, h])
            for j in range(n):
                _widen_int4(k, ks, kz, blk, h, off + j, kb, j)
                _widen_int4(v, vs, vz, blk, h, off + j, vb, j)
            _tile_update(qh, kb, vb, n, s, m, l, acc)
            t += n
        part_o[it] = acc
        part_m[it] = m
        part_l[it] = l
    for p in prange(pair_start.shape[0] - 1):
        _merge_pair(p, G, pair_start, part_o, part_m, part_l, out, lse)


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
    if pool.dtype is KVDtype.INT4:
        qs = torch.cat([qs[..., 0::2], qs[..., 1::2]], dim=-1)
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
        decode_int4(pool.k[layer].numpy(), pool.v[layer].numpy(), _u16(pool.k_scale[layer]),
                    _u16(pool.v_scale[layer]), _u16(pool.k_zero[layer]), _u16(pool.v_zero[layer]),
                    qn, bt, items, pair_start, on, ln)
        perm = out.clone()
        out[..., 0::2], out[..., 1::2] = perm[..., : D // 2], perm[..., D // 2:]
    return out, lse
