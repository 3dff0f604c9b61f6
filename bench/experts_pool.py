"""The host experts' call through its C entry point, OpenMP's kernel against the experts' own pool
of spinning threads (cpu_attention.experts_pool), µs a call:

    python3 -m bench.experts_pool [--threads N] [--order omp,pool] [--chunks 8,32] [--dram] [--tokens N]
                                  [--shape qwen3|mixtral] [--variants "chunk=64;pages=4k"]

Four int4 experts of the Qwen3-30B-A3B shape (hidden 2048, expert FFN 768: 10.6 MB a call), one
token (--tokens N: N tokens, each routed to 8 experts of its own, as a batch's tokens mostly are),
cycling over 64 layers' worth (680 MB: past the GPU host's 300 MiB L3; 8 layers' worth stayed
in it and read ~100 GB/s), in 2 MiB pages as the engine's, 200 calls 100 µs apart from a thread of
its own, as the CUDA driver's thread makes them, after torch's parallel CPU ops on the main
thread (the engine's prefill leaves its pool there). Bound: the DRAM read rate (printed GB/s;
--dram measures it past the L3: torch's sum, and a Numba streaming sum at 1..all threads, and at
all but one with several streams a thread or software prefetch).
--variants times the pool with other compile-time settings, each in a process of its own with an
empty Numba cache: chunk (experts_pool.CHUNK, rows a claim), pages (the experts' memory in 2m or
4k pages); --chunks 8,32 is "chunk=8;chunk=32".
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="threads a call takes (default: physical cores − 1)")
    ap.add_argument("--order", default="omp,pool")
    ap.add_argument("--chunks", default="", help="comma-separated rows a claim (the pool only), a process each")
    ap.add_argument("--variants", default="", help="';'-separated settings (module doc), a process each")
    ap.add_argument("--variant", default="", help=argparse.SUPPRESS)
    ap.add_argument("--dram", action="store_true", help="first the DRAM read rate past the L3, by threads")
    ap.add_argument("--tokens", type=int, default=1, help="tokens a call, each over 8 experts of its own "
                    "(default: one token over 4 experts)")
    ap.add_argument("--shape", choices=("qwen3", "mixtral"), default="qwen3",
                    help="mixtral: one token over one expert of Mixtral-8x7B's shape (hidden 4096, FFN 14336, "
                    "99 MB), the host's share of a layer where one of its 8 experts stays on the host")
    args = ap.parse_args()
    if args.dram:
        _dram()
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    variants += [f"chunk={c}" for c in args.chunks.split(",") if c]
    if variants:
        for v in variants:
            env = dict(os.environ, NUMBA_CACHE_DIR=tempfile.mkdtemp())
            subprocess.run([sys.executable, "-m", "bench.experts_pool", "--order", "pool", "--variant", v,
                            "--threads", str(args.threads), "--tokens", str(args.tokens), "--shape", args.shape],
                           env=env, check=True)
        return
    settings = dict(kv.split("=") for kv in args.variant.split())
    _configure(settings)
    import torch

    from cpu_attention import experts_kernels as kn
    from cpu_attention._numba import configure, physical_cores
    from cpu_attention.experts import Scratch, timing_layers
    from cpu_attention.experts_pool import ExpertsPool

    configure()
    H, F, k, N = (4096, 14336, 2, 1) if args.shape == "mixtral" else (2048, 768, 8, args.tokens)
    E = 1 if args.shape == "mixtral" else 4 if N == 1 else k * N
    L = 8 if args.shape == "mixtral" else max(4, 256 // E)  # past the L3: 64 layers' worth of 4 experts, 680 MB
    threads = args.threads or max(1, physical_cores() - 1)
    sets = timing_layers(L, E, H, F, k, threads, huge_pages=settings.get("pages", "2m") != "4k")
    x, w, out = np.ones((N, H), np.float32), np.ones((N, k), np.float32), np.empty((N, H), np.float32)
    ids = np.full((N, k), -1, np.int32)
    if N == 1:
        ids[0, :E] = np.arange(E)
    else:
        ids[:] = np.arange(E, dtype=np.int32).reshape(N, k)
    t = torch.randn(4_000_000)
    for _ in range(3):
        t.exp().sum()
    nbytes = sets[0].nbytes
    for mode in args.order.split(","):
        sc = Scratch(N, k, H, F, E)
        if mode == "pool":
            sc.pool = ExpertsPool(threads)
        entry = ExpertsPool.entry_address() if mode == "pool" else kn.entry_address()
        call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(entry)
        ds = [he.descriptor(x, ids, w, out, sc).ctypes.data for he in sets]
        times: list[float] = []

        def calls() -> None:
            call(ds[0])
            for r in range(200):
                end = time.perf_counter() + 100e-6
                while time.perf_counter() < end:
                    pass
                t0 = time.perf_counter()
                call(ds[r % len(ds)])
                times.append(time.perf_counter() - t0)

        th = threading.Thread(target=calls)
        th.start()
        th.join()
        if sc.pool is not None:
            sc.pool.close()
        us = statistics.median(times) * 1e6
        tag = f"{mode} ({args.variant})" if args.variant else mode
        print(f"{tag:5} {threads} threads: {us:7.1f} µs a call, {nbytes / us / 1e3:6.1f} GB/s ({nbytes / 1e6:.1f} MB)")


def _configure(settings: dict[str, str]) -> None:
    """The compile-time settings of a --variants entry, set before the pool's kernels compile."""
    import cpu_attention.experts_pool as ep

    for key, value in settings.items():
        if key == "chunk":
            ep.CHUNK = int(value)
        elif key != "pages":
            raise SystemExit(f"unknown setting {key!r} (chunk, pages)")


def torch_sum_gbps() -> float:
    """GB/s of torch's sum of 2 GiB over all its threads: the DRAM read rate past the last-level cache."""
    import torch

    a = torch.ones(2**29)
    return a.numel() * 4 / min(_seconds(lambda: a.sum()) for _ in range(5)) / 1e9


def _dram() -> None:
    """GB/s of reading 2 GiB: torch's sum (all threads), and a Numba loop at 1..all physical cores."""
    import torch
    from numba import njit, prange, set_num_threads

    from cpu_attention._numba import physical_cores

    print(f"DRAM read, torch.sum of 2 GiB, {torch.get_num_threads()} threads: {torch_sum_gbps():.1f} GB/s")
    b = np.ones(2**28, np.int64)

    @njit(parallel=True)
    def total(b, T):
        n = b.shape[0] // T
        acc = np.zeros(T, np.int64)
        for t in prange(T):
            x = 0
            for i in range(t * n, t * n + n):
                x += b[i]
            acc[t] = x
        return acc.sum()

    import numba

    cores = min(physical_cores(), numba.config.NUMBA_NUM_THREADS)
    for T in sorted(t for t in {1, 2, 4, 8, cores - 1, cores} if 1 <= t <= cores):
        set_num_threads(T)
        total(b, T)
        best = min(_seconds(lambda: total(b, T)) for _ in range(3))
        print(f"DRAM read, a Numba sum of 2 GiB, {T:2d} threads: {b.nbytes / best / 1e9:.1f} GB/s")
    T = max(1, cores - 1)
    set_num_threads(T)
    for S, P in ((1, 0), (2, 0), (4, 0), (8, 0), (1, 16), (1, 32), (2, 16), (4, 16)):
        _streams(b, T, S, P)
        best = min(_seconds(lambda: _streams(b, T, S, P)) for _ in range(3))
        print(f"DRAM read, a Numba sum of 2 GiB, {T:2d} threads, {S} streams a thread, prefetch {P:2d} lines ahead: "
              f"{b.nbytes / best / 1e9:.1f} GB/s")


def _streams(b, T, S, P):
    """Σ b over T threads, each walking S runs of its share side by side, a line of each in turn,
    prefetching P lines ahead of each into L2 (0: none)."""
    return _streams_kernel()(b, T, S, P)


@functools.cache
def _streams_kernel():
    from numba import njit, prange

    from cpu_attention._numba import prefetch_l2

    @njit(parallel=True)
    def total(b, T, S, P):
        n = b.shape[0] // (T * S) // 8 * 8
        acc = np.zeros(T, np.int64)
        for t in prange(T):
            x = 0
            base = t * n * S
            for i in range(0, n, 8):
                for s in range(S):
                    o = base + s * n + i
                    if P > 0:
                        prefetch_l2(b, min(o + 8 * P, b.shape[0] - 1))
                    for j in range(8):
                        x += b[o + j]
            acc[t] = x
        return acc.sum()

    return total


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
