"""Helpers of the host benchmarks (`bench.cpu_attention`, `bench.cpu_decode`): host KV pools of
random codes, how many disjoint copies keep each call's KV out of the last-level cache, and a
plain read of a pool's K/V bytes in the decode kernels' order (the access pattern's own bound).
The DRAM read rate they are measured against is `cpu_attention.dram_read_gbps`."""
from __future__ import annotations

import time

import numba
import numpy as np
import torch

from cpu_attention import DecodeWork, HostKVPool, KVDtype
from cpu_attention.decode import chunk_tokens

PAST_L3 = 2**30  # bytes of reads between two reads of the same KV (the GPU host's L3 holds ~300 MiB)


def fill(pool: HostKVPool, gen: torch.Generator) -> None:
    """Random codes of realistic magnitude (values are irrelevant to speed, not to nan-freedom),
    up to 64 MiB of them repeated over a larger pool."""
    if pool.dtype is KVDtype.BF16:
        for t in (pool.k, pool.v):
            _tile_fill(t.view(-1), torch.randn(min(t.numel(), 2**25), generator=gen).to(torch.bfloat16))
        return
    for t in (pool.k, pool.v):
        src = torch.randint(0, 256, (min(t.numel(), 2**26),), generator=gen, dtype=torch.uint8)
        _tile_fill(t.view(torch.uint8).view(-1), src)
    for t in (pool.k_scale, pool.v_scale):
        t.fill_(0.02)
    for t in (pool.k_zero, pool.v_zero):
        if t is not None:
            t.fill_(-0.15)


def _tile_fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (flat) := src repeated."""
    for i in range(0, dst.numel(), src.numel()):
        n = min(src.numel(), dst.numel() - i)
        dst[i:i + n].copy_(src[:n])


def copies_past_l3(dtype: KVDtype, kv_heads: int, block: int, head_dim: int, tokens: int, least: int = 2) -> int:
    """Disjoint copies of `tokens` tokens' KV to cycle through so that a call's bytes were last read
    more than PAST_L3 bytes of reads before (at least `least`)."""
    per_copy = tokens * HostKVPool(1, 1, kv_heads, block, head_dim, dtype).bytes_per_token
    return max(least, -(-PAST_L3 // int(per_copy)) + 1)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@numba.njit(inline="always", nogil=True)
def _read_rows(k, v, blk, h, off, n):
    """Rows off .. off + n of block blk, kv head h: their K and V words folded together."""
    acc = np.uint64(0)
    for j in range(n):
        kr, vr = k[blk, h, off + j], v[blk, h, off + j]
        for w in range(kr.shape[0]):
            acc += kr[w] ^ vr[w]
    return acc


@numba.njit(parallel=True, nogil=True)
def _pattern_read(k, v, bt, items, BS):
    """Sum K and V words [NB, Hkv, BS, W] (uint64) item by item, block by block, as the kernels walk them."""
    tot = np.zeros(items.shape[0], np.uint64)
    for it in numba.prange(items.shape[0]):
        b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        acc = np.uint64(0)
        t = t0
        while t < t1:
            blk, off = bt[b, t // BS], t % BS
            n = min(BS - off, t1 - t)
            acc += _read_rows(k, v, blk, h, off, n)
            t += n
        tot[it] = acc
    return tot.sum()


@numba.njit(parallel=True, nogil=True)
def _pattern_read_all_heads(k, v, bt, seq_lens, chunk, BS):
    """The same read with one item per (sequence, token range) over all kv heads: each block's
    heads are adjacent, so the runs are Hkv times longer."""
    B = seq_lens.shape[0]
    per = (seq_lens.max() + chunk - 1) // chunk
    tot = np.zeros(B * per, np.uint64)
    for it in numba.prange(B * per):
        b, c = it // per, it % per
        t, t1 = c * chunk, min((c + 1) * chunk, seq_lens[b])
        acc = np.uint64(0)
        while t < t1:
            blk, off = bt[b, t // BS], t % BS
            n = min(BS - off, t1 - t)
            for h in range(k.shape[1]):
                acc += _read_rows(k, v, blk, h, off, n)
            t += n
        tot[it] = acc
    return tot.sum()


def pattern_read_gbps(pool: HostKVPool, bt: torch.Tensor, sl: torch.Tensor, threads: int, reps: int) -> float:
    """GB/s of a plain read of the K/V data (no scales) in the decode kernels' item order."""
    numba.set_num_threads(threads)
    NB, H, BS = pool.num_blocks, pool.num_kv_heads, pool.block_size
    # a (block, head)'s bytes are contiguous in every dtype's layout: read them as BS rows of words
    k = pool.k[0].reshape(NB, H, -1).view(torch.uint8).numpy().view(np.uint64).reshape(NB, H, BS, -1)
    v = pool.v[0].reshape(NB, H, -1).view(torch.uint8).numpy().view(np.uint64).reshape(NB, H, BS, -1)
    sln = sl.numpy().astype(np.int64)
    items = DecodeWork(pool, bt, sl, threads).items  # the kernels' work items: (b, h, t0, t1)
    btn = bt.numpy()
    _pattern_read(k, v, btn, items, BS)
    t = float(np.median([timed(lambda: _pattern_read(k, v, btn, items, BS)) for _ in range(reps)]))
    chunk = chunk_tokens(sln, 1, BS, threads)
    _pattern_read_all_heads(k, v, btn, sln, chunk, BS)
    t2 = float(np.median([timed(lambda: _pattern_read_all_heads(k, v, btn, sln, chunk, BS)) for _ in range(reps)]))
    nbytes = 2 * int(sln.sum()) * H * k.shape[3] * 8
    return nbytes / t / 1e9, nbytes / t2 / 1e9
