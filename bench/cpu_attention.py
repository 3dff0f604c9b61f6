"""Host decode attention: KV bytes read per second against the DRAM read bound.

    PYTHONUNBUFFERED=1 python3 bench/cpu_attention.py --threads 16 --out DIR

Measures in one run: the DRAM read bandwidth (Numba parallel sum over 2 GiB), then for the
Llama-3-8B shape (32 q heads, 8 kv heads, D 128, one layer) at batch 1 x 32k and 16 x 4k,
each KV dtype: the kernel's KV bytes read per second (data + scales + zeros), its ratio to
DRAM, the torch twins for bf16 (the paged reference and SDPA over contiguous bf16 KV), the
first-call JIT time in a fresh process and whether a second process loads Numba's cache,
and the per-call cost of HostKVPool.write for one decode token. Imports only torch, numpy,
numba and cpu_attention. Reports; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "NUMBA_CACHE_DIR" not in os.environ:  # one cache for this run and its child processes
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="numba-cache-")

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from cpu_attention import HostKVPool, KVDtype, decode_attention, decode_attention_ref, physical_cores  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
SHAPES = [(1, 32768), (16, 4096)]
COPIES = 4  # disjoint block sets cycled through, so the KV read is never cache-resident
LOG: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


@numba.njit(parallel=True, nogil=True, fastmath=True)
def _sum(x):
    acc = 0.0
    for i in numba.prange(x.size):
        acc += x[i]
    return acc


def dram_read_gbps(threads: int) -> float:
    numba.set_num_threads(threads)
    x = np.ones(2**29, np.float32)  # 2 GiB
    _sum(x)
    best = min(_timed(lambda: _sum(x)) for _ in range(5))
    return x.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fill(pool: HostKVPool, gen: torch.Generator) -> None:
    """Random codes of realistic magnitude (values are irrelevant to speed, not to nan-freedom)."""
    if pool.dtype is KVDtype.BF16:
        for t in (pool.k, pool.v):
            t.copy_(torch.randn(t.shape, generator=gen))
    else:
        for t in (pool.k, pool.v):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
        for t in (pool.k_scale, pool.v_scale):
            t.fill_(0.02)
        for t in (pool.k_zero, pool.v_zero):
            if t is not None:
                t.fill_(-0.15)


def bench_kernel(dtype: KVDtype, B: int, n: int, threads: int, reps: int, gen) -> dict:
    nb = n // BS
    pool = HostKVPool(1, COPIES * B * nb, HKV, BS, D, dtype)
    fill(pool, gen)
    perm = torch.randperm(COPIES * B * nb, generator=gen).int().reshape(COPIES, B, nb)
    q = torch.randn(B, HQ, D, generator=gen)
    sl = torch.full((B,), n)
    scale = D**-0.5
    bytes_read = B * n * pool.bytes_per_token
    decode_attention(pool, 0, q, perm[0], sl, scale, threads=threads)
    ts = []
    for i in range(reps):
        ts.append(_timed(lambda: decode_attention(pool, 0, q, perm[i % COPIES], sl, scale, threads=threads)))
    res = {"dtype": dtype.value, "batch": B, "tokens": n, "bytes_per_call": bytes_read,
           "ms_median": 1e3 * float(np.median(ts)), "ms_best": 1e3 * min(ts),
           "GBps": bytes_read / float(np.median(ts)) / 1e9}
    if dtype is KVDtype.BF16:
        torch.set_num_threads(threads)
        t_ref = min(_timed(lambda: decode_attention_ref(pool, 0, q, perm[1], sl, scale)) for _ in range(2))
        res["torch_ref_GBps"] = bytes_read / t_ref / 1e9
        # torch's own CPU attention over contiguous bf16 KV (the baseline the issue names)
        k = torch.randn(B, HKV, n, D, generator=gen).to(torch.bfloat16)
        v = torch.randn(B, HKV, n, D, generator=gen).to(torch.bfloat16)
        qb = q.to(torch.bfloat16)[:, :, None]
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qb, k, v, enable_gqa=True)  # noqa: E731
        sdpa()
        t_sdpa = float(np.median([_timed(sdpa) for _ in range(5)]))
        res["torch_sdpa_GBps"] = 2 * k.numel() * 2 / t_sdpa / 1e9
        del k, v
    return res


JIT_PROBE = """
import time, sys, torch
sys.path.insert(0, {root!r})
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
"""


def jit_times() -> tuple[dict, dict]:
    code = JIT_PROBE.format(root=str(ROOT))
    runs = []
    for _ in range(2):  # first process compiles into the cache, the second should load it
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
        if r.returncode:
            raise RuntimeError(r.stderr)
        runs.append(eval(r.stdout.strip().splitlines()[-1]))
    return runs[0], runs[1]


def write_cost(dtype: KVDtype) -> float:
    """Seconds per HostKVPool.write of one decode token (one layer, 8 kv heads)."""
    pool = HostKVPool(1, 64, HKV, BS, D, dtype)
    k, v = torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    slot = torch.tensor([5])
    for _ in range(20):
        pool.write(0, slot, k, v)
    t = _timed(lambda: [pool.write(0, slot, k, v) for _ in range(200)])
    return t / 200


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: physical cores)")
    ap.add_argument("--out", type=Path, default=None, help="folder for cpu_attention.log and .json")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    threads = args.threads or physical_cores()
    gen = torch.Generator().manual_seed(0)
    log(f"cpu_attention bench: {os.cpu_count()} logical cpus, {physical_cores()} physical, threads {threads}, "
        f"numba {numba.__version__}, torch {torch.__version__}")
    first, second = jit_times()
    log(f"JIT first process (cold cache): {first}")
    log(f"JIT second process (from cache): {second}")
    dram = dram_read_gbps(threads)
    log(f"DRAM read (numba parallel sum over 2 GiB, {threads} threads): {dram:.1f} GB/s")
    writes = {dt.value: write_cost(dt) for dt in (KVDtype.BF16, KVDtype.INT8, KVDtype.INT4)}
    log("HostKVPool.write per call, one token: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in writes.items()))
    rows = []
    for B, n in SHAPES:
        for dt in (KVDtype.BF16, KVDtype.INT8, KVDtype.INT4):
            r = bench_kernel(dt, B, n, threads, args.reps, gen)
            r["ratio_vs_dram"] = r["GBps"] / dram
            rows.append(r)
            log(json.dumps(r))
    log(f"numba threading layer: {_layer()}")
    log("")
    log(f"{'shape':>10} {'dtype':>5} {'ms':>7} {'GB/s':>6} {'DRAM':>6} {'ratio':>6}  torch twins (bf16)")
    for r in rows:
        extra = ""
        if "torch_ref_GBps" in r:
            extra = (f"  paged ref {r['torch_ref_GBps']:.1f} GB/s, sdpa {r['torch_sdpa_GBps']:.1f} GB/s, "
                     f"kernel/sdpa {r['GBps'] / r['torch_sdpa_GBps']:.2f}x")
        log(f"{r['batch']:>4}x{r['tokens']:<5} {r['dtype']:>5} {r['ms_median']:7.2f} {r['GBps']:6.1f} "
            f"{dram:6.1f} {r['ratio_vs_dram']:6.2f}{extra}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu_attention.log").write_text("\n".join(LOG) + "\n")
        (args.out / "cpu_attention.json").write_text(json.dumps(
            {"threads": threads, "dram_read_GBps": dram, "jit_first": first, "jit_second": second,
             "threading_layer": _layer(), "write_s": writes, "rows": rows}, indent=1))


def _layer() -> str:
    try:
        return numba.threading_layer()
    except ValueError:
        return "not started"


if __name__ == "__main__":
    main()
