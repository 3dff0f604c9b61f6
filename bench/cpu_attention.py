"""Host decode attention: KV bytes read per second against the DRAM read bound.

    PYTHONUNBUFFERED=1 python3 -m bench.cpu_attention --threads 16 --out DIR

(as a module from the repository root: run as a file, this script would shadow the
`cpu_attention` package)

Measures in one run: the DRAM read bandwidth (Numba parallel sum over 2 GiB before and after the
kernels, and torch.sum over the same size; the bound is the largest of the three), then for the
Llama-3-8B shape (32 q heads, 8 kv heads, D 128, one layer; `--heads 9,3,64 --block-size 32`
for SmolLM2-135M's) at batch 1 x 32k and 16 x 4k (`--shapes`), each KV dtype: the kernel's KV
bytes read per second (data + scales + zeros; timed as the engine calls it, `DecodeWork.run`
with the step's work split made beforehand; disjoint copies of the KV cycled so a call's bytes
were last read over 1 GiB of reads before, past the GPU host's ~300 MiB L3), its ratio to DRAM,
the torch twins for bf16 (the paged reference and SDPA over contiguous bf16 KV), the
first-call JIT time in a fresh process and whether a second process loads Numba's cache,
and the per-call cost of HostKVPool.write for one decode token. Diagnostics that tell
compute from memory: each kernel's ns per (token, kv head) on one thread with the KV in
cache, its all-thread rate with the KV in cache, and a plain read of the same K/V bytes in
the kernel's order (the access pattern's own bound); and each kernel's error against its
float64 twin (this host's vector code may be one the tests never ran). `--int8-sweep` also
times int8 at other tile and prefetch settings; `--runs 1,4,8` a speculative step's run of rows of
one sequence (the KV before the run read once for all of them), against one row and row by row;
`--tiles on|off` takes int8's AMX tile products at any head count or never. Imports only torch, numpy, numba, cpu_attention
and `bench.kv_pools`. Reports; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "NUMBA_CACHE_DIR" not in os.environ:  # one cache for this run and its child processes
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="numba-cache-")

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.kv_pools import copies_past_l3, fill, pattern_read_gbps, timed  # noqa: E402
from cpu_attention import dram_read_gbps  # noqa: E402
from cpu_attention import (DecodeWork, HostKVPool, KVDtype, decode_attention, decode_attention_ref,  # noqa: E402
                           physical_cores)
from cpu_attention import decode_int8 as int8_mod  # noqa: E402  (its tile and prefetch settings, read per call)
from cpu_attention import configure  # noqa: E402

SHAPES = ["1x32768", "16x4096"]
COPIES = 4  # disjoint block sets cycled through: at least this many, and past the L3 (`kv_pools`)
LOG: list[str] = []


@dataclass(frozen=True)
class Heads:
    """One layer's attention shape: query heads, kv heads, head dim, and the pool's block size."""

    q: int = 32
    kv: int = 8
    d: int = 128
    block: int = 16


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


def in_cache(dtype: KVDtype, hs: Heads, threads: int, n: int, gen) -> tuple[float, float]:
    """(ns per (token, kv head) per thread, GB/s) with one sequence of n tokens that stays in cache."""
    nb = n // hs.block
    pool = HostKVPool(1, nb, hs.kv, hs.block, hs.d, dtype)
    fill(pool, gen)
    bt = torch.randperm(nb, generator=gen).int()[None]
    q, sl = torch.randn(1, hs.q, hs.d, generator=gen), torch.tensor([n])
    call = _engine_call(pool, [bt], sl, q, hs.d**-0.5, threads)
    call(0)
    t = min(timed(lambda: call(0)) for _ in range(20))
    return t * threads / (n * hs.kv) * 1e9, n * pool.bytes_per_token / t / 1e9


def _engine_call(pool: HostKVPool, tables, sl: torch.Tensor, q: torch.Tensor, scale: float, threads: int,
                 runs: bool = True):
    """call(i): the kernel over block table tables[i % len(tables)] as the engine calls it per layer,
    `DecodeWork.run` into reused buffers, the step's work split made beforehand (`decode_attention`
    remakes it every call: ~20-50 us of Python); runs False: a run of rows attended row by row."""
    works = [DecodeWork(pool, t, sl, threads, runs=runs) for t in tables]
    qn = q.numpy()
    on, ln, scaled = np.empty(qn.shape, np.float32), np.empty(qn.shape[:2], np.float32), np.empty_like(qn)
    return lambda i: works[i % len(works)].run(pool, 0, qn, scale, on, ln, scaled)


def kernel_error(dtype: KVDtype, hs: Heads, threads: int, gen) -> tuple[float, float]:
    """(relative error of out, max |error| of lse) of the kernel against its float64 twin on
    odd lengths: the benchmarked code paths (vector widths, instruction sets) checked on
    this host's own CPU, which the tests may never have run on."""
    lens = [1, 1003, 2 * hs.block + 5]
    nbs = [-(-n // hs.block) for n in lens]
    pool = HostKVPool(1, sum(nbs), hs.kv, hs.block, hs.d, dtype)
    bt = torch.zeros(len(lens), max(nbs), dtype=torch.int32)
    perm, c = torch.randperm(sum(nbs), generator=gen).int(), 0
    for i, (n, nb) in enumerate(zip(lens, nbs)):
        bt[i, :nb] = perm[c:c + nb]
        c += nb
        t = torch.arange(n)
        mu = 2 * torch.randn(hs.kv, hs.d, generator=gen)  # channel means, as real keys have
        kv = [torch.randn(n, hs.kv, hs.d, generator=gen) + mu for _ in range(2)]
        pool.write(0, bt[i, t // hs.block].long() * hs.block + t % hs.block, *kv)
    q, sl, scale = torch.randn(len(lens), hs.q, hs.d, generator=gen), torch.tensor(lens), hs.d**-0.5
    out, lse = decode_attention(pool, 0, q, bt, sl, scale, threads=threads)
    ro, rl = decode_attention_ref(pool, 0, q, bt, sl, scale, dtype=torch.float64)
    return float((out.double() - ro).norm() / ro.norm()), float((lse.double() - rl).abs().max())


def bench_kernel(dtype: KVDtype, hs: Heads, B: int, n: int, threads: int, reps: int, gen) -> dict:
    nb = n // hs.block
    copies = copies_past_l3(dtype, hs.kv, hs.block, hs.d, B * n, least=COPIES)
    pool = HostKVPool(1, copies * B * nb, hs.kv, hs.block, hs.d, dtype)
    fill(pool, gen)
    perm = torch.randperm(copies * B * nb, generator=gen).int().reshape(copies, B, nb)
    q = torch.randn(B, hs.q, hs.d, generator=gen)
    sl = torch.full((B,), n)
    scale = hs.d**-0.5
    bytes_read = B * n * pool.bytes_per_token
    call = _engine_call(pool, perm, sl, q, scale, threads)
    call(0)
    ts = [timed(lambda: call(i + 1)) for i in range(reps)]
    res = {"dtype": dtype.value, "batch": B, "tokens": n, "bytes_per_call": bytes_read, "copies": copies,
           "ms_median": 1e3 * float(np.median(ts)), "ms_best": 1e3 * min(ts),
           "GBps": bytes_read / float(np.median(ts)) / 1e9}
    res["pattern_read_GBps"], res["pattern_read_all_heads_GBps"] = pattern_read_gbps(pool, perm[0], sl, threads, 5)
    if dtype is KVDtype.BF16:
        torch.set_num_threads(threads)
        t_ref = min(timed(lambda: decode_attention_ref(pool, 0, q, perm[1], sl, scale)) for _ in range(2))
        res["torch_ref_GBps"] = bytes_read / t_ref / 1e9
        # torch's own CPU attention over contiguous bf16 KV
        k = torch.randn(B, hs.kv, n, hs.d, generator=gen).to(torch.bfloat16)
        v = torch.randn(B, hs.kv, n, hs.d, generator=gen).to(torch.bfloat16)
        qb = q.to(torch.bfloat16)[:, :, None]
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qb, k, v, enable_gqa=True)  # noqa: E731
        sdpa()
        t_sdpa = float(np.median([timed(sdpa) for _ in range(5)]))
        res["torch_sdpa_GBps"] = 2 * k.numel() * 2 / t_sdpa / 1e9
        del k, v
    return res


def bench_run(dtype: KVDtype, hs: Heads, n: int, k: int, threads: int, reps: int, gen) -> dict:
    """A speculative step's verification on the host tier: a run of k rows of one sequence whose
    last row sees n tokens (row r sees n − k + 1 + r), timed as the engine attends it (the KV
    before the run read once for all k rows, `cpu_attention.decode_run`) and row by row."""
    nb = -(-n // hs.block)
    copies = copies_past_l3(dtype, hs.kv, hs.block, hs.d, n, least=COPIES)
    pool = HostKVPool(1, copies * nb, hs.kv, hs.block, hs.d, dtype)
    fill(pool, gen)
    tables = torch.randperm(copies * nb, generator=gen).int().reshape(copies, 1, nb).expand(copies, k, nb).contiguous()
    sl = torch.arange(n - k + 1, n + 1)
    q = torch.randn(k, hs.q, hs.d, generator=gen)
    out = {"dtype": dtype.value, "tokens": n, "rows": k, "bytes_per_call": n * pool.bytes_per_token}
    for name, runs in (("run", True), ("row_by_row", False)):
        call = _engine_call(pool, tables, sl, q, hs.d**-0.5, threads, runs=runs)
        call(0)
        out[f"{name}_ms"] = 1e3 * float(np.median([timed(lambda i=i: call(i + 1)) for i in range(reps)]))
    out["GBps"] = out["bytes_per_call"] / out["run_ms"] / 1e6  # the KV counted once
    return out


JIT_PROBE = """
import time, torch
t0 = time.perf_counter()
from cpu_attention import HostKVPool, KVDtype, decode_attention
t_import = time.perf_counter() - t0
out = {{"import_s": t_import}}
for dt in (KVDtype.BF16, KVDtype.INT8, KVDtype.INT4):
    pool = HostKVPool(1, 8, 8, 16, 128, dt)
    t0 = time.perf_counter()
    decode_attention(pool, 0, torch.randn(1, 32, 128), torch.arange(8, dtype=torch.int32)[None], torch.tensor([100]), 0.1)
    out[dt.value + "_first_call_s"] = time.perf_counter() - t0
print(repr(out))
"""  # run from the repository root, where `cpu_attention` is the package


def jit_times() -> tuple[dict, dict]:
    runs = []
    for _ in range(2):  # first process compiles into the cache, the second should load it
        r = subprocess.run([sys.executable, "-c", JIT_PROBE], capture_output=True, text=True, env=os.environ, cwd=ROOT)
        if r.returncode:
            raise RuntimeError(r.stderr)
        runs.append(eval(r.stdout.strip().splitlines()[-1]))
    return runs[0], runs[1]


def write_cost(dtype: KVDtype, hs: Heads) -> float:
    """Seconds per HostKVPool.write of one decode token (one layer), tokens written in order, so
    int4's per-block quantization (when a block's last token comes) is in the average."""
    pool = HostKVPool(1, 64, hs.kv, hs.block, hs.d, dtype)
    k, v = torch.randn(1, hs.kv, hs.d), torch.randn(1, hs.kv, hs.d)
    slots = [torch.tensor([i]) for i in range(64 * hs.block)]
    for s in slots[:20]:
        pool.write(0, s, k, v)
    n = max(200, 4 * hs.block)
    t = timed(lambda: [pool.write(0, slots[i % len(slots)], k, v) for i in range(n)])
    return t / n


def main() -> None:
    configure()  # the engine's Numba settings, before the first compile
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: physical cores)")
    ap.add_argument("--out", type=Path, default=None, help="folder for cpu_attention.log and .json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-jit", action="store_true", help="skip the fresh-process JIT timing")
    ap.add_argument("--heads", default="32,8,128", help="query heads, kv heads, head dim (SmolLM2-135M: 9,3,64)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--shapes", nargs="*", default=SHAPES, help="BATCHxTOKENS runs to time (none: diagnostics only)")
    ap.add_argument("--dtypes", default="bf16,int8,int4", help="comma-separated KV dtypes to measure")
    ap.add_argument("--runs", default="", help="also time runs of these row counts (a speculative step's "
                    "verification, e.g. 1,4,8) over the first shape's tokens, each dtype")
    ap.add_argument("--int8-sweep", default="", help="also time int8 at these TILE:AHEAD pairs, comma-separated: tile "
                    "tokens and blocks prefetched ahead (the engine's: decode_int8.INT8_TILE, PREFETCH_BLOCKS)")
    ap.add_argument("--tiles", choices=("auto", "on", "off"), default="auto", help="int8 through AMX tile products: "
                    "the engine's choice (decode_int8.TILE_MIN_HEADS), at any head count, or never")
    args = ap.parse_args()
    if args.tiles == "on" and not int8_mod.TILES:
        ap.error("--tiles on: this CPU has no AMX tiles (or Linux did not grant them)")
    if args.tiles != "auto":
        int8_mod.TILE_MIN_HEADS = 1 if args.tiles == "on" else None
    dtypes = [KVDtype(d) for d in args.dtypes.split(",")]
    hs = Heads(*map(int, args.heads.split(",")), block=args.block_size)
    shapes = [tuple(map(int, x.split("x"))) for x in args.shapes]
    threads = args.threads or physical_cores()
    gen = torch.Generator().manual_seed(0)
    log(f"cpu_attention bench: {os.cpu_count()} logical cpus, {physical_cores()} physical, threads {threads}, "
        f"numba {numba.__version__}, torch {torch.__version__}; {hs}, load average {os.getloadavg()[0]:.2f}")
    log(f"numba CPU features: {numba.config.CPU_FEATURES or 'host default'}")
    log(f"int8 tile products (AMX): {'usable' if int8_mod.TILES else 'not on this CPU'}; from "
        f"{int8_mod.TILE_MIN_HEADS} query rows a kv head (--tiles {args.tiles})")
    first, second = jit_times() if not args.no_jit else ({}, {})
    log(f"JIT first process (cold cache): {first}")
    log(f"JIT second process (from cache): {second}")
    dram = dram_read_gbps(2**31, threads)
    log(f"DRAM read (numba parallel sum over 2 GiB, {threads} threads): {dram:.1f} GB/s")
    torch_read = torch_read_gbps(2**31, threads)
    log(f"DRAM read with torch.sum over 2 GiB ({threads} threads): {torch_read:.1f} GB/s")
    writes = {dt.value: write_cost(dt, hs) for dt in dtypes}
    log("HostKVPool.write per call, one token: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in writes.items()))
    diag = {}
    for dt in dtypes:
        ns1, _ = in_cache(dt, hs, 1, 2048, gen)
        _, gb = in_cache(dt, hs, threads, 8192, gen)
        err, lse_err = kernel_error(dt, hs, threads, gen)
        diag[dt.value] = {"ns_per_token_head_1thread_cached": ns1, "GBps_all_threads_cached": gb,
                          "rel_error_vs_float64_twin": err, "lse_error_vs_float64_twin": lse_err}
        log(f"{dt.value}: {ns1:.1f} ns per (token, kv head) on 1 thread in cache; "
            f"{gb:.1f} GB/s on {threads} threads in cache (1 x 8192); vs its float64 twin: "
            f"out rel. error {err:.1e} (tests: < {1e-4 if dt is KVDtype.BF16 else 3e-3:.0e}), lse {lse_err:.1e} "
            f"(< 1e-4, int8 3e-4)")
    rows = []
    for B, n in shapes:
        for dt in dtypes:
            r = bench_kernel(dt, hs, B, n, threads, args.reps, gen)
            rows.append(r)
            log(json.dumps(r))
    # the bound is the best read rate the machine shows: the sum is measured again after the
    # kernels (on the GPU host's VMs one measurement ranged 82-103 GB/s within minutes, and a
    # kernel once read faster than the first one; torch.sum once read 97.7 GB/s where Numba's sum
    # read 85.6 and 90.3), the ratios are against the largest
    dram_start, dram_end = dram, dram_read_gbps(2**31, threads)
    dram = max(dram_start, dram_end, torch_read)
    log(f"DRAM read again after the kernels: {dram_end:.1f} GB/s; the bound (the largest of the three reads): "
        f"{dram:.1f} GB/s")
    for r in rows:
        r["ratio_vs_dram"] = r["GBps"] / dram
    runs = []
    for k in [int(x) for x in args.runs.split(",") if x]:
        for dt in dtypes:
            runs.append(bench_run(dt, hs, shapes[0][1], k, threads, args.reps, gen))
            log(json.dumps(runs[-1]))
    engine = int8_mod.INT8_TILE, int8_mod.PREFETCH_BLOCKS
    for pair in [x for x in args.int8_sweep.split(",") if x]:
        int8_mod.INT8_TILE, int8_mod.PREFETCH_BLOCKS = map(int, pair.split(":"))
        _, gb = in_cache(KVDtype.INT8, hs, threads, 8192, gen)
        log(f"int8 in cache (1 x 8192), tile {int8_mod.INT8_TILE}, prefetch {int8_mod.PREFETCH_BLOCKS} blocks ahead: "
            f"{gb:.1f} GB/s on {threads} threads")
        for B, n in shapes:
            r = bench_kernel(KVDtype.INT8, hs, B, n, threads, args.reps, gen)
            log(f"int8 {B}x{n}, tile {int8_mod.INT8_TILE}, K/V prefetched {int8_mod.PREFETCH_BLOCKS} blocks ahead: "
                f"{r['GBps']:.1f} GB/s, {r['GBps'] / dram:.2f} of DRAM (best {r['bytes_per_call'] / r['ms_best'] / 1e6:.1f})")
    int8_mod.INT8_TILE, int8_mod.PREFETCH_BLOCKS = engine
    log(f"numba threading layer: {_layer()}")
    log("")
    log(f"{'shape':>10} {'dtype':>5} {'ms':>7} {'GB/s':>6} {'DRAM':>6} {'ratio':>6}  torch twins (bf16)")
    for r in rows:
        extra = ""
        if "torch_ref_GBps" in r:
            extra = (f"  paged ref {r['torch_ref_GBps']:.1f} GB/s, sdpa {r['torch_sdpa_GBps']:.1f} GB/s, "
                     f"kernel/sdpa {r['GBps'] / r['torch_sdpa_GBps']:.2f}x")
        log(f"{r['batch']:>4}x{r['tokens']:<5} {r['dtype']:>5} {r['ms_median']:7.2f} {r['GBps']:6.1f} "
            f"{dram:6.1f} {r['ratio_vs_dram']:6.2f}  pattern read {r['pattern_read_GBps']:.1f} "
            f"(all heads {r['pattern_read_all_heads_GBps']:.1f}){extra}")
    if runs:
        log("")
        log(f"runs of rows over {shapes[0][1]} tokens (a speculative step's verification; GB/s counts the KV once)")
        log(f"{'dtype':>5} {'rows':>4} {'ms':>7} {'GB/s':>6} {'x 1 row':>7} {'row by row ms':>14}")
        one = {r["dtype"]: r["run_ms"] for r in runs if r["rows"] == 1}
        for r in runs:
            log(f"{r['dtype']:>5} {r['rows']:>4} {r['run_ms']:7.2f} {r['GBps']:6.1f} "
                f"{r['run_ms'] / one.get(r['dtype'], r['run_ms']):7.2f} {r['row_by_row_ms']:14.2f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu_attention.log").write_text("\n".join(LOG) + "\n")
        (args.out / "cpu_attention.json").write_text(json.dumps(
            {"threads": threads, "heads": vars(hs), "dram_read_GBps": dram, "torch_read_GBps": torch_read,
             "dram_read_start_end_GBps": [dram_start, dram_end], "jit_first": first, "jit_second": second,
             "threading_layer": _layer(), "write_s": writes, "diagnostics": diag, "rows": rows, "runs": runs}, indent=1))


def torch_read_gbps(nbytes: int, threads: int) -> float:
    """torch.sum's read rate of a float32 tensor of nbytes (best of 3), at `threads` intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(before)
    return nbytes / best / 1e9


def _layer() -> str:
    try:
        return numba.threading_layer()
    except ValueError:
        return "not started"


if __name__ == "__main__":
    main()
