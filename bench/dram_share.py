"""How the host's DRAM serves the CPU's expert kernel and the GPU's reads of page-locked memory at
once, GB/s each:

    python3 -m bench.dram_share [--seconds 2] [--threads N]

The question behind it: at a tight GPU budget a MoE decode step is bound by the host experts'
bytes, which the CPU reads at ~70 GB/s (bench/RESULTS.md); a GPU kernel can read page-locked host
memory itself over PCIe (gpu_ops.host_read). If both together read more than the CPU alone, a
part of the host experts is better read by the GPU. Rows, each run for --seconds:

    cpu           the pooled int4 experts call (cpu_attention.experts_pool), one token and 5 experts
                  a call, cycling over 64 layers' worth (past the L3)
    gpu kernel    gpu_ops.host_read.read_pinned of 12 MB pieces of a 1 GiB page-locked buffer
    gpu copy      the same pieces as copies (the copy engine's DMA)
    cpu + gpu kernel, cpu + gpu copy: both at once (the CPU's calls from a thread of their own)

Bound: the DRAM read rate (printed first; torch's sum of 2 GiB).
"""
from __future__ import annotations

import argparse
import ctypes
import threading
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=0, help="the experts' pool (default: physical cores − 1)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.dram_share needs a CUDA device")
    from cpu_attention._numba import configure, physical_cores
    from cpu_attention.experts import Scratch, timing_layers
    from cpu_attention.experts_pool import ExpertsPool
    from bench.experts_pool import torch_sum_gbps
    from gpu_ops.host_read import read_pinned

    configure()
    print(f"DRAM read (torch.sum of 2 GiB): {torch_sum_gbps():.1f} GB/s")
    H, F, k, E, L = 2048, 768, 8, 5, 64
    threads = args.threads or max(1, physical_cores() - 1)
    sets = timing_layers(L, E, H, F, k, threads)
    x, w, out = np.ones((1, H), np.float32), np.ones((1, k), np.float32), np.empty((1, H), np.float32)
    ids = np.full((1, k), -1, np.int32)
    ids[0, :E] = range(E)
    sc = Scratch(1, k, H, F, E)
    sc.pool = ExpertsPool(threads)
    call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ExpertsPool.entry_address())
    descriptors = [he.descriptor(x, ids, w, out, sc).ctypes.data for he in sets]
    call(descriptors[0])
    piece = 12 * 2**20
    pieces = torch.empty(2**30 // piece, piece // 4, dtype=torch.float32, pin_memory=True).fill_(1.0)  # ~1 GiB
    dst = torch.empty(piece // 4, dtype=torch.float32, device="cuda")
    read_pinned(pieces[0], dst)
    torch.cuda.synchronize()

    def cpu(stop: threading.Event, done: list) -> None:
        n, t0 = 0, time.perf_counter()
        while not stop.is_set():
            call(descriptors[n % L])
            n += 1
        done.append(n * sets[0].nbytes / (time.perf_counter() - t0))

    def gpu(seconds: float, kernel: bool) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(8):
                src = pieces[n % pieces.shape[0]]
                if kernel:
                    read_pinned(src, dst)
                else:
                    dst.copy_(src, non_blocking=True)
                n += 1
            torch.cuda.synchronize()
        return n * piece / (time.perf_counter() - t0)

    for name, use_cpu, kernel in (("cpu", True, None), ("gpu kernel", False, True), ("gpu copy", False, False),
                                  ("cpu + gpu kernel", True, True), ("cpu + gpu copy", True, False)):
        stop, done = threading.Event(), []
        th = threading.Thread(target=cpu, args=(stop, done)) if use_cpu else None
        if th:
            th.start()
        if kernel is None:
            time.sleep(args.seconds)
            g = 0.0
        else:
            g = gpu(args.seconds, kernel)
        stop.set()
        if th:
            th.join()
        c = done[0] if done else 0.0
        print(f"{name:18} CPU {c / 1e9:6.1f} GB/s   GPU {g / 1e9:6.1f} GB/s   together {(c + g) / 1e9:6.1f} GB/s", flush=True)
    sc.pool.close()


if __name__ == "__main__":
    main()
