"""What the main thread pays per call for the primitives of a split decode layer, on this host.

    python3 bench/host_overhead.py

At batch 1 a layer is GPU work of ~0.1 ms and a CPU kernel of ~0.1–0.4 ms in series, so every
host-side microsecond between them is on the step's critical path. This times, with the GPU
otherwise idle: CUDA event creation and record, an event wait, a small graph's replay through
torch and through the driver (ctypes, and from a nogil Numba function), a pinned 10 MB copy up
queued on a side stream through torch and through the driver, and the launch of an empty
Numba parallel loop on 16 and 15 threads. Reports medians; asserts nothing.
"""
from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import cpu_attention  # noqa: E402,F401  (sets the threading layer)

REPS = 2000


def timed(fn, reps: int = REPS) -> float:
    """Median µs of fn() over reps calls (after 50 warm-up calls)."""
    for _ in range(50):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


@numba.njit(parallel=True, nogil=True)
def _empty_parallel(x):
    for i in numba.prange(x.shape[0]):
        x[i] += 1.0


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    s = torch.cuda.current_stream()
    rows.append(("torch.cuda.Event(enable_timing=True)", timed(lambda: torch.cuda.Event(enable_timing=True))))
    ev = torch.cuda.Event()
    rows.append(("Event.record", timed(lambda: ev.record(s))))
    rows.append(("Event.record + synchronize (idle GPU)", timed(lambda: (ev.record(s), ev.synchronize()))))

    x = torch.zeros(4096, device=dev, dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(s)
    with torch.cuda.stream(side):
        for _ in range(3):
            x.add_(1)
    s.wait_stream(side)
    with torch.cuda.graph(g):
        for _ in range(12):  # about a layer segment's kernel count
            x.mul_(1.0)
    torch.cuda.synchronize()
    rows.append(("CUDAGraph.replay (12 kernels)", timed(g.replay)))
    torch.cuda.synchronize()

    cuda = ctypes.CDLL("libcuda.so.1")
    launch = cuda.cuGraphLaunch
    launch.argtypes, launch.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    gexec = g.raw_cuda_graph_exec() if hasattr(g, "raw_cuda_graph_exec") else None
    if gexec is not None:
        h = ctypes.c_void_p(int(gexec))
        st = ctypes.c_void_p(s.cuda_stream)
        rows.append(("cuGraphLaunch via ctypes", timed(lambda: launch(h, st))))
        torch.cuda.synchronize()
        fn_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64)  # handles as integers for Numba
        addr = ctypes.cast(launch, ctypes.c_void_p).value
        native_launch = fn_t(addr)

        @numba.njit(nogil=True)
        def launch_n(hh, ss, n):
            r = 0
            for _ in range(n):
                r |= native_launch(hh, ss)
            return r

        hv, sv = int(gexec), int(s.cuda_stream)
        launch_n(hv, sv, 1)
        torch.cuda.synchronize()
        rows.append(("cuGraphLaunch from Numba (per call, 100 a call)", timed(lambda: launch_n(hv, sv, 100), 200) / 100))
        torch.cuda.synchronize()
    else:
        rows.append(("raw_cuda_graph_exec", float("nan")))

    host = torch.empty(10 * 2**20 // 2, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty_like(host, device=dev)
    cs = torch.cuda.Stream()

    def torch_copy():
        with torch.cuda.stream(cs):
            dst.copy_(host, non_blocking=True)

    rows.append(("10 MB pinned copy up, torch, side stream", timed(torch_copy, 300)))
    torch.cuda.synchronize()
    memcpy = cuda.cuMemcpyHtoDAsync_v2
    memcpy.argtypes, memcpy.restype = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int
    d_ptr, h_ptr, nb, cs_h = dst.data_ptr(), ctypes.c_void_p(host.data_ptr()), host.numel() * 2, ctypes.c_void_p(cs.cuda_stream)
    rows.append(("10 MB pinned copy up, cuMemcpyHtoDAsync", timed(lambda: memcpy(d_ptr, h_ptr, nb, cs_h), 300)))
    torch.cuda.synchronize()

    a = np.zeros(16 * 64, dtype=np.float32)
    for t in (16, 15):
        numba.set_num_threads(t)
        rows.append((f"empty Numba prange, {t} threads", timed(lambda: _empty_parallel(a))))

    print(f"torch {torch.__version__}, numba {numba.__version__} ({numba.threading_layer()})")
    for name, us in rows:
        print(f"{name:52} {us:8.1f} µs")


if __name__ == "__main__":
    main()
