"""Where one decode attention call's fixed cost goes, at a thread count (the engine pays it 32 times a step).

    python3 bench/call_overhead.py [--threads 16] [--reps 3000]

For each KV dtype, one sequence of 16 tokens a kv head (Llama-3-8B's layer shape), median µs of
the whole `DecodeWork.run` and of its kernel called alone with its arguments made before (the
kernels scale and rotate q, merge and rotate the output back themselves); and, for scale, an empty
Numba parallel region over `threads` iterations (a fork and join of the thread pool) and an empty
njit call taking 11 arrays. Reports; asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="numba-cache-")

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from cpu_attention import HostKVPool, KVDtype, rotation  # noqa: E402
from cpu_attention import decode_int8 as m8  # noqa: E402
from cpu_attention._numba import resolve_threads  # noqa: E402
from cpu_attention.decode import DecodeWork  # noqa: E402
from cpu_attention.decode_bf16 import decode_float  # noqa: E402
from cpu_attention.decode_int4 import decode_int4  # noqa: E402
from cpu_attention.decode_tiles import rest_heads  # noqa: E402

sys.path.append(str(ROOT / "bench"))
from kv_pools import fill  # noqa: E402


@numba.njit(parallel=True, nogil=True, cache=True)
def _fork_join(n, x):
    for i in numba.prange(n):
        x[i * 16] += 1.0


@numba.njit(nogil=True, cache=True)
def _no_op(a, b, c, d, e, f, g, h, i, j, k):
    return a.shape[0] + k.shape[0]


def median_us(fn, reps: int) -> float:
    for _ in range(50):
        fn()
    ts = np.empty(reps)
    for r in range(reps):
        t0 = time.perf_counter()
        fn()
        ts[r] = time.perf_counter() - t0
    return float(np.median(ts)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=16, help="tokens a kv head")
    ap.add_argument("--run-only", action="store_true",
                    help="only DecodeWork.run (for trees whose kernels take other arguments)")
    args = ap.parse_args()
    T = resolve_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    x = np.zeros(16 * T)
    rows = [("empty parallel region (fork + join)", median_us(lambda: _fork_join(T, x), args.reps))]
    arrs = [np.zeros(4) for _ in range(11)]
    rows.append(("empty njit call, 11 arrays", median_us(lambda: _no_op(*arrs), args.reps)))
    for dt in (KVDtype.BF16, KVDtype.INT8, KVDtype.INT4):
        n = args.tokens
        nb = -(-n // 16)
        pool = HostKVPool(1, nb, 8, 16, 128, dt)
        fill(pool, gen)
        w = DecodeWork(pool, torch.arange(nb).int()[None], torch.tensor([n]), T)
        q = torch.randn(1, 32, 128, generator=gen).numpy()
        on, ln, sc = np.empty_like(q), np.empty((1, 32), np.float32), np.empty_like(q)
        rows.append((f"{dt.value}: DecodeWork.run, {w.items.shape[0]} items",
                     median_us(lambda: w.run(pool, 0, q, 0.088, on, ln, sc), args.reps)))
        if args.run_only:
            continue
        a, sc, rot = pool.arrays, np.float32(0.088), rotation.numba_args(128)
        if dt is KVDtype.INT8:
            kernel, kargs = m8.decode_int8, (a["k"][0], a["v"][0], a["k_scale"][0], a["v_scale"][0], q, sc, *rot, w.bt,
                                             w.items, w.order, w.pair_start, on, ln, m8.INT8_TILE, m8.PREFETCH_BLOCKS,
                                             rest_heads(4), T)
        elif dt is KVDtype.BF16:
            kernel, kargs = decode_float, (a["k"][0], a["v"][0], q, sc, w.bt, w.items, w.order, w.pair_start, on, ln,
                                           rest_heads(4), T)
        else:
            t = pool.tails.arrays
            kernel, kargs = decode_int4, (a["k"][0], a["v"][0], a["k_scale"][0], a["k_zero"][0], a["v_scale"][0],
                                          a["v_zero"][0], t["k"], t["v"], t["slot"][0], q, sc, *rot, w.bt, w.items,
                                          w.order, w.pair_start, on, ln, rest_heads(4), T)
        rows.append((f"{dt.value}:   the kernel alone (its args made before)",
                     median_us(lambda: kernel(*kargs), args.reps)))
    width = max(len(r[0]) for r in rows)
    print(f"call_overhead: {T} threads, numba {numba.__version__} ({numba.threading_layer()}), "
          f"{args.tokens} tokens a kv head")
    for name, us in rows:
        print(f"{name:<{width}}  {us:7.1f} us")


if __name__ == "__main__":
    main()
