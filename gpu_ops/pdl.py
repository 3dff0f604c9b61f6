"""Programmatic dependent launch (Hopper): let a decode kernel start while the one before ends.

At batch 1 the fused decode step is ~280 kernels in a CUDA graph and ~1 µs passed between the
end of one and the start of the next (bench/gpu_decode.py's kernel table: busy 3124 µs of a
3405 µs step). With PDL a kernel is launched early; it reads only what no earlier kernel writes
(weights, code book, norm weights) before `gdc_wait`, the point where the previous kernel's
writes become visible, and lets its own successor launch (`gdc_launch_dependents`) once its
main work is issued. Every kernel launched this way must call `gdc_wait` before touching
activations; kernels not launched this way are ordered as usual.

`use(False)` turns it off before the first launch (A/B, or a driver that rejects the launch
attribute).
"""
from __future__ import annotations

import functools
import os

import torch


_wanted = True


def use(on: bool) -> None:
    """Launch with PDL where the GPU has it (the default), or never."""
    global _wanted
    _wanted = on
    _capable.cache_clear()


def enabled(device: torch.device) -> bool:
    return _wanted and _capable(device)


@functools.cache
def _capable(device: torch.device) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's CPU interpreter has no launch attributes
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch(device: torch.device) -> dict:
    """Extra launch arguments for a Triton kernel whose PDL constexpr is `enabled(device)`."""
    return {"launch_pdl": True} if enabled(device) else {}
