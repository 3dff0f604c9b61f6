"""A/B of decode-kernel versions in one process: rounds alternate between them within seconds.

    python3 bench/ab_inproc.py TREE[@THREADS] [TREE ...] [--dtype int4] [--threads 16] [--rounds 10] [--reps 10]

Each TREE is a folder holding a version's cpu_attention/ and bench/ (e.g. `git archive main
cpu_attention bench | tar -x -C _ab/main`); @THREADS runs it at that thread count instead.
The versions are imported one after the other, each as `cpu_attention` from its own folder, and
dropped from sys.modules before the next: the module objects live on in its cases
(`bench/cpu_scaling.py`'s: the rate from DRAM at 1 × 32k and 16 × 4k, and one sequence of 8192
tokens in cache), which are built, filled and compiled while it is loaded (anything a version
imports only when called, e.g. the pool writer, runs then). Then every round times each
version's cases one after the other, with the DRAM read measured in the same round. The
device-tool machines drift by 10–40% within minutes (neighbours, clocks), which separate
processes minutes apart mistake for a kernel's speed; here each round's versions see the same
machine state, and the per-round ratio to the first version is the figure to read. Prints per
version the median over rounds of its rate and share of DRAM, and the median ratio.
Reports; asserts nothing.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

if "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="numba-cache-")

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

OWN = ("cpu_attention", "cpu_scaling", "kv_pools")


def _forget() -> None:
    """Drop the loaded version's modules from sys.modules (the objects live on in its cases)."""
    for name in list(sys.modules):
        if name.split(".")[0] in OWN:
            del sys.modules[name]


def load(tree: Path, dtype: str, threads: int, shapes, gen):
    """tree's cases {label: Case} and its DRAM read function, built and compiled while it is loaded."""
    _forget()
    paths = [str(tree), str(tree / "bench")]
    sys.path[:0] = paths
    try:
        cs = importlib.import_module("cpu_scaling")
        from cpu_attention import KVDtype
        from kv_pools import copies_past_l3

        dt = KVDtype(dtype)
        numba.set_num_threads(threads)
        cases = {f"{B}x{n}": cs.Case(dt, B, n, copies_past_l3(dt, cs.HKV, cs.BS, cs.D, B * n), threads, gen)
                 for B, n in shapes}
        cases["cache 8192"] = cs.Case(dt, 1, 8192, 1, threads, gen)
        for c in cases.values():
            c.times(2)  # compile, touch
        dram = importlib.import_module("cpu_attention._numba").dram_read_gbps
        dram(2**20)  # compiled (or loaded from Numba's cache, which imports by module name) while loaded
        print(f"{tree.name}: {importlib.import_module('cpu_attention').__file__}", flush=True)
    finally:
        del sys.path[:len(paths)]
        _forget()
    return cases, dram


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", help="TREE or TREE@THREADS")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=10, help="calls a case a round (median taken)")
    ap.add_argument("--shapes", default="1x32768,16x4096")
    args = ap.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s]
    gen = torch.Generator().manual_seed(0)
    versions = {}  # name: (tree, threads)
    for spec in args.trees:
        tree, _, thr = spec.partition("@")
        versions[Path(tree).name + (f"@{thr}" if thr else "")] = (Path(tree), int(thr or args.threads))
    names = list(versions)
    t0 = time.perf_counter()
    loaded = {n: load(tree, args.dtype, thr, shapes, gen) for n, (tree, thr) in versions.items()}
    print(f"ab_inproc: {args.dtype}, {args.threads} threads, {len(names)} versions built in "
          f"{time.perf_counter() - t0:.0f} s; {args.rounds} rounds of {args.reps} calls a case", flush=True)
    dram_read = loaded[names[0]][1]
    labels = list(loaded[names[0]][0])
    share = {(n, k): [] for n in names for k in labels}  # rate / the round's DRAM read
    rate = {(n, k): [] for n in names for k in labels}
    for r in range(args.rounds):
        numba.set_num_threads(args.threads)
        dram = dram_read(2**30)
        for n in (names if r % 2 == 0 else names[::-1]):  # alternate the order too
            numba.set_num_threads(versions[n][1])
            for k, case in loaded[n][0].items():
                ts = case.times(args.reps)
                gbps = case.bytes / float(np.median(ts)) / 1e9
                rate[n, k].append(gbps)
                share[n, k].append(gbps / dram)
        print(f"round {r}: DRAM {dram:.1f} GB/s  " + "  ".join(
            f"{n} " + "/".join(f"{rate[n, k][-1]:.1f}" for k in labels) for n in names), flush=True)
    print(f"\n{'version':12} " + " ".join(f"{k + ' GB/s (DRAM share)':>28}" for k in labels)
          + "   " + " ".join(f"{'ratio ' + k:>16}" for k in labels))
    for n in names:
        cells = [f"{np.median(rate[n, k]):10.1f} ({np.median(share[n, k]):.2f})".rjust(28) for k in labels]
        ratios = [f"{np.median(np.array(rate[n, k]) / np.array(rate[names[0], k])):16.3f}" for k in labels]
        print(f"{n:12} " + " ".join(cells) + "   " + " ".join(ratios))


if __name__ == "__main__":
    main()
