"""Int8 weights for the CPU path: per-output-row scale, a Numba matrix-vector kernel.

Decode on the CPU is bound by the bytes of weight read per token; int8 reads a quarter of
float32 and keeps the error far below the 4-bit source formats the demo model ships in.
Matrix-vector products (a few rows of x) run in the Numba kernel; larger x (prefill)
dequantizes the weight and uses torch's GEMM, which is compute-bound there anyway.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

# Rows of x up to which the GEMV kernel beats dequantize + GEMM (measured on 2 cores).
GEMV_MAX_ROWS = 8


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _gemv_int8(w, scale, x, out):  # w [O, I] int8, scale [O] f32, x [N, I] f32, out [N, O] f32
    O, I = w.shape
    N = x.shape[0]
    for o in prange(O):
        for n in range(N):
            acc = np.float32(0.0)
            for i in range(I):
                acc += np.float32(w[o, i]) * x[n, i]
            out[n, o] = acc * scale[o]


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


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch twin: dequantize, then an ordinary linear."""
    return torch.nn.functional.linear(x.float(), q.float() * scale[:, None], bias)


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.q, self.scale = quantize_rows(weight)
        self.bias = None if bias is None else bias.float()
        self.out_features = weight.shape[0]
        self._qn, self._sn = self.q.numpy(), self.scale.numpy()

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        if x.shape[0] > GEMV_MAX_ROWS:
            return int8_linear_ref(x, self.q, self.scale, self.bias)
        out = torch.empty(x.shape[0], self.out_features)
        _gemv_int8(self._qn, self._sn, x.numpy(), out.numpy())
        return out if self.bias is None else out + self.bias
