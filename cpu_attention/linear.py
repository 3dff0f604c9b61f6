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

The Numba kernels are in `linear_kernels.py`, imported on the first call (`_kernels`), so
loading int8 weights needs no Numba; every kernel has its torch twin here (`*_ref`), composed of
the same float operations.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F


# Rows of x up to which the GEMV kernels beat dequantize + GEMM (2 cores, SmolLM2's matrices: at
# 32 rows 1.2–1.3× faster, even at 48–64, half the speed at 512).
GEMV_MAX_ROWS = 32
# Rows up to which the GEMV kernels compute each row by the same loop (more: four rows a weight
# conversion), so that a row's output is the same bits whatever rows share the call.
ROW_BY_ROW = 8
# Weight rows dequantized at a time on the GEMM path: a buffer that stays in the caches (the
# whole matrix in float32 at once cost ~2.5 ns a weight on 2 cores, its fresh pages faulted in).
DEQUANT_ROWS = 512
_NO_BIAS = np.zeros(0, np.float32)


def _tiles(n: int) -> int:
    """Groups of four rows the GEMV kernels take a weight conversion for: none up to ROW_BY_ROW."""
    return n // 4 if n > ROW_BY_ROW else 0


@functools.cache
def _kernels():
    """`linear_kernels`, Numba's settings made first (`configure`: before any kernel compiles,
    whichever thread gets here first)."""
    from cpu_attention import _numba, linear_kernels

    _numba.configure()
    return linear_kernels


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] → (int8 [O, I], scale [O]) with scale = max|row| / 127."""
    w = w.float().contiguous()
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0])
    _kernels().quantize_rows(w.numpy(), q.numpy(), scale.numpy())
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
            return self._gemm(x)
        out = torch.empty(x.shape[0], self.out_features)
        _kernels().gemv_int8(self._qn, self._sn, x.numpy(), out.numpy(), _tiles(x.shape[0]))
        return out if self.bias is None else out + self.bias

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, I] float32 → [N, O]: DEQUANT_ROWS weight rows at a time dequantized into one
        buffer, each times x by torch's GEMM (`int8_linear_ref`'s float ops, in pieces)."""
        out = torch.empty(x.shape[0], self.out_features)
        buf = torch.empty(min(DEQUANT_ROWS, self.out_features), self.in_features)
        for o0 in range(0, self.out_features, DEQUANT_ROWS):
            o1 = min(o0 + DEQUANT_ROWS, self.out_features)
            w = buf[: o1 - o0]
            torch.mul(self.q[o0:o1], self.scale[o0:o1, None], out=w)
            out[:, o0:o1] = x @ w.T
        return out if self.bias is None else out.add_(self.bias)


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
    _kernels().attn_in(x.numpy(), pos.numpy(), norm_w.numpy(), np.float32(eps), qkv._qn, qkv._sn, qkv._bn,
                       cos.numpy(), sin.numpy(), np.empty((N, H), np.float32),
                       np.empty((N, qkv.out_features), np.float32), q, k, v, _tiles(N))
    return torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)


def mlp_block(x: torch.Tensor, attn: torch.Tensor, o: Int8Linear, norm_w: torch.Tensor, eps: float,
              gate_up: Int8Linear, down: Int8Linear) -> torch.Tensor:
    """x [N, H] f32, attn [N, Hq, D] or [N, Hq·D] → the layer's output [N, H] (no biases); N ≤ GEMV_MAX_ROWS."""
    N, H = x.shape
    out = np.empty((N, H), np.float32)
    _kernels().mlp_block(x.numpy(), attn.float().numpy().reshape(N, -1), o._qn, o._sn, norm_w.numpy(),
                         np.float32(eps), gate_up._qn, gate_up._sn, down._qn, down._sn, np.empty((N, H), np.float32),
                         np.empty((N, down.in_features), np.float32), out, _tiles(N))
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
