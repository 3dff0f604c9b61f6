"""What a second OpenMP pool costs the host kernels: three small Numba parallel regions, run back to
back from a worker thread 300 µs after the last (as the CPU experts' three passes a layer ran
from the CUDA driver's thread under OpenMP), µs a layer, in fresh processes:

    python3 -m bench.omp_pools [--reps 300]

- alone: the worker thread's pool is the process's only one (the bound);
- beside a Numba pool: the main thread ran a Numba parallel region first;
- beside torch: the main thread ran torch's parallel CPU ops first (where torch links the same
  libgomp as Numba, their pools count together; the libgomps each process maps are printed);
- beside torch, pool freed: the same, then the main thread freed its pool
  (cpu_attention._numba.release_pool, as the engine does where its kernels move to another thread).

libgomp keeps a pool of threads for each thread that has run a parallel region; where a process
holds more pool threads than CPUs it lets waiting workers sleep almost at once, and each region
then pays their wake-up. Imports numpy, numba and torch (and cpu_attention._numba for the last case).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

CASES = ("alone", "beside a Numba pool", "beside torch", "beside torch, pool freed")


def measure(case: str, reps: int) -> dict:
    """In this process: the main thread's share of the case, then the worker thread's timings."""
    import numpy as np
    from numba import njit, prange

    @njit(parallel=True)
    def touch(a):
        for i in prange(a.shape[0]):
            a[i] += 1.0

    a = np.zeros(64)
    if case == "beside a Numba pool":
        touch(a)
    elif case.startswith("beside torch"):
        import torch

        x = torch.randn(4_000_000)
        for _ in range(5):
            x.exp().sum()
        if case.endswith("freed"):
            from cpu_attention._numba import release_pool

            release_pool()
    times: list[float] = []

    def worker() -> None:
        touch(a)
        for _ in range(reps):
            t = time.perf_counter() + 300e-6
            while time.perf_counter() < t:
                pass
            t = time.perf_counter()
            for _ in range(3):
                touch(a)
            times.append(time.perf_counter() - t)

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    libgomp = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "libgomp" in ln})
    return dict(case=case, us=statistics.median(times) * 1e6, libgomp=libgomp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # child: run this case, print it
    args = ap.parse_args()
    if args.one:
        print("ROW " + json.dumps(measure(args.one, args.reps)), flush=True)
        return
    rows = []
    for case in CASES:
        r = subprocess.run([sys.executable, "-m", "bench.omp_pools", "--one", case, "--reps", str(args.reps)],
                           capture_output=True, text=True)
        found = [ln[4:] for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
        rows.append(json.loads(found[0]) if found else dict(case=case, error=(r.stderr or r.stdout)[-500:]))
    bound = rows[0].get("us")
    print(f"{'case':22} {'µs / 3 regions':>14} {'× alone':>8}  libgomp mapped")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:22} ERROR {r['error']}")
            continue
        print(f"{r['case']:22} {r['us']:14.1f} {r['us'] / bound:8.1f}  {', '.join(r['libgomp'])}")


if __name__ == "__main__":
    main()
