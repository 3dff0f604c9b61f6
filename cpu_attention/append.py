"""Numba quantizing append into the host pool: the hot path of HostKVPool.write.

A decode step appends one token per sequence in each of 32 layers; the torch version
(`layout.quantize` + indexed stores) costs hundreds of microseconds a call in small-op
overhead, this one a few. Same numbers as `layout.quantize` (round half to even, the same
float32 formulas, the same int4 rotation butterflies and clip search), without fastmath so
every operation rounds as torch's does.
"""
from __future__ import annotations

import numba
import numpy as np

from cpu_attention._numba import bf16_to_f32, f32_to_bf16, hadamard_rotate

WJIT = dict(nogil=True, cache=True)


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
def write_int4(dst, sc, zr, blocks, offs, x, clips, min_scale, signs, P, inv_sqrt_p, group):
    """dst [NB, Hkv, BS, D/2] uint8; sc, zr [NB, Hkv, BS, D/group] uint16 (bf16 bits); x [T, Hkv, D]
    float32, rotated here (signs [D], block P, inv_sqrt_p = float32(1/sqrt(P))) and quantized."""
    half = group // 2
    y = np.empty(x.shape[2], np.float32)
    codes = np.empty(group, np.uint8)
    best = np.empty(group, np.uint8)
    for t in range(x.shape[0]):
        b, o = blocks[t], offs[t]
        for h in range(x.shape[1]):
            hadamard_rotate(x[t, h], signs, P, inv_sqrt_p, y)
            for gr in range(x.shape[2] // group):
                yg = y[gr * group:(gr + 1) * group]
                lo, hi = yg.min(), yg.max()
                best_err = np.float32(np.inf)
                bs16 = bz16 = np.uint16(0)
                for f in clips:
                    c = (hi + lo) / np.float32(2.0)
                    s16 = f32_to_bf16(max((hi - lo) * f / np.float32(15.0), min_scale))
                    z16 = f32_to_bf16(c - (hi - lo) * f / np.float32(2.0))
                    s, z = bf16_to_f32(s16), bf16_to_f32(z16)
                    err = np.float32(0.0)
                    for i in range(group):
                        q = min(max(np.rint((yg[i] - z) / s), np.float32(0.0)), np.float32(15.0))
                        codes[i] = np.uint8(q)
                        e = q * s + z - yg[i]
                        err += e * e
                    if err < best_err:
                        best_err, bs16, bz16 = err, s16, z16
                        best[:] = codes
                sc[b, h, o, gr] = bs16
                zr[b, h, o, gr] = bz16
                for i in range(half):
                    dst[b, h, o, gr * half + i] = best[i] | (best[half + i] << np.uint8(4))


def write_numba(pool, layer: int, blocks, offs, k, v) -> None:
    """HostKVPool.write's body for bf16/int8/int4: torch tensors in, pool updated in place."""
    import torch

    from cpu_attention import rotation
    from cpu_attention.layout import INT4_CLIPS, INT4_GROUP, INT4_MIN_SCALE, KVDtype

    bl = blocks.to(torch.int64).numpy()
    of = offs.to(torch.int64).numpy()
    u16 = lambda t: t.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    for name, x in (("k", k), ("v", v)):
        xn = x.detach().to(torch.float32).contiguous().numpy()
        data = getattr(pool, name)[layer]
        if pool.dtype is KVDtype.BF16:
            write_bf16(u16(data), bl, of, xn)
        elif pool.dtype is KVDtype.INT8:
            write_int8(data.numpy(), getattr(pool, f"{name}_scale")[layer].numpy(), bl, of, xn)
        else:
            D = pool.head_dim
            write_int4(data.numpy(), u16(getattr(pool, f"{name}_scale")[layer]),
                       u16(getattr(pool, f"{name}_zero")[layer]), bl, of, xn,
                       np.array(INT4_CLIPS, np.float32), np.float32(INT4_MIN_SCALE), rotation.signs(D).numpy(),
                       rotation.block(D), np.float32(rotation.inv_sqrt(D).item()), INT4_GROUP)
