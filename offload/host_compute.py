"""Weight groups the plan computes on the CPU: the activations go down, the CPU multiplies, the
result comes up.

A matrix of such a group is stored on the host in the CPU's format (int8 with a scale a row,
`cpu_attention.linear`'s Numba GEMV, when the GPU format is 4-bit; else bf16 or f32, torch). Per call:

    compute stream:  x → pinned `down` buffer (async copy), event
    host:            wait for the event → y = W·x on the CPU → y into the pinned `up` buffer
    compute stream:  `up` → device (async copy); later device work reads it in stream order

The main thread waits for the device's work up to x, and the device has nothing queued past
the copy up while the CPU multiplies: a CPU-computed group stalls the GPU (the planner's cost
model counts it so). That synchronisation is why a step with such groups runs eagerly, without
CUDA graphs. The two pinned buffers are reused: each call's wait for its own copy down also
waits for the previous call's copy up (same stream, in order), so `up` is never overwritten
while a copy still reads it.

`HostLinear` wraps one matrix (the attention projections: qkv before attention, o after it);
`HostFFN` the whole MLP or expert block of a layer, so h goes down once and its output comes up
once (MoE routing runs on the host too). On a CPU stand-in device there is nothing to move: the
call is the host computation itself.
"""
from __future__ import annotations

from typing import Callable

import torch

from hetero.config import ModelConfig
from hetero.model import LayerWeights, Linear, feed_forward


class HostCompute:
    """The pinned staging all host-computed groups share (they run one at a time, on the main thread)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._down = self._up = torch.empty(0)
        self._ready = torch.cuda.Event() if self.cuda else None
        self.calls = 0
        self.bytes_down = self.bytes_up = 0

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """fn over x [N, I] (on the device) computed by the CPU in float32 → its result on the device."""
        self.calls += 1
        if not self.cuda:
            return fn(x)
        x = x.float()
        down = self._buffer("_down", x.numel()).view(x.shape)
        down.copy_(x, non_blocking=True)
        self._ready.record(torch.cuda.current_stream(self.device))
        self._ready.synchronize()
        y = fn(down)
        up = self._buffer("_up", y.numel()).view(y.shape)
        up.copy_(y)
        self.bytes_down += x.numel() * 4
        self.bytes_up += y.numel() * 4
        return up.to(self.device, non_blocking=True)

    def _buffer(self, name: str, n: int) -> torch.Tensor:
        """A pinned float32 buffer of at least n values (grown by doubling: pinning is slow).

        A buffer given up while a copy still reads it stays valid: torch's pinned allocator keeps a
        block until the copies recorded on it are done."""
        buf = getattr(self, name)
        if buf.numel() < n:
            buf = torch.empty(max(n, 2 * buf.numel()), dtype=torch.float32, pin_memory=True)
            setattr(self, name, buf)
        return buf[:n]


class HostLinear:
    """y = x @ W.T (+ b) with W on the host, computed by the CPU; x and y on the model's device."""

    def __init__(self, inner: Linear, compute: HostCompute):
        self.inner, self.compute = inner, compute
        self.out_features = inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.compute.run(self.inner, x)


class HostFFN:
    """A layer's whole MLP (or router and experts) computed by the CPU: h [N, H] → [N, H]."""

    graph_rows = 0  # it waits for the device's work mid-step: no CUDA graph holds it

    def __init__(self, cfg: ModelConfig, host: LayerWeights, compute: HostCompute):
        self.cfg, self.host, self.compute = cfg, host, compute  # host: the layer's host-side weights
        self.out_features = cfg.hidden_size

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """h [N, H] → ffn(h) [N, H] float32, or residual + ffn(h) in h's dtype."""
        out = self.compute.run(self._ffn, h)
        return out if residual is None else residual + out.to(h.dtype)

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        return feed_forward(self.cfg, self.host, h).float()
