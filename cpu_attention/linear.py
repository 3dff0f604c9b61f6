"""Int8 weights for the CPU path: per-output-row scale, Numba matrix-vector kernels.

Decode on the CPU is bound by the bytes of weight read per token; int8 reads a quarter of
float32 and keeps the error far below the 4-bit source formats the demo model ships in.
Matrix-vector products (a few rows of x) run in Numba; larger x (prefill) dequantizes the
weight and uses torch's GEMM, which is compute-bound there anyway.

A decode step of a small model is as much launch overhead as arithmetic (30 layers × ~60
torch ops of a few µs each), so besides the plain `Int8Linear` there are two fused kernels
that the model's decode path calls once per layer each:

- `attn_in`: RMSNorm → QKV projection (+ bias) → q, k, v with RoPE on q and k;
- `mlp_block`: x + O·attn → RMSNorm → gate/up → SiLU(gate)·up → x + down.

Every kernel has its torch twin here (`*_ref`), composed of the same float operations.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange


# Rows of x up to which the GEMV kernels beat dequantize + GEMM (measured on 2 cores).
GEMV_MAX_ROWS = 8

# fastmath lets LLVM split each dot product over SIMD lanes (reassociation) and fuse the
# int8→f32 multiply-add into FMAs; no kernel relies on inf/nan semantics.
_FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}
_JIT = dict(nogil=True, cache=True, fastmath=_FAST)
_NO_BIAS = np.zeros(0, np.float32)


@njit(inline="always", **_JIT)
def _dot(w, o, x, n):  # Σ_i w[o, i] · x[n, i]; one int8 row against one f32 row
    acc = np.float32(0.0)
    for i in range(w.shape[1]):
        acc += np.float32(w[o, i]) * x[n, i]
    return acc


@njit(parallel=True, **_JIT)
def _gemv_int8(w, scale, x, out):  # w [O, I] int8, scale [O] f32, x [N, I] f32, out [N, O] f32
    for o in prange(w.shape[0]):
        for n in range(x.shape[0]):
            out[n, o] = _dot(w, o, x, n) * scale[o]


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
def _attn_in(x, pos, norm_w, eps, w, scale, bias, cos, sin, h, y, q, k, v):
    """x [N, H] → y = W·RMSNorm(x) + b split into q [N, Hq, D], k, v [N, Hkv, D]; RoPE on q and k.

    cos, sin [T, D] are the whole tables, pos [N] each token's row in them; h [N, H], y [N, O] scratch.
    """
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    _rms_norm_into(x, norm_w, eps, h)
    for o in prange(w.shape[0]):
        for n in range(N):
            y[n, o] = _dot(w, o, h, n) * scale[o]
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
def _mlp_block(x, attn, wo, so, norm_w, eps, wgu, sgu, wd, sd, h, act, out):
    """out [N, H] = y + down(SiLU(gate(RMSNorm(y))) · up(RMSNorm(y))) with y = x + O·attn.

    wgu [2F, H] holds the gate rows then the up rows; h [N, H] and act [N, F] are scratch.
    """
    N, F_ = x.shape[0], wd.shape[1]
    for o in prange(wo.shape[0]):
        for n in range(N):
            out[n, o] = x[n, o] + _dot(wo, o, attn, n) * so[o]
    _rms_norm_into(out, norm_w, eps, h)
    for j in prange(F_):
        for n in range(N):
            g = _dot(wgu, j, h, n) * sgu[j]
            u = _dot(wgu, F_ + j, h, n) * sgu[F_ + j]
            act[n, j] = g / (np.float32(1.0) + np.exp(-g)) * u
    for o in prange(wd.shape[0]):
        for n in range(N):
            out[n, o] += _dot(wd, o, act, n) * sd[o]


@njit(parallel=True, nogil=True, cache=True)
def _quantize_rows(w, q, scale):  # w [O, I] f32 → q [O, I] int8, scale [O] f32; one pass per row
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


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] → (int8 [O, I], scale [O]) with scale = max|row| / 127."""
    w = w.float().contiguous()
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0])
    _quantize_rows(w.numpy(), q.numpy(), scale.numpy())
    return q, scale


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.q, self.scale = quantize_rows(weight)
        self.bias = None if bias is None else bias.float()
        self.out_features, self.in_features = weight.shape
        self._qn, self._sn = self.q.numpy(), self.scale.numpy()
        self._bn = _NO_BIAS if bias is None else self.bias.numpy()

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """A linear over weights already in this format (`offload.int8_cache`)."""
        self = cls.__new__(cls)
        self.q, self.scale = q.contiguous(), scale.float().contiguous()
        self.bias = None if bias is None else bias.float()
        self.out_features, self.in_features = q.shape
        self._qn, self._sn = self.q.numpy(), self.scale.numpy()
        self._bn = _NO_BIAS if bias is None else self.bias.numpy()
        return self

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        if x.shape[0] > GEMV_MAX_ROWS:
            return int8_linear_ref(x, self.q, self.scale, self.bias)
        out = torch.empty(x.shape[0], self.out_features)
        _gemv_int8(self._qn, self._sn, x.numpy(), out.numpy())
        return out if self.bias is None else out + self.bias


def attn_in(x: torch.Tensor, pos: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv: Int8Linear,
            cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] f32, pos [N] → q [N, Hq, D], k, v [N, Hkv, D] = split(qkv(RMSNorm(x))), q and k rotated.

    cos, sin [T, D] are RoPE tables covering every position in pos; N ≤ GEMV_MAX_ROWS.
    """
    N, H = x.shape
    D = qkv.out_features // (num_heads + 2 * num_kv_heads)
    # numpy buffers wrapped by from_numpy: a third of torch.empty + .numpy() per call, once per layer
    q, k, v = (np.empty((N, heads, D), np.float32) for heads in (num_heads, num_kv_heads, num_kv_heads))
    _attn_in(x.numpy(), pos.numpy(), norm_w.numpy(), np.float32(eps), qkv._qn, qkv._sn, qkv._bn, cos.numpy(),
             sin.numpy(), np.empty((N, H), np.float32), np.empty((N, qkv.out_features), np.float32), q, k, v)
    return torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)


def mlp_block(x: torch.Tensor, attn: torch.Tensor, o: Int8Linear, norm_w: torch.Tensor, eps: float,
              gate_up: Int8Linear, down: Int8Linear) -> torch.Tensor:
    """x [N, H] f32, attn [N, Hq, D] or [N, Hq·D] → the layer's output [N, H] (no biases); N ≤ GEMV_MAX_ROWS."""
    N, H = x.shape
    out = np.empty((N, H), np.float32)
    _mlp_block(x.numpy(), attn.float().numpy().reshape(N, -1), o._qn, o._sn, norm_w.numpy(), np.float32(eps), gate_up._qn, gate_up._sn,
               down._qn, down._sn, np.empty((N, H), np.float32), np.empty((N, down.in_features), np.float32), out)
    return torch.from_numpy(out)


# ---------------------------------------------------------------------------- torch twins
def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch twin: dequantize, then an ordinary linear (in x's dtype, float32 or float64)."""
    dt = x.dtype if x.dtype == torch.float64 else torch.float32
    return F.linear(x.to(dt), q.to(dt) * scale[:, None].to(dt), None if bias is None else bias.to(dt))


def _rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(x.dtype)


def attn_in_ref(x: torch.Tensor, pos: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv: Int8Linear,
                cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N = x.shape[0]
    y = int8_linear_ref(_rms_norm_ref(x, norm_w, eps), qkv.q, qkv.scale, qkv.bias)
    y = y.reshape(N, num_heads + 2 * num_kv_heads, -1)
    r, v = y[:, : num_heads + num_kv_heads], y[:, num_heads + num_kv_heads:]
    h = y.shape[-1] // 2
    rot = torch.cat([-r[..., h:], r[..., :h]], dim=-1)
    r = r * cos[pos][:, None].to(y.dtype) + rot * sin[pos][:, None].to(y.dtype)
    return r[:, :num_heads], r[:, num_heads:], v


def mlp_block_ref(x: torch.Tensor, attn: torch.Tensor, o: Int8Linear, norm_w: torch.Tensor, eps: float,
                  gate_up: Int8Linear, down: Int8Linear) -> torch.Tensor:
    y = x + int8_linear_ref(attn, o.q, o.scale, None)
    g, u = int8_linear_ref(_rms_norm_ref(y, norm_w, eps), gate_up.q, gate_up.scale, None).chunk(2, dim=-1)
    return y + int8_linear_ref(F.silu(g) * u, down.q, down.scale, None)


class Int8Layers:
    """The model's decode step over int8 weights on the CPU in two fused kernels a layer
    (`attn_in`, `mlp_block`): `hetero.model.FusedLayer` for `Model.use_kernels`."""

    @staticmethod
    def fits(lw) -> bool:
        lins = (lw.qkv, lw.o) + ((lw.gate_up, lw.down) if lw.router is None else ())
        return (lw.q_norm is None and lw.ffn is None and all(isinstance(w, Int8Linear) for w in lins)
                and lw.o.bias is None)

    @staticmethod
    def takes(lw, x: torch.Tensor) -> bool:
        return x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.float32

    @staticmethod
    def pre_attention(cfg, lw, x, pos, cos, sin, kv_out=None):
        return attn_in(x, pos, lw.attn_norm, cfg.rms_norm_eps, lw.qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads)

    @staticmethod
    def post_attention(cfg, lw, x, attn):
        if lw.router is not None:  # routed experts: the model's torch math over Int8Linear experts
            return None
        return mlp_block(x, attn, lw.o, lw.mlp_norm, cfg.rms_norm_eps, lw.gate_up, lw.down)
