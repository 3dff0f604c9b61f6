"""The Numba kernels behind `cpu_attention.linear` (per-row int8 weights): the GEMV, the two fused
decode kernels a layer, the row quantizer. Their torch twins and the wrappers that call them are
in `linear.py`, which imports this module on first use: Numba's import is ~0.2 s, which the
chat's start-up leaves to the engine's background warm-up (`cpu_attention.warm.submit_load`).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

# fastmath lets LLVM split each dot product over SIMD lanes (reassociation) and fuse the
# int8→f32 multiply-add into FMAs; no kernel relies on inf/nan semantics.
_FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}
_JIT = dict(nogil=True, cache=True, fastmath=_FAST)


@njit(inline="always", **_JIT)
def _dot(w, o, x, n):  # Σ_i w[o, i] · x[n, i]; one int8 row against one f32 row
    acc = np.float32(0.0)
    for i in range(w.shape[1]):
        acc += np.float32(w[o, i]) * x[n, i]
    return acc


@njit(inline="always", **_JIT)
def _dot4(w, o, x, n):  # `_dot` for rows n .. n + 3 of x: each weight converted once for the four
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for i in range(w.shape[1]):
        c = np.float32(w[o, i])
        a0 += c * x[n, i]
        a1 += c * x[n + 1, i]
        a2 += c * x[n + 2, i]
        a3 += c * x[n + 3, i]
    return a0, a1, a2, a3


@njit(inline="always", **_JIT)
def _column(w, o, x, s, base, dst, c, T):
    """dst[n, c] = base[n, c] + s · Σ_i w[o, i] · x[n, i] for every row n of x (base None: 0):
    the first 4·T rows four at a time, a weight converted once for the four (past a row or two
    the kernels are bound by the conversions and FMAs: 1.2–1.7× against row by row at 4–16 rows,
    2 cores; their sums may round otherwise than `_dot`'s), the rest one by one, each by the same
    loop, so that with T = 0 a row's output is the same bits whatever rows share the call
    (`linear.ROW_BY_ROW`)."""
    N = x.shape[0]
    for t in range(T):
        n = 4 * t
        a = _dot4(w, o, x, n)
        for j in range(4):
            dst[n + j, c] = a[j] * s if base is None else base[n + j, c] + a[j] * s
    for n in range(4 * T, N):
        dst[n, c] = _dot(w, o, x, n) * s if base is None else base[n, c] + _dot(w, o, x, n) * s


@njit(inline="always", **_JIT)
def _silu_times(g, u):  # SiLU(g) · u
    return g / (np.float32(1.0) + np.exp(-g)) * u


@njit(parallel=True, **_JIT)
def gemv_int8(w, scale, x, out, tiles):
    """out [N, O] f32 = x [N, I] f32 · (w [O, I] int8 · scale [O] f32)ᵀ, the first 4·tiles rows of
    x four at a time (`_column`)."""
    for o in prange(w.shape[0]):
        _column(w, o, x, scale[o], None, out, o, tiles)


@njit(inline="always", **_JIT)
def _rms_norm_into(x, w, eps, out):  # x [N, H] → out [N, H] = x / rms(x) · w
    for n in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(x.shape[1]):
            ss += x[n, i] * x[n, i]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(x.shape[1]) + eps)
        for i in range(x.shape[1]):
            out[n, i] = x[n, i] * r * w[i]


@njit(parallel=True, **_JIT)
def attn_in(x, pos, norm_w, eps, w, scale, bias, cos, sin, h, y, q, k, v, tiles):
    """x [N, H] → y = W·RMSNorm(x) + b split into q [N, Hq, D], k, v [N, Hkv, D]; RoPE on q and k.

    cos, sin [T, D] are the whole tables, pos [N] each token's row in them; h [N, H], y [N, O] scratch.
    """
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    _rms_norm_into(x, norm_w, eps, h)
    for o in prange(w.shape[0]):
        _column(w, o, h, scale[o], None, y, o, tiles)
    half = D // 2
    for n in range(N):
        if bias.shape[0]:
            for o in range(w.shape[0]):
                y[n, o] += bias[o]
        p = pos[n]
        for hd in range(Hq + Hkv):  # rotate-half RoPE: (a, b) → (a·cos − b·sin, b·cos + a·sin)
            t, j = (q, hd) if hd < Hq else (k, hd - Hq)
            for d in range(half):
                a, b = y[n, hd * D + d], y[n, hd * D + half + d]
                t[n, j, d] = a * cos[p, d] - b * sin[p, d]
                t[n, j, half + d] = b * cos[p, half + d] + a * sin[p, half + d]
        for j in range(Hkv):
            for d in range(D):
                v[n, j, d] = y[n, (Hq + Hkv + j) * D + d]


@njit(parallel=True, **_JIT)
def mlp_block(x, attn, wo, so, norm_w, eps, wgu, sgu, wd, sd, h, act, out, tiles):
    """out [N, H] = y + down(SiLU(gate(RMSNorm(y))) · up(RMSNorm(y))) with y = x + O·attn.

    wgu [2F, H] holds the gate rows then the up rows; h [N, H] and act [N, F] are scratch.
    """
    N, F_ = x.shape[0], wd.shape[1]
    for o in prange(wo.shape[0]):
        _column(wo, o, attn, so[o], x, out, o, tiles)
    _rms_norm_into(out, norm_w, eps, h)
    for j in prange(F_):  # gate row j and up row F + j, rows of h as `_column` takes them
        sg, su = sgu[j], sgu[F_ + j]
        for t in range(tiles):
            n = 4 * t
            g, u = _dot4(wgu, j, h, n), _dot4(wgu, F_ + j, h, n)
            for k in range(4):
                act[n + k, j] = _silu_times(g[k] * sg, u[k] * su)
        for n in range(4 * tiles, N):
            act[n, j] = _silu_times(_dot(wgu, j, h, n) * sg, _dot(wgu, F_ + j, h, n) * su)
    for o in prange(wd.shape[0]):
        _column(wd, o, act, sd[o], out, out, o, tiles)


@njit(parallel=True, nogil=True, cache=True)
def quantize_rows(w, q, scale):  # w [O, I] f32 → q [O, I] int8, scale [O] f32; one pass per row
    O, I = w.shape
    for o in prange(O):
        m = np.float32(1e-12)
        for i in range(I):
            m = max(m, abs(w[o, i]))
        s = m / np.float32(127.0)
        scale[o] = s
        inv = np.float32(1.0) / s
        for i in range(I):
            q[o, i] = np.int8(min(127.0, max(-127.0, np.round(w[o, i] * inv))))
