"""Numba quantizing append into the host pool: the hot path of HostKVPool.write.

A decode step appends one token per sequence in each of 32 layers; the torch version
(`layout.quantize` + indexed stores) costs hundreds of microseconds a call in small-op
overhead, this one a few. Same bits as the torch twins (`layout.quantize`; int4:
`int4.write`, whose docstring states the rule): round half to even, the same float32
formulas in the same order, the same rotation butterflies (int8 keys and values, int4
values) and clip search, without fastmath so every operation rounds as torch's does. int4's
writers (its tails, the block quantization) are in `append_int4.py`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numba
import numpy as np
import torch
from numba import prange

from cpu_attention import rotation
from cpu_attention._hadamard import rotate_rows
from cpu_attention._numba import WJIT, f32_to_bf16
from cpu_attention.append_int4 import write_int4_arrays
from cpu_attention.layout import KVDtype

if TYPE_CHECKING:
    from cpu_attention.pool import HostKVPool

PIECE = 16  # rows (token, kv head) a thread of `write_kv_int8_parallel` takes at a time: still a vector across rows


@numba.njit(**WJIT)
def write_bf16(dst, blocks, offs, x):
    """dst [NB, Hkv, BS, D] uint16; blocks, offs [T]; x [T, Hkv, D] float32. A row's D values
    through a 1-d view each, so the loop vectorizes (indexed 4-d per value it stayed scalar)."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            row, src = dst[blocks[t], h, offs[t]], x[t, h]
            for d in range(x.shape[2]):
                row[d] = f32_to_bf16(src[d])


@numba.njit(inline="always", **WJIT)
def _int8_rows(dst, sc, blocks, offs, x, r0, r1, signs, P, inv_sqrt_p, values):
    """Rows r0 .. r1 of x [T, Hkv, D] float32, seen as T · Hkv rows (token r // Hkv, kv head r % Hkv),
    into dst, int8 in the VNNI order (`layout.py`: keys [NB, Hkv, D/4, BS, 4], values=True
    [NB, Hkv, BS4/4, D, 4]), and sc [NB, Hkv, BS] float32: x @ R ≈ codes * sc (signs, P,
    inv_sqrt_p: the rotation R; `layout.quantize`). The rows are rotated together (`rotate_rows`:
    its butterflies are vectors across rows, the same bits as `rotation.rotate`'s), then each
    row's codes made in a vector loop before their stores into the interleaved order: row by row
    the rotation and the rounding stayed scalar, ~12 µs a token of 8 kv heads (2 cores), against ~5."""
    H, D = x.shape[1], x.shape[2]
    y = x.reshape(x.shape[0] * H, D)[r0:r1].copy()
    rotate_rows(y, signs, P, inv_sqrt_p)
    codes = np.empty(D, np.int8)
    for r in range(r0, r1):
        t, h = r // H, r % H
        yr = y[r - r0]
        amax = np.float32(0.0)
        for d in range(D):
            amax = max(amax, abs(yr[d]))
        s = max(amax, np.float32(1e-8)) / np.float32(127.0)
        b, o = blocks[t], offs[t]
        sc[b, h, o] = s
        for d in range(D):
            codes[d] = np.int8(min(max(np.rint(yr[d] / s), np.float32(-127.0)), np.float32(127.0)))
        if values:
            col = dst[b, h, o >> 2]
            for d in range(D):
                col[d, o & 3] = codes[d]
        else:
            blk = dst[b, h]
            for d in range(D):
                blk[d >> 2, o, d & 3] = codes[d]


@numba.njit(**WJIT)
def write_kv_bf16(k, v, layer, slots, block_size, xk, xv):
    """k, v [L, NB, Hkv, BS, D] uint16; slots [T] flat; xk, xv [T, Hkv, D] float32."""
    blocks, offs = slots // block_size, slots % block_size
    write_bf16(k[layer], blocks, offs, xk)
    write_bf16(v[layer], blocks, offs, xv)


@numba.njit(**WJIT)
def write_kv_int8(k, v, ks, vs, layer, slots, block_size, xk, xv, signs, P, inv_sqrt_p):
    """As write_kv_bf16 for int8 codes k, v (`_int8_rows`' orders, a layer dim first) and their
    scales ks, vs [L, NB, Hkv, BS] float32, both rotated (signs, P, inv_sqrt_p)."""
    blocks, offs = slots // block_size, slots % block_size
    n = xk.shape[0] * xk.shape[1]
    _int8_rows(k[layer], ks[layer], blocks, offs, xk, 0, n, signs, P, inv_sqrt_p, False)
    _int8_rows(v[layer], vs[layer], blocks, offs, xv, 0, n, signs, P, inv_sqrt_p, True)


@numba.njit(parallel=True, **WJIT)
def write_kv_int8_parallel(k, v, ks, vs, layer, slots, block_size, xk, xv, signs, P, inv_sqrt_p):
    """`write_kv_int8` over the calling thread's Numba threads, K's and V's rows PIECE a piece in
    one parallel region: a batch's append (32 tokens, 8 kv heads: ~160 µs a layer on one of 2
    cores) otherwise runs alone before every layer's host attention while the other cores wait."""
    blocks, offs = slots // block_size, slots % block_size
    n = xk.shape[0] * xk.shape[1]
    m = (n + PIECE - 1) // PIECE
    for c in prange(2 * m):
        r0 = (c % m) * PIECE
        r1 = min(r0 + PIECE, n)
        if c < m:
            _int8_rows(k[layer], ks[layer], blocks, offs, xk, r0, r1, signs, P, inv_sqrt_p, False)
        else:
            _int8_rows(v[layer], vs[layer], blocks, offs, xv, r0, r1, signs, P, inv_sqrt_p, True)


def write_numba(pool: HostKVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """HostKVPool.write's body for bf16/int8/int4: torch tensors in, pool updated in place.

    One Numba call per layer for k and v together, on the pool's cached numpy views
    (`HostKVPool.arrays`): a decode step's 30-32 appends are Python overhead more than work.
    int4 first makes sure the tails have a free slot for every block the write may open."""
    write_arrays(pool, layer, np.asarray(slots.numpy(), np.int64), _f32(k), _f32(v))


def write_arrays(pool: HostKVPool, layer: int, sl: np.ndarray, xk: np.ndarray, xv: np.ndarray) -> None:
    """`HostKVPool.write` on numpy arrays: flat slots sl [T] int64, xk and xv [T, Hkv, D] float32, C-contiguous."""
    if pool.dtype is KVDtype.F32:  # the exact pool's writer is torch's
        pool.write(layer, torch.from_numpy(sl), torch.from_numpy(xk), torch.from_numpy(xv))
        return
    a = pool.arrays
    if pool.dtype is KVDtype.BF16:
        write_kv_bf16(a["k"], a["v"], layer, sl, pool.block_size, xk, xv)
    elif pool.dtype is KVDtype.INT8:  # past two pieces of rows, the pieces spread over the threads
        write = write_kv_int8_parallel if xk.shape[0] * xk.shape[1] > 2 * PIECE else write_kv_int8
        write(a["k"], a["v"], a["k_scale"], a["v_scale"], layer, sl, pool.block_size, xk, xv,
              *rotation.numba_args(pool.head_dim))
    else:
        write_int4_arrays(pool, layer, sl, xk, xv)


def _f32(x: torch.Tensor) -> np.ndarray:
    """A [T, Hkv, D] tensor as a C-contiguous float32 numpy array (no copy when it is one)."""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.requires_grad:
        x = x.detach().to(torch.float32).contiguous()
    return x.numpy()
