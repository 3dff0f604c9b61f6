"""Small reads of pinned host memory by a kernel (zero-copy), not by a copy engine.

A split decode step's post segment starts by bringing the CPU's (o, lse), ~16 KB, up from pinned
staging. As a copy (`Tensor.copy_`, a DMA on the copy engine) it queues behind whatever that
engine is moving host→device already: at batch 1 with streamed KV that is a layer's blocks,
~20 MB, and the post segment took 270–290 µs instead of 110 (measured on the GPU host). A
kernel reading the same bytes over PCIe itself goes around that queue: pinned memory is mapped
into the device's address space (unified addressing), so its host pointer is a device pointer
too. The loads are `.cv` (fetch again, never a cached line): the host
rewrites these buffers between replays of the same graph.
"""
from __future__ import annotations

import torch

BLOCK = 1024


def read_pinned(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (CUDA) ← src (pinned host, same numel and dtype), by a kernel; capturable in a graph.
    Elsewhere (a CPU stand-in device, unpinned src) a plain copy."""
    if dst.device.type != "cuda" or not src.is_pinned():
        dst.copy_(src)
        return
    if src.dtype != dst.dtype or src.numel() != dst.numel() or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"read_pinned: {src.dtype}{tuple(src.shape)} into {dst.dtype}{tuple(dst.shape)}")
    n = src.numel()
    _kernel()[(-(-n // BLOCK),)](HostPointer(src), dst, n, BLOCK=BLOCK, num_warps=4)


WORD = 4  # bytes: `gather_pinned` moves 32-bit words
CHUNK = 4096  # words a program of `gather_pinned` moves at a time: 16 KiB in flight
PROGRAMS = 16  # `gather_pinned`'s programs at most (`_programs`)


def gather_pinned(src: HostPointer, dst: HostPointer, table: torch.Tensor, a: int, b: int, pieces: int,
                  longest: int) -> None:
    """Pieces of pinned host memory up into device memory by one kernel on the current stream (a
    copy engine's work, for a main thread that would otherwise issue a copy a piece): for p <
    pieces, the words [table[0, p] + a · table[1, p], + table[4, p]) from src to [table[2, p] +
    b · table[3, p], + table[4, p]) of dst. table: int64 [5, ≥ pieces] on the device, in 32-bit
    words from src's and dst's addresses (`HostPointer.words`); longest: the most words of a piece.

    A few programs, each looping over the CHUNKs, on a few SMs; the compute stream's kernels have
    the others. Measured on the GPU host, in a 16 × 8k step (33 MB a layer):
    - a program a chunk (thousands a layer) queued at the block scheduler ahead of the compute
      stream's kernels: the post segment's read of the CPU's (o, lse) took 80–110 µs, not ~3;
    - a program an SM, 4 KiB chunks: in the step's trace the post segment's first linear started
      ~590 µs late, as the gather ended (a kernel's loads on an SM wait behind the gather's PCIe
      reads there), so a layer's copy and its compute ran in series: 1055 µs a layer, 37.7 ms a step;
    - 16 programs, 16 KiB chunks: 256 KiB in flight, more than PCIe's bandwidth-latency product
      (~55 GB/s × ~2 µs), the same GB/s alone (41 against 43 on that machine), and the step 27.9
      ms; a layer's o, gate_up and down linears queued beside the gather end 309–355 µs after it
      starts, against 290 with no copy (`bench.stream_copies`)."""
    chunks = -(-longest // CHUNK)
    _gather()[(_programs(),)](src, dst, table, table.stride(0), a, b, chunks, pieces * chunks, CHUNK=CHUNK,
                              num_warps=4)


def _programs() -> int:
    """`gather_pinned`'s programs: PROGRAMS, or an eighth of a smaller device's SMs."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return max(1, min(PROGRAMS, sms // 8))


class HostPointer:
    """Only what Triton's launcher reads of a pointer argument: a dtype and a `data_ptr()`, not a
    CPU tensor's device. The launcher asks the driver for the address's device pointer (for
    pinned memory, the same address) and refuses one the device cannot reach."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self._ptr = t.dtype, t.data_ptr()

    @classmethod
    def words(cls, address: int) -> HostPointer:
        """A pointer to 32-bit words at address (host or device memory), for `gather_pinned`."""
        p = cls.__new__(cls)
        p.dtype, p._ptr = torch.int32, address
        return p

    def data_ptr(self) -> int:
        return self._ptr


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_from_host(src, dst, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m, cache_modifier=".cv"), mask=m)

        _KERNEL = copy_from_host
    return _KERNEL


_GATHER = None


def _gather():
    global _GATHER
    if _GATHER is None:
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=["a", "b", "chunks", "total"])  # one compile for every layer and slot
        def gather_from_host(src, dst, table, stride, a, b, chunks, total, CHUNK: tl.constexpr):
            for i in range(tl.program_id(0), total, tl.num_programs(0)):  # chunk c of piece p, piece-major
                p = i // chunks
                c = i - p * chunks
                n = tl.load(table + 4 * stride + p)
                if c * CHUNK < n:
                    offs = c * CHUNK + tl.arange(0, CHUNK)
                    m = offs < n
                    s = tl.load(table + p) + a * tl.load(table + stride + p)
                    d = tl.load(table + 2 * stride + p) + b * tl.load(table + 3 * stride + p)
                    tl.store(dst + d + offs, tl.load(src + s + offs, mask=m, cache_modifier=".cv"), mask=m)

        _GATHER = gather_from_host
    return _GATHER
