"""The few CUDA driver calls the batch-1 split step makes per layer, through ctypes.

At batch 1 a layer is ~0.1 ms of GPU work and a CPU kernel in series, so every microsecond the
main thread spends between them is on the step's critical path. Through torch, a graph replay,
an event record or a stream wait costs that thread several microseconds of Python and C++ each
(a replay also refills the default RNG's seed tensors for graphs that never draw a random
number); the driver call underneath costs 1–2 µs. Handles are plain
integers: a graph's `raw_cuda_graph_exec()`, a stream's `cuda_stream`, an event's `cuda_event`
(see `event_handle`). Every call raises on a CUDA error.
"""
from __future__ import annotations

import ctypes
import functools

import torch


class _CopyAttributes(ctypes.Structure):
    """CUmemcpyAttributes: the sources read in stream order, no location hints (pinned host memory
    and device memory need none), no flags."""
    _fields_ = [("src_access_order", ctypes.c_int), ("src_location", ctypes.c_int * 2),
                ("dst_location", ctypes.c_int * 2), ("flags", ctypes.c_uint)]


COPY_IN_STREAM_ORDER = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
POINTER_MEMORY_TYPE, MEMORY_TYPE_HOST = 2, 1  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_MEMORYTYPE_HOST
POINTER_DEVICE_POINTER = 3  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER


class Driver:
    def __init__(self, lib: ctypes.CDLL):
        def fn(name: str, *argtypes):
            f = getattr(lib, name)
            f.argtypes, f.restype = list(argtypes), ctypes.c_int
            return f

        p, u64, size = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        self._launch = fn("cuGraphLaunch", p, p)
        self._record = fn("cuEventRecord", p, p)
        self._sync = fn("cuEventSynchronize", p)
        self._wait = fn("cuStreamWaitEvent", p, p, ctypes.c_uint)
        self._memcpy = fn("cuMemcpyHtoDAsync_v2", u64, p, size, p)
        self._host_func = fn("cuLaunchHostFunc", p, p, p)
        self._pointer_attribute = fn("cuPointerGetAttribute", p, ctypes.c_int, u64)
        # stream memory operations (the _v2 entry points: enabled on every platform since CUDA 11.7)
        self._write_value = fn("cuStreamWriteValue32_v2", p, u64, ctypes.c_uint32, ctypes.c_uint)
        self._wait_value = fn("cuStreamWaitValue32_v2", p, u64, ctypes.c_uint32, ctypes.c_uint)
        # batched copies (CUDA 12.8 on): the _v2 entry point (CUDA 13) has no failIdx argument
        self._batch, self._batch_fail = None, False
        for name, fail in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            if hasattr(lib, name):
                self._batch = fn(name, p, p, p, size, p, p, size, *((p,) if fail else ()), p)
                self._batch_fail = fail
                break
        self._attrs = _CopyAttributes(COPY_IN_STREAM_ORDER)
        self._attrs_at = ctypes.c_size_t(0)

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} failed: CUresult {err}")

    def launch(self, graph_exec: int, stream: int) -> None:
        """Queue a captured graph on stream (what CUDAGraph.replay does, less torch's RNG prologue)."""
        self._check(self._launch(graph_exec, stream), "cuGraphLaunch")

    def record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cuEventRecord")

    def synchronize(self, event: int) -> None:
        """Block the calling thread (the GIL released) until the event's work is done."""
        self._check(self._sync(event), "cuEventSynchronize")

    def wait(self, stream: int, event: int) -> None:
        """Make stream's later work wait for the event (the host does not wait)."""
        self._check(self._wait(stream, event, 0), "cuStreamWaitEvent")

    def memcpy_up(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of nbytes from pinned host memory at src to device memory at dst."""
        self._check(self._memcpy(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")

    def page_locked(self, ptr: int) -> bool:
        """Whether host memory at ptr is page-locked for the device's DMA: torch's pinned allocations
        and memory page-locked with cudaHostRegister (`offload.pinned`, which `Tensor.is_pinned`
        does not recognize)."""
        kind = ctypes.c_uint(0)
        err = self._pointer_attribute(ctypes.byref(kind), POINTER_MEMORY_TYPE, ptr)
        return err == 0 and kind.value == MEMORY_TYPE_HOST

    def device_address(self, ptr: int) -> int | None:
        """The address at which the device reaches host memory at ptr (page-locked and mapped), or None."""
        out = ctypes.c_uint64(0)
        return out.value if self._pointer_attribute(ctypes.byref(out), POINTER_DEVICE_POINTER, ptr) == 0 else None

    def memcpy_up_all(self, copies: list[tuple[int, int, int]], stream: int) -> None:
        """Queue the copies (device dst, pinned host src, bytes), in one driver call where the driver
        batches copies (their order within the batch free), else one call each."""
        if len(copies) > 1 and self._batch is not None:
            n = len(copies)
            dsts, srcs, sizes = ((ctypes.c_uint64 * n)(*(c[k] for c in copies)) for k in range(3))
            fail = (ctypes.byref(ctypes.c_size_t()),) if self._batch_fail else ()
            self._check(self._batch(dsts, srcs, sizes, n, ctypes.byref(self._attrs), ctypes.byref(self._attrs_at), 1,
                                    *fail, stream), "cuMemcpyBatchAsync")
            return
        for dst, src, nbytes in copies:
            self.memcpy_up(dst, src, nbytes, stream)

    def host_func(self, stream: int, fn: int, data: int) -> None:
        """Queue a call of the C function `void fn(void *data)` on stream: the driver's own thread
        calls it once the stream's earlier work is done, and the stream's later work waits for it.
        Captured into a CUDA graph, it is a host node. fn must not call CUDA."""
        self._check(self._host_func(stream, fn, data), "cuLaunchHostFunc")

    def write_value(self, stream: int, addr: int, value: int) -> None:
        """Queue a store of the 32-bit value at addr (pinned host memory, whose device address is its
        host address) once the stream's earlier work is done. Captured, a memory-operation node."""
        self._check(self._write_value(stream, addr, value, 0), "cuStreamWriteValue32")

    def wait_value(self, stream: int, addr: int, value: int) -> None:
        """Make the stream's later work wait until the 32-bit word at addr equals value (the GPU polls
        it; the host does not wait). Captured, a memory-operation node."""
        self._check(self._wait_value(stream, addr, value, 1), "cuStreamWaitValue32")  # CU_STREAM_WAIT_VALUE_EQ


@functools.cache
def driver() -> Driver | None:
    """The CUDA driver's calls, or None where libcuda cannot be loaded (no GPU, or an old driver)."""
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def event_handle(event: torch.cuda.Event, stream: torch.cuda.Stream) -> int:
    """The CUevent behind a torch event, created now if it is not yet (torch makes its events on
    their first record: recording it once on `stream` does, and leaves it complete once the
    stream's work so far is)."""
    if not event.cuda_event:
        event.record(stream)
    return event.cuda_event


# whether this torch hands out a captured graph's executable (`CUDAGraph.raw_cuda_graph_exec`)
RAW_GRAPHS = hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec")


def graph_handle(graph: torch.cuda.CUDAGraph) -> int:
    """A captured graph's executable (where `RAW_GRAPHS`)."""
    return int(graph.raw_cuda_graph_exec())
