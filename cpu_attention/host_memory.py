"""Host memory for the KV pool: zeroed tensors in 2 MiB pages where the OS gives them.

Why: the decode kernels read a pool whose blocks lie scattered over gigabytes (a block table
points anywhere), and an int4 block and kv head is six short runs in six arrays (key codes
1 KiB, value codes 1 KiB, key scales and zeros 256 B each, value scales and zeros 128 B each,
`int4.py`): six 4 KiB pages for 2.75 KiB read, against bf16's two pages for 8 KiB. In 4 KiB
pages most of those are TLB misses, each a page walk. Measured on the GPU host (16 threads,
the same kernels over a pool in 2 MiB pages against torch's 4 KiB ones):
int4 1.09× at 1 × 32k, 1.13× at 16 × 4k, 1.07× in cache; int8 1.00 / 1.05 / 1.05.

How: Linux's transparent huge pages are often madvise-only (the GPU host's are), and torch's
allocator does not advise them, so the pool maps its own memory: a private anonymous mmap,
advised MADV_HUGEPAGE before anything touches it, the tensor starting at its first 2 MiB
boundary (`torch.frombuffer` keeps the mapping alive as long as the tensor). A pool the GPU
copies from has its mapping page-locked by the caller's `lock` (`offload.pinned`: this package
knows nothing of CUDA). Where any of that is missing (another OS, a tensor under 2 MiB) it is
torch.zeros as before. Like torch.zeros, it touches every page up front, so that no decode step
later pays a page fault or the kernel's compaction for a fresh 2 MiB page: one
MADV_POPULATE_WRITE (Linux 5.14+; the kernel hands the pages over zeroed, as for any anonymous
mapping), else a memset (locking does the same). The madvise is one pass where the memset was
the kernel's zeroing of each fresh page and then ours, over two threads contending for each
huge page: for `hetero chat`'s 91 MiB pool on the 2-core machine, a median of 11 ms against 17 ms
(8 fresh processes each). Either took ~0.27 s in one run of the eight, and 0.2–0.25 s inside the
chat's start-up on a busy day: the VM's host backing fresh memory, which no call here avoids.
"""
from __future__ import annotations

import math
import mmap
from typing import Callable

import torch

HUGE_PAGE = 2 << 20  # bytes
MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module does not name it


def zeros(shape: tuple[int, ...], dtype: torch.dtype,
          lock: Callable[[mmap.mmap, int, int], bool] | None = None) -> torch.Tensor | None:
    """torch.zeros(shape, dtype=dtype), in 2 MiB pages where the OS gives them (module doc).

    lock(mapping, ptr, nbytes) page-locks the memory for a device's copies and says whether it
    could; with a lock, None where the memory could not be mapped or locked (the caller then
    allocates pinned memory its own way)."""
    n = math.prod(shape) * dtype.itemsize
    if n < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype) if lock is None else None
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages
        pass
    whole = torch.frombuffer(m, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    t = whole[skip:skip + n]
    if lock is not None:
        if not lock(m, t.data_ptr(), n):
            return None
    else:
        _fault_in(m, t)
    return t.view(dtype).reshape(shape)


def _fault_in(m: mmap.mmap, t: torch.Tensor) -> None:
    """Every page of the fresh mapping m present and writable now (module doc); t: its aligned part."""
    try:
        m.madvise(MADV_POPULATE_WRITE)
        return
    except OSError:  # a kernel before 5.14
        t.zero_()
