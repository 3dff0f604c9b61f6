"""Numba quantizing append into the host pool: the hot path of HostKVPool.write.

A decode step appends one token per sequence in each of 32 layers; the torch version
(`layout.quantize` + indexed stores) costs hundreds of microseconds a call in small-op
overhead, this one a few. Same numbers as `layout.quantize` (round half to even, the same
float32 formulas, the same int4 clip search), without fastmath so divisions stay exact.
"""
from __future__ import annotations

import numba
import numpy as np
import torch

from cpu_attention._numba import f16_to_f32, f32_to_bf16, f32_to_f16
from cpu_attention.layout import INT4_CLIPS, INT4_GROUP, HostKVPool, KVDtype

WJIT = dict(nogil=True, cache=True)
_INT4_CLIPS = np.array(INT4_CLIPS, np.float32)


@numba.njit(**WJIT)
def write_bf16(dst, blocks, offs, x):
    """dst [NB, Hkv, BS, D] uint16; blocks, offs [T]; x [T, Hkv, D] float32."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for d in range(x.shape[2]):
                dst[blocks[t], h, offs[t], d] = f32_to_bf16(x[t, h, d])


@numba.njit(**WJIT)
def write_int8(dst, sc, blocks, offs, x):
    """dst [NB, Hkv, BS, D] int8, sc [NB, Hkv, BS] float32: x ≈ dst * sc."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            amax = np.float32(0.0)
            for d in range(x.shape[2]):
                amax = max(amax, abs(x[t, h, d]))
            s = max(amax, np.float32(1e-8)) / np.float32(127.0)
            sc[blocks[t], h, offs[t]] = s
            for d in range(x.shape[2]):
                c = min(max(np.rint(x[t, h, d] / s), np.float32(-127.0)), np.float32(127.0))
                dst[blocks[t], h, offs[t], d] = np.int8(c)


@numba.njit(**WJIT)
def write_int4(dst, sc, zr, blocks, offs, x, clips, group):
    """dst [NB, Hkv, BS, D/2] uint8; sc, zr [NB, Hkv, BS, D/group] uint16 (f16 bits)."""
    codes = np.empty(group, np.uint8)
    best = np.empty(group, np.uint8)
    for t in range(x.shape[0]):
        b, o = blocks[t], offs[t]
        for h in range(x.shape[1]):
            for gr in range(x.shape[2] // group):
                xg = x[t, h, gr * group:(gr + 1) * group]
                lo, hi = xg.min(), xg.max()
                best_err = np.float32(np.inf)
                bs16 = bz16 = np.uint16(0)
                for f in clips:
                    c = (hi + lo) / np.float32(2.0)
                    s16 = f32_to_f16(max((hi - lo) * f / np.float32(15.0), np.float32(2.0**-14)))
                    z16 = f32_to_f16(c - (hi - lo) * f / np.float32(2.0))
                    s, z = f16_to_f32(s16), f16_to_f32(z16)
                    err = np.float32(0.0)
                    for i in range(group):
                        q = min(max(np.rint((xg[i] - z) / s), np.float32(0.0)), np.float32(15.0))
                        codes[i] = np.uint8(q)
                        e = q * s + z - xg[i]
                        err += e * e
                    if err < best_err:
                        best_err, bs16, bz16 = err, s16, z16
                        best[:] = codes
                sc[b, h, o, gr] = bs16
                zr[b, h, o, gr] = bz16
                for i in range(group // 2):
                    dst[b, h, o, gr * (group // 2) + i] = best[2 * i] | (best[2 * i + 1] << np.uint8(4))


@numba.njit(**WJIT)
def write_kv_bf16(k, v, layer, slots, block_size, xk, xv):
    """k, v [L, NB, Hkv, BS, D] uint16; slots [T] flat; xk, xv [T, Hkv, D] float32."""
    blocks, offs = slots // block_size, slots % block_size
    write_bf16(k[layer], blocks, offs, xk)
    write_bf16(v[layer], blocks, offs, xv)


@numba.njit(**WJIT)
def write_kv_int8(k, v, ks, vs, layer, slots, block_size, xk, xv):
    """As write_kv_bf16 for int8 codes k, v and their scales ks, vs [L, NB, Hkv, BS] float32."""
    blocks, offs = slots // block_size, slots % block_size
    write_int8(k[layer], ks[layer], blocks, offs, xk)
    write_int8(v[layer], vs[layer], blocks, offs, xv)


@numba.njit(**WJIT)
def write_kv_int4(k, v, ks, vs, kz, vz, layer, slots, block_size, xk, xv, clips, group):
    """As write_kv_bf16 for packed int4 codes and their group scales and zeros (see write_int4)."""
    blocks, offs = slots // block_size, slots % block_size
    write_int4(k[layer], ks[layer], kz[layer], blocks, offs, xk, clips, group)
    write_int4(v[layer], vs[layer], vz[layer], blocks, offs, xv, clips, group)


def write_numba(pool: HostKVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """HostKVPool.write's body for bf16/int8/int4: torch tensors in, pool updated in place.

    One Numba call per layer for k and v together, on the pool's cached numpy views
    (`HostKVPool.arrays`): a decode step's 30-32 appends are Python overhead more than work."""
    a = pool.arrays
    sl = np.asarray(slots.numpy(), np.int64)
    xk, xv = _f32(k), _f32(v)
    if pool.dtype is KVDtype.BF16:
        write_kv_bf16(a["k"], a["v"], layer, sl, pool.block_size, xk, xv)
    elif pool.dtype is KVDtype.INT8:
        write_kv_int8(a["k"], a["v"], a["k_scale"], a["v_scale"], layer, sl, pool.block_size, xk, xv)
    else:
        write_kv_int4(a["k"], a["v"], a["k_scale"], a["v_scale"], a["k_zero"], a["v_zero"], layer, sl,
                      pool.block_size, xk, xv, _INT4_CLIPS, INT4_GROUP)


def _f32(x: torch.Tensor) -> np.ndarray:
    """A [T, Hkv, D] tensor as a C-contiguous float32 numpy array (no copy when it is one)."""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.requires_grad:
        x = x.detach().to(torch.float32).contiguous()
    return x.numpy()
