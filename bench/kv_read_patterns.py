"""The memory side alone: how fast the decode kernels' access patterns read from DRAM, no compute.

    python3 bench/kv_read_patterns.py --threads 16

A decode kernel reads, per (block, kv head), one short run of bytes in each of the pool's
arrays (int4: key codes 1 KiB, value codes 1 KiB, key scales and zeros 256 B each, value scales
and zeros 128 B each at D 128, block 16). This reads exactly those bytes (summing them as
64-bit words), in the kernels' order (items of one kv head and token range, blocks in a
shuffled table), for each dtype's layout and for alternatives the pool could use:

- `split`: the pool's arrays as they are, one run per array per (block, head);
- `joined`: the same bytes of a (block, head) in one contiguous run;
- `*-heads`: items of one token range over all kv heads, so the runs of a block's heads are
  read one after the other (with the pool's [block, head, ...] order they are contiguous);

each with no software prefetch and with the block PREFETCH ahead prefetched into L2. Disjoint
copies are cycled so a call's bytes were last read over 1 GiB before (past the L3). Prints
GB/s and the ratio to a plain streaming read (Numba's parallel sum) measured in the same run.
Reports; asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import prange  # noqa: E402

from cpu_attention._numba import dram_read_gbps, prefetch_l2  # noqa: E402
from cpu_attention.decode import _plan, chunk_tokens  # noqa: E402

PAST_L3 = 2**30
PREFETCH = 4  # blocks


@numba.njit(parallel=True, nogil=True, cache=True)
def _read(arrs, bt, items, BS, Hkv, all_heads, ahead):
    """Σ of the words of each array's row (block · Hkv + h) for every block of every item; an item
    (b, h, t0, t1) reads head h, or with all_heads the rows of every head (h ignored)."""
    NI = items.shape[0]
    tot = np.zeros(NI, np.uint64)
    for it in prange(NI):
        b, h, t0, t1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        acc = np.uint64(0)
        h0, h1 = (0, Hkv) if all_heads else (h, h + 1)
        nbt = (t1 + BS - 1) // BS
        for bi in range(t0 // BS, nbt):
            blk = bt[b, bi]
            if ahead > 0 and bi + ahead < nbt:
                pb = bt[b, bi + ahead]
                for a in arrs:
                    for hh in range(h0, h1):
                        r = pb * Hkv + hh
                        for w in range(0, a.shape[1], 8):
                            prefetch_l2(a, r * a.shape[1] + w)
            for a in arrs:
                for hh in range(h0, h1):
                    r = blk * Hkv + hh
                    for w in range(a.shape[1]):
                        acc += a[r, w]
        tot[it] = acc
    return tot.sum()


def _zeros(shape, hugepages: bool) -> np.ndarray:
    """uint64 zeros; with hugepages, in an anonymous mapping advised MADV_HUGEPAGE (2 MiB pages where
    the kernel's transparent huge pages are madvise-only, as torch's tensors get none)."""
    if not hugepages:
        return np.zeros(shape, np.uint64)
    import mmap

    n = int(np.prod(shape)) * 8
    m = mmap.mmap(-1, n + (2 << 20))
    m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, np.uint64, int(np.prod(shape))).reshape(shape)


def layouts(dtype: str, D: int, BS: int) -> dict[str, list[int]]:
    """Bytes of one (block, head) in each of the pool's arrays ("split") and joined in one run."""
    if dtype == "bf16":
        runs = [2 * BS * D, 2 * BS * D]
    elif dtype == "int8":
        runs = [BS * D, BS * D, 2 * BS, 2 * BS]
    else:
        ng = D // 32
        runs = [BS * D // 2, BS * D // 2, 2 * D, 2 * D, 2 * BS * ng, 2 * BS * ng]
    runs = [-(-r // 8) * 8 for r in runs]
    return {"split": runs, "joined": [sum(runs)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtypes", default="int4,int8,bf16")
    ap.add_argument("--shapes", default="1x32768,16x4096")
    ap.add_argument("--hugepages", action="store_true", help="arrays in 2 MiB pages (MADV_HUGEPAGE)")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    Hkv, D, BS = 8, 128, 16
    dram = dram_read_gbps(2**31)
    rows = []
    for dtype in args.dtypes.split(","):
        for shape in args.shapes.split(","):
            B, n = map(int, shape.split("x"))
            nb = B * n // BS
            for name, runs in layouts(dtype, D, BS).items():
                per_copy = nb * Hkv * sum(runs)
                copies = max(2, -(-PAST_L3 // per_copy) + 1)
                NB = copies * nb
                arrs = tuple(_zeros((NB * Hkv, r // 8), args.hugepages) for r in runs)
                for a in arrs:
                    a.fill(1)
                rng = np.random.default_rng(0)
                tables = [(c * nb + rng.permutation(nb)).astype(np.int32).reshape(B, n // BS) for c in range(copies)]
                sl = np.full(B, n, np.int64)
                for all_heads in (False, True):
                    ih = 1 if all_heads else Hkv  # kv heads the items are split by
                    items, _ = _plan(sl, ih, chunk_tokens(sl, ih, BS, args.threads))
                    for ahead in (0, PREFETCH):
                        _read(arrs, tables[0], items, BS, Hkv, all_heads, ahead)
                        ts = []
                        for r in range(args.reps):
                            t = time.perf_counter()
                            _read(arrs, tables[r % copies], items, BS, Hkv, all_heads, ahead)
                            ts.append(time.perf_counter() - t)
                        gbps = per_copy / float(np.median(ts)) / 1e9
                        label = f"{dtype} {shape} {name}{'-heads' if all_heads else ''} pf{ahead}"
                        rows.append((label, gbps))
                        print(f"{label:40s} {gbps:6.1f} GB/s  {gbps / dram:.2f} of DRAM", flush=True)
                del arrs
    dram2 = dram_read_gbps(2**31)
    print(f"\nDRAM read (Numba parallel sum, 2 GiB): {dram:.1f} before, {dram2:.1f} after; {args.threads} threads"
          f"{', 2 MiB pages' if args.hugepages else ''}")


if __name__ == "__main__":
    main()
