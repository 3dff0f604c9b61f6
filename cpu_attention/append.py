"""Numba quantizing append into the host pool: the hot path of HostKVPool.write.

A decode step appends one token per sequence in each of 32 layers; the torch version
(`layout.quantize` + indexed stores) costs hundreds of microseconds a call in small-op
overhead, this one a few. Same numbers as the torch twins (`layout.quantize`, and for int4
keys `int4.append_keys`: round half to even, the same float32 formulas in the same order,
the same rotation butterflies and clip search), without fastmath so every operation rounds
as torch's does.
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
def write_int4_values(dst, sc, zr, blocks, offs, x, clips, min_scale, signs, P, inv_sqrt_p, group):
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


@numba.njit(inline="always", **WJIT)
def _nibble(d, group):
    """(byte, shift) of element d in a packed row (see layout.py)."""
    half = group // 2
    return (d // group) * half + d % half, np.uint8(4 * ((d % group) // half))


@numba.njit(**WJIT)
def write_int4_keys(dst, sc, zr, order, blocks, offs, x, min_scale, group):
    """dst [NB, Hkv, BS, D/2] uint8; sc, zr [NB, Hkv, D] uint16 (bf16 bits); x [T, Hkv, D] float32;
    order: the tokens sorted by block (stably), so each block's tokens are one run. The rule
    (per block, head, channel: start, grow and re-round, quantize) is `int4.append_keys`'s."""
    T, H, D = x.shape
    BS = dst.shape[2]
    fifteen = np.float32(15.0)
    r0 = 0
    while r0 < T:
        b = blocks[order[r0]]
        r1 = r0
        fresh = False
        while r1 < T and blocks[order[r1]] == b:
            fresh = fresh or offs[order[r1]] == 0
            r1 += 1
        for h in range(H):
            for d in range(D):
                byte, shift = _nibble(d, group)
                keep = np.uint8(0xF0) >> shift  # the other nibble of the byte
                xmin = xmax = x[order[r0], h, d]
                for r in range(r0 + 1, r1):
                    xmin = min(xmin, x[order[r], h, d])
                    xmax = max(xmax, x[order[r], h, d])
                s, z = bf16_to_f32(sc[b, h, d]), bf16_to_f32(zr[b, h, d])
                if fresh:
                    lo, hi, grow = xmin, xmax, True
                else:
                    grow = xmin < z - s / np.float32(2.0) or xmax > z + np.float32(15.5) * s
                    lo, hi = min(z, xmin), max(z + fifteen * s, xmax)
                if grow:
                    s16 = f32_to_bf16(max((hi - lo) / fifteen, min_scale))
                    z16 = f32_to_bf16(lo)
                    s2, z2 = bf16_to_f32(s16), bf16_to_f32(z16)
                    if not fresh:  # re-round the block's codes onto the wider grid
                        for o in range(BS):
                            old = np.float32((dst[b, h, o, byte] >> shift) & np.uint8(15)) * s + z
                            c = min(max(np.rint((old - z2) / s2), np.float32(0.0)), fifteen)
                            dst[b, h, o, byte] = (dst[b, h, o, byte] & keep) | (np.uint8(c) << shift)
                    sc[b, h, d], zr[b, h, d] = s16, z16
                    s, z = s2, z2
                for r in range(r0, r1):
                    t = order[r]
                    c = min(max(np.rint((x[t, h, d] - z) / s), np.float32(0.0)), fifteen)
                    dst[b, h, offs[t], byte] = (dst[b, h, offs[t], byte] & keep) | (np.uint8(c) << shift)
        r0 = r1


def write_numba(pool, layer: int, blocks, offs, k, v) -> None:
    """HostKVPool.write's body for bf16/int8/int4: torch tensors in, pool updated in place."""
    import torch

    from cpu_attention import int4, rotation
    from cpu_attention.layout import KVDtype

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
        elif name == "k":  # int4 keys: per channel and block
            write_int4_keys(data.numpy(), u16(pool.k_scale[layer]), u16(pool.k_zero[layer]),
                            np.argsort(bl, kind="stable"), bl, of, xn, np.float32(int4.MIN_SCALE), int4.GROUP)
        else:  # int4 values: rotated, per token and group
            D = pool.head_dim
            write_int4_values(data.numpy(), u16(pool.v_scale[layer]), u16(pool.v_zero[layer]), bl, of, xn,
                              np.array(int4.CLIPS, np.float32), np.float32(int4.MIN_SCALE), rotation.signs(D).numpy(),
                              rotation.block(D), np.float32(rotation.inv_sqrt(D).item()), int4.GROUP)
