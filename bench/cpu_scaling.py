"""Thread scaling and fixed costs of the decode attention kernels, called as the engine calls them.

    python3 bench/cpu_scaling.py [--threads 1,8,16] [--dtypes bf16,int8,int4] [--out DIR]

For each KV dtype and thread count, through `DecodeWork.run` (what the engine calls per layer,
the step's work split built once, so no Python set-up is timed):
- the fixed cost of one call: one block (16 tokens) per kv head;
- the rate with the KV in cache: one sequence of 8192 tokens, the same blocks every call;
- the rate from DRAM at 1 × 32k and 16 × 4k: enough disjoint copies of the KV cycled through
  that a call's bytes were last touched > 1 GiB of reads ago (the GPU host's L3 holds ~300 MiB);
- with `--more-items`, the same with 16 work items a thread (the kernels' queue hands them out;
  `decode.ITEMS_PER_THREAD` is the default).
Each rate beside the DRAM read of the same thread count (Numba parallel sum over 2 GiB), median and
best call of `--reps`. Llama-3-8B's layer shape (32 q heads, 8 kv heads, D 128, block 16).
Reports; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
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

from cpu_attention import HostKVPool, KVDtype  # noqa: E402
from cpu_attention import decode as decode_mod  # noqa: E402
from cpu_attention._numba import dram_read_gbps  # noqa: E402
from cpu_attention.decode import DecodeWork  # noqa: E402
from kv_pools import copies_past_l3, fill  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
LOG: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


class Case:
    """B sequences of n tokens, `copies` disjoint block sets; `call(i)` runs copy i % copies."""

    def __init__(self, dtype: KVDtype, B: int, n: int, copies: int, threads: int, gen: torch.Generator):
        nb = n // BS
        self.pool = HostKVPool(1, copies * B * nb, HKV, BS, D, dtype)
        fill(self.pool, gen)
        perm = torch.randperm(copies * B * nb, generator=gen).int().reshape(copies, B, nb)
        sl = torch.full((B,), n)
        self.works = [DecodeWork(self.pool, perm[c], sl, threads) for c in range(copies)]
        self.q = torch.randn(B, HQ, D, generator=gen).numpy()
        self.on, self.ln = np.empty((B, HQ, D), np.float32), np.empty((B, HQ), np.float32)
        self.scaled = np.empty_like(self.q)
        self.bytes = B * n * self.pool.bytes_per_token

    def call(self, i: int) -> float:
        t0 = time.perf_counter()
        self.works[i % len(self.works)].run(self.pool, 0, self.q, D**-0.5, self.on, self.ln, self.scaled)
        return time.perf_counter() - t0

    def times(self, reps: int) -> np.ndarray:
        self.call(0)
        return np.array([self.call(i + 1) for i in range(reps)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,8,16", help="thread counts, comma-separated")
    ap.add_argument("--dtypes", default="bf16,int8,int4")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", default="1x32768,16x4096", help="BATCHxTOKENS from DRAM (threads > 1)")
    ap.add_argument("--more-items", action="store_true", help="also 16 work items a thread")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    threads = [int(x) for x in args.threads.split(",")]
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s]
    log(f"cpu_scaling: {os.cpu_count()} cpus, numba {numba.__version__}, load {os.getloadavg()[0]:.2f}, "
        f"Hq {HQ} Hkv {HKV} D {D} BS {BS}, reps {args.reps}")
    rows = []
    dram = {}
    for t in threads:
        numba.set_num_threads(t)
        dram[t] = dram_read_gbps(2**31)
        log(f"DRAM read, {t} threads: {dram[t]:.1f} GB/s")
    for dt in (KVDtype(x) for x in args.dtypes.split(",")):
        for t in threads:
            row = {"dtype": dt.value, "threads": t, "dram_GBps": dram[t]}
            fixed = Case(dt, 1, BS, 1, t, gen).times(args.reps)
            row["fixed_us"] = 1e6 * float(np.median(fixed))
            cached = Case(dt, 1, 8192, 1, t, gen)
            ts = cached.times(args.reps)
            row["cache_GBps"] = cached.bytes / float(np.median(ts)) / 1e9
            row["cache_ns_token_head_thread"] = float(np.median(ts)) * t / (8192 * HKV) * 1e9
            log(f"{dt.value} {t:>2} threads: fixed {row['fixed_us']:.0f} us a call; in cache {row['cache_GBps']:.1f} "
                f"GB/s, {row['cache_ns_token_head_thread']:.1f} ns per (token, kv head) a thread")
            del cached
            for B, n in shapes if t > 1 else []:
                default = decode_mod.ITEMS_PER_THREAD
                schedules = [("default", default)] + ([("items16", 16)] if args.more_items else [])
                for name, ipt in schedules:
                    decode_mod.ITEMS_PER_THREAD = ipt
                    decode_mod._work_items.cache_clear()
                    case = Case(dt, B, n, copies_past_l3(dt, HKV, BS, D, B * n), t, gen)
                    ts = case.times(args.reps)
                    med, best = case.bytes / float(np.median(ts)) / 1e9, case.bytes / ts.min() / 1e9
                    row[f"{B}x{n}_{name}_GBps"], row[f"{B}x{n}_{name}_best_GBps"] = med, best
                    log(f"{dt.value} {t:>2} threads {B}x{n} {name}: {med:.1f} GB/s ({med / dram[t]:.2f} of DRAM), "
                        f"best call {best:.1f} ({best / dram[t]:.2f}); {1e3 * float(np.median(ts)):.2f} ms, "
                        f"{len(case.works)} copies")
                    del case
                decode_mod.ITEMS_PER_THREAD = default
                decode_mod._work_items.cache_clear()
            rows.append(row)
    log("")
    keys = [f"{B}x{n}" for B, n in shapes]
    log(f"{'dtype':>5} {'thr':>3} {'DRAM':>6} {'fixed us':>8} {'cache GB/s':>10} {'ns/tok-head':>11}  "
        + "  ".join(f"{k + ' ratio (best)':>22}" for k in keys))
    for r in rows:
        cells = []
        for k in keys:
            if f"{k}_default_GBps" in r:
                rd = r["dram_GBps"]
                c = f"{r[f'{k}_default_GBps'] / rd:.2f} ({r[f'{k}_default_best_GBps'] / rd:.2f})"
                if f"{k}_items16_GBps" in r:
                    c += f" 16/thr {r[f'{k}_items16_GBps'] / rd:.2f}"
                cells.append(f"{c:>22}")
        log(f"{r['dtype']:>5} {r['threads']:>3} {r['dram_GBps']:6.1f} {r['fixed_us']:8.0f} {r['cache_GBps']:10.1f} "
            f"{r['cache_ns_token_head_thread']:11.1f}  " + "  ".join(cells))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu_scaling.log").write_text("\n".join(LOG) + "\n")
        (args.out / "cpu_scaling.json").write_text(json.dumps({"dram": dram, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
