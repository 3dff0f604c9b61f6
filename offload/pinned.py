"""Pinned host memory for what the GPU copies from (the host KV pool when blocks stream or swap):
`cpu_attention.host_memory`'s 2 MiB pages, page-locked with cudaHostRegister (undone when the
mapping goes), or torch's pinned allocation where that cannot be had."""
from __future__ import annotations

import mmap
import weakref

import torch

from cpu_attention import host_memory


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, pin_memory=True), in 2 MiB pages where the OS gives them."""
    t = host_memory.zeros(shape, dtype, lock=_register)
    return t if t is not None else torch.zeros(shape, dtype=dtype, pin_memory=True)


def _register(m: mmap.mmap, ptr: int, n: int) -> bool:
    """Page-lock [ptr, ptr + n) for the GPU's copies, undone when m is freed."""
    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(ptr, n, 0)) != 0:
        return False
    weakref.finalize(m, cudart.cudaHostUnregister, ptr)
    return True
