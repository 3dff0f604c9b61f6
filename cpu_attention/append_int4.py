"""Numba quantizing append into an int4 host pool (`append.py` dispatches here): a block's tokens
gather in its bf16 tail until the block completes, then the block is quantized (keys per channel,
values per row and group with a clip search) and the tail freed; a block written again comes
back into a tail first. The rule, step by step, is `int4.write`'s, and the bits are the same.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numba
import numpy as np
from numba import prange

from cpu_attention import int4, rotation
from cpu_attention._hadamard import rotate_rows
from cpu_attention._numba import WJIT, bf16_to_f32, f32_to_bf16

if TYPE_CHECKING:
    from cpu_attention.pool import HostKVPool

_CLIPS = np.array(int4.CLIPS, np.float32)


@numba.njit(**WJIT)
def _quantize_row(y, dst, sc, zr, clips, min_scale, group, codes, best, e2):
    """One rotated value row y [D] float32 → dst [D/2] uint8, sc, zr [D/group] uint16 (bf16
    bits): per group, of the CLIPS ranges the one of least squared error (int4.quantize_rows).
    codes, best [group] uint8 and e2 [group] float32 are scratch. The codes and squared errors
    are one loop (elementwise, so it vectorizes), their sum a second (in order, as before):
    one loop with the running sum stayed scalar, ~3x slower."""
    half = group // 2
    for gr in range(y.shape[0] // group):
        yg = y[gr * group:(gr + 1) * group]
        lo, hi = yg.min(), yg.max()
        best_err = np.float32(np.inf)
        bs16 = bz16 = np.uint16(0)
        for f in clips:
            c = (hi + lo) / np.float32(2.0)
            s16 = f32_to_bf16(max((hi - lo) * f / np.float32(15.0), min_scale))
            z16 = f32_to_bf16(c - (hi - lo) * f / np.float32(2.0))
            s, z = bf16_to_f32(s16), bf16_to_f32(z16)
            for i in range(group):
                q = min(max(np.rint((yg[i] - z) / s), np.float32(0.0)), np.float32(15.0))
                codes[i] = np.uint8(q)
                e = q * s + z - yg[i]
                e2[i] = e * e
            err = np.float32(0.0)
            for i in range(group):
                err += e2[i]
            if err < best_err:
                best_err, bs16, bz16 = err, s16, z16
                best[:] = codes[:group]
        sc[gr], zr[gr] = bs16, bz16
        for i in range(half):
            dst[gr * half + i] = best[i] | (best[half + i] << np.uint8(4))


@numba.njit(**WJIT)
def _quantize_heads(kd, ks, kz, vd, vs, vz, tk, tv, slot, b, clips, min_scale, group, h0, h1):
    """Block b's int4 data of kv heads h0 .. h1 (each head's data is its own) from tail slot
    (int4.quantize_keys / quantize_rows): keys per channel over the BS rows (stored in the VNNI
    order, int4.pack_keys), values per row and group (stored in quads of 4 tokens, int4.quads)."""
    BS, D = tk.shape[2], tk.shape[3]
    lo, hi = np.empty(D, np.float32), np.empty(D, np.float32)
    s, z = np.empty(D, np.float32), np.empty(D, np.float32)
    y = np.empty(D, np.float32)
    codes, best = np.empty(max(D, group), np.uint8), np.empty(group, np.uint8)
    e2 = np.empty(group, np.float32)
    row = np.empty(D // 2, np.uint8)
    for h in range(h0, h1):
        for d in range(D):
            lo[d] = hi[d] = bf16_to_f32(tk[slot, h, 0, d])
        for o in range(1, BS):
            for d in range(D):
                x = bf16_to_f32(tk[slot, h, o, d])
                lo[d], hi[d] = min(lo[d], x), max(hi[d], x)
        for d in range(D):
            s16 = f32_to_bf16(max((hi[d] - lo[d]) / np.float32(15.0), min_scale))
            z16 = f32_to_bf16(lo[d])
            ks[b, h, d], kz[b, h, d] = s16, z16
            s[d], z[d] = bf16_to_f32(s16), bf16_to_f32(z16)
        for o in range(BS):
            for d in range(D):
                x = bf16_to_f32(tk[slot, h, o, d])
                codes[d] = np.uint8(min(max(np.rint((x - z[d]) / s[d]), np.float32(0.0)), np.float32(15.0)))
            for r in range(D // 8):  # byte (r, o, j): channels 8r + j (low nibble), 8r + 4 + j (high)
                for j in range(4):
                    kd[b, h, r, o, j] = codes[8 * r + j] | (codes[8 * r + 4 + j] << np.uint8(4))
            for d in range(D):
                y[d] = bf16_to_f32(tv[slot, h, o, d])
            _quantize_row(y, row, vs[b, h, o], vz[b, h, o], clips, min_scale, group, codes, best, e2)
            for c in range(D // 2):  # into its quad (int4.quads)
                vd[b, h, o >> 2, c, o & 3] = row[c]


@numba.njit(**WJIT)
def _dequantize_heads(kd, ks, kz, vd, vs, vz, tk, tv, slot, b, group, h0, h1):
    """Block b's int4 data of kv heads h0 .. h1 back into tail slot, rounded to bf16 (int4.write,
    step 1)."""
    BS, D = tk.shape[2], tk.shape[3]
    half = group // 2
    for h in range(h0, h1):
        for o in range(BS):
            for r in range(D // 8):
                for j in range(4):
                    byte = kd[b, h, r, o, j]
                    for e, c in ((8 * r + j, byte & np.uint8(15)), (8 * r + 4 + j, byte >> np.uint8(4))):
                        tk[slot, h, o, e] = f32_to_bf16(np.float32(c) * bf16_to_f32(ks[b, h, e]) + bf16_to_f32(kz[b, h, e]))
            for gr in range(D // group):
                a, z = bf16_to_f32(vs[b, h, o, gr]), bf16_to_f32(vz[b, h, o, gr])
                for i in range(half):
                    byte = vd[b, h, o >> 2, gr * half + i, o & 3]
                    tv[slot, h, o, gr * group + i] = f32_to_bf16(np.float32(byte & np.uint8(15)) * a + z)
                    tv[slot, h, o, gr * group + half + i] = f32_to_bf16(np.float32(byte >> np.uint8(4)) * a + z)


@numba.njit(**WJIT)
def write_int4(kd, ks, kz, vd, vs, vz, tk, tv, tail_slot, free, n_free, slots, order, start, flags, xk, xv,
               clips, min_scale, signs, P, inv_sqrt_p, group):
    """One layer of an int4 pool: kd [NB, Hkv, D/8, BS, 4] (int4.py's VNNI key order), vd [NB, Hkv,
    BS4/4, D/2, 4] uint8 (its value quads); ks, kz [NB, Hkv, D] and vs, vz
    [NB, Hkv, BS, D/group] uint16 (bf16 bits); tails tk, tv [S, Hkv, BS, D] uint16 (bf16 bits),
    tail_slot [NB] int32, free slots free[:n_free[0]] (enough of them: Tails.reserve); slots [T]
    flat, their groups by block `order, start, flags` (`int4_groups`); xk, xv [T, Hkv, D] float32;
    signs, P, inv_sqrt_p: the rotation. The rule, step by step, is int4.write's."""
    T, H, D = xk.shape
    BS = vs.shape[2]
    yv = xv.reshape(T * H, D).copy()  # the values rotated all at once (`rotate_rows`: the same bits)
    rotate_rows(yv, signs, P, inv_sqrt_p)
    for g in range(flags.shape[0]):
        b = slots[order[start[g]]] // BS
        s = tail_slot[b]
        if s < 0:  # 1. take a tail; a block written before comes back into it
            n_free[0] -= 1
            s = free[n_free[0]]
            tail_slot[b] = s
            if not flags[g] & 1:
                _dequantize_heads(kd, ks, kz, vd, vs, vz, tk, tv, s, b, group, 0, H)
        for r in range(start[g], start[g + 1]):  # 2. the tokens, in call order
            t = order[r]
            o = slots[t] % BS
            for h in range(H):
                rk, rv, xr, yr = tk[s, h, o], tv[s, h, o], xk[t, h], yv[t * H + h]
                for d in range(D):
                    rk[d] = f32_to_bf16(xr[d])
                    rv[d] = f32_to_bf16(yr[d])
        if flags[g] & 2:  # 3. complete: quantize, free the tail
            _quantize_heads(kd, ks, kz, vd, vs, vz, tk, tv, s, b, clips, min_scale, group, 0, H)
            free[n_free[0]] = s
            n_free[0] += 1
            tail_slot[b] = -1


@numba.njit(**WJIT)
def tail_slots_needed(tail_slot, slots, block_size):
    """`int4.slots_needed` for flat slots [T]; tail_slot [NB] int32 of the layer."""
    blocks = slots // block_size
    ub = np.unique(blocks)
    ends = np.zeros(ub.shape[0], np.bool_)
    for t in range(slots.shape[0]):
        if slots[t] % block_size == block_size - 1:
            ends[np.searchsorted(ub, blocks[t])] = True
    n, completed = 0, 0
    for i in range(ub.shape[0]):
        if tail_slot[ub[i]] < 0:
            if ends[i]:
                completed = 1
            else:
                n += 1
    return n + completed


@numba.njit(**WJIT)
def write_kv_int4(k, v, ks, kz, vs, vz, tk, tv, tail_slot, free, n_free, layer, slots, xk, xv,
                  clips, min_scale, signs, P, inv_sqrt_p, group, only_filling=False):
    """As write_kv_bf16 for an int4 pool (`write_int4`'s arguments, all layers; tail_slot
    [L, NB]): the tokens' groups by block are made here (`int4_groups`).
    only_filling: write only if no token completes its block or writes into a block that has no
    tail at an offset past 0 (a block coming back), and say whether it wrote: the other calls
    are `write_kv_int4_parallel`'s to take."""
    BS = vs.shape[3]
    if only_filling:
        for t in range(slots.shape[0]):
            o = slots[t] % BS
            if o == BS - 1 or (o != 0 and tail_slot[layer, slots[t] // BS] < 0):
                return False
    order, start, flags = int4_groups(tail_slot[layer], slots, BS)
    write_int4(k[layer], ks[layer], kz[layer], v[layer], vs[layer], vz[layer], tk, tv, tail_slot[layer],
               free, n_free, slots, order, start, flags, xk, xv, clips, min_scale, signs, P, inv_sqrt_p, group)
    return True


@numba.njit(**WJIT)
def int4_groups(tail_slot, slots, block_size):
    """The tokens of flat slots [T] by block (tail_slot [NB] int32: the layer's) → (order: the
    tokens sorted by block, stably; start [G + 1]: group g is order[start[g]:start[g + 1]]; flags
    [G] int8: bit 0 the group starts its block, bit 1 ends it, bit 2 its block has no tail yet)."""
    blocks = slots // block_size
    order = np.argsort(blocks, kind="mergesort")
    T = slots.shape[0]
    start = np.empty(T + 1, np.int64)
    flags = np.zeros(T, np.int8)
    g, r = 0, 0
    while r < T:
        b = blocks[order[r]]
        start[g] = r
        if tail_slot[b] < 0:
            flags[g] |= 4
        while r < T and blocks[order[r]] == b:
            o = slots[order[r]] % block_size
            if o == 0:
                flags[g] |= 1
            if o == block_size - 1:
                flags[g] |= 2
            r += 1
        g += 1
    start[g] = T
    return order, start[: g + 1], flags[:g]


def int4_parallel(flags: np.ndarray) -> bool:
    """Whether `write_kv_int4_parallel` takes a call (flags: `int4_groups`'): where a block
    completes or comes back into a tail (the work worth threads), and none is both started and
    completed by it (a prefill's whole blocks: the serial writer reuses one tail for them, where
    the parallel one would hold a tail for each at once)."""
    return bool(((flags & 2) != 0).any() or ((flags & 5) == 4).any()) and not bool(((flags & 3) == 3).any())


@numba.njit(parallel=True, **WJIT)
def write_kv_int4_parallel(k, v, ks, kz, vs, vz, tk, tv, tail_slot, free, n_free, layer, slots, xk, xv,
                           clips, min_scale, signs, P, inv_sqrt_p, group, order, start, flags):
    """`write_kv_int4` with its blocks' work spread over the calling thread's Numba threads, an item
    a (block, kv head): the values rotated and the tails taken first (serially, the tails in block
    order), then each item's rows written, its head dequantized where the block comes back into a
    tail and quantized where it completes (`_quantize_heads`: the same bits), then the completed
    blocks' tails freed. A decode step completes a block every block_size steps a sequence, and its
    quantization (a clip search a value row) took ~260 µs a block of 8 kv heads on one core of the
    2-core machine, ~1 ms a layer on the GPU host where 32 sequences completed theirs at once;
    `order, start, flags` from `int4_groups`, none starting and completing its block (`int4_parallel`)."""
    T, H, D = xk.shape
    BS = vs.shape[3]
    G = flags.shape[0]
    kd, kss, kzz, vd, vss, vzz, ts = k[layer], ks[layer], kz[layer], v[layer], vs[layer], vz[layer], tail_slot[layer]
    yv = xv.reshape(T * H, D).copy()  # the values rotated all at once, as `write_int4`
    rotate_rows(yv, signs, P, inv_sqrt_p)
    gslot = np.empty(G, np.int64)
    for g in range(G):  # 1. tails, in block order (as the serial writer takes them)
        b = slots[order[start[g]]] // BS
        s = ts[b]
        if s < 0:
            n_free[0] -= 1
            s = free[n_free[0]]
            ts[b] = s
        gslot[g] = s
    for item in prange(G * H):  # 2. a (block, kv head) each
        g, h = item // H, item % H
        s, b = gslot[g], slots[order[start[g]]] // BS
        if (flags[g] & 5) == 4:  # a block written before comes back into its tail
            _dequantize_heads(kd, kss, kzz, vd, vss, vzz, tk, tv, s, b, group, h, h + 1)
        for r in range(start[g], start[g + 1]):
            t = order[r]
            o = slots[t] % BS
            rk, rv, xr, yr = tk[s, h, o], tv[s, h, o], xk[t, h], yv[t * H + h]
            for d in range(D):
                rk[d] = f32_to_bf16(xr[d])
                rv[d] = f32_to_bf16(yr[d])
        if flags[g] & 2:
            _quantize_heads(kd, kss, kzz, vd, vss, vzz, tk, tv, s, b, clips, min_scale, group, h, h + 1)
    for g in range(G):  # 3. completed blocks give their tails back
        if flags[g] & 2:
            free[n_free[0]] = gslot[g]
            n_free[0] += 1
            ts[slots[order[start[g]]] // BS] = -1


def write_int4_arrays(pool: HostKVPool, layer: int, sl: np.ndarray, xk: np.ndarray, xv: np.ndarray) -> None:
    """`append.write_arrays` for an int4 pool. A call that only fills tails (most of a decode's)
    goes to the serial writer, as one Numba call; where a block completes or comes back into a
    tail, in parallel if none starts and completes here (`int4_parallel`), else serially. The
    tails first get a free slot for every block the writer may hold at once: the serial one frees a
    completed block's tail before the next block's, the parallel one holds a tail for each."""
    tails, BS = pool.tails, pool.block_size
    tails.reserve(tail_slots_needed(tails.arrays["slot"][layer], sl, BS))
    if write_kv_int4(*_int4_args(pool, layer, sl, xk, xv), True):
        return
    groups = int4_groups(tails.arrays["slot"][layer], sl, BS)
    if int4_parallel(groups[2]):
        tails.reserve(int(((groups[2] & 4) != 0).sum()))
        write_kv_int4_parallel(*_int4_args(pool, layer, sl, xk, xv), *groups)
    else:
        write_kv_int4(*_int4_args(pool, layer, sl, xk, xv))


def _int4_args(pool: HostKVPool, layer: int, sl: np.ndarray, xk: np.ndarray, xv: np.ndarray) -> tuple:
    """The writers' arguments (the tails' arrays as they are now: `Tails.reserve` may grow them)."""
    a, t = pool.arrays, pool.tails.arrays
    return (a["k"], a["v"], a["k_scale"], a["k_zero"], a["v_scale"], a["v_zero"], t["k"], t["v"], t["slot"],
            t["free"], t["n_free"], layer, sl, xk, xv, _CLIPS, np.float32(int4.MIN_SCALE),
            *rotation.numba_args(pool.head_dim), int4.GROUP)
