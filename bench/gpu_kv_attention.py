"""Paged decode attention on the GPU tier: bf16 (gpu_ops.attention_triton) against int8 and int4
(gpu_ops.attention_quant), Llama-3-8B's head shape (32 q heads, 8 kv heads, D 128, BS 16).

    python3 -m bench.gpu_kv_attention [--out results.json] [--cases 1x8k,1x32k,1x64k,16x8k,32x2k]
        [--rows 1,4,8] [--block-size 16] [--launch 4x2,8x2]

(as a module from the repository root: run as a file, bench/cpu_attention.py would shadow the
package)

Per case (batch × context) and KV dtype: a pool of random codes (scales and zeros of a realistic
size), each sequence's blocks scattered, its last block partly filled and in a bf16 tail as
during decode (context − 5 tokens); the kernel checked once against its torch twin
(`decode_attention_torch`, float32), then timed as µs a call: a CUDA graph of calls rotating over
the pool's layers (≥ 512 MB together, so L2 holds none of a call's data), median of replays.

Rows: a case at k rows a sequence is a speculative step's verification (k consecutive positions
of each sequence): as a run (`RunRows`, one program a sequence reading its KV once for all k
rows) and, beside it, as k separate rows (each reading the KV), the way decode ran them before
runs; their KV GB/s counts the sequence's bytes once. Launch: the quantized kernels' (warps,
pipeline stages) a program, compared.

KV bytes a call = what the kernel must read of the pool: per block and kv head, codes + scales +
zeros (bf16 2·BS·D·2; int8 2·BS·D + 2·4·BS; int4 BS·D + 2·2·D + 2·2·BS·D/32), a tail block as
bf16; block tables, q, outputs and the rotation matrix (L2-resident) not counted. KV GB/s =
bytes / time, against the HBM bound measured here: a device-to-device copy, (read + written) /
time. The table comes last; --out writes it as JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from cpu_attention.layout import KVDtype
from gpu_ops.attention import decode_attention_torch
from gpu_ops.runs import RunRows, run_codes
from gpu_ops.attention_quant import paged_decode_quant, prepare
from gpu_ops import attention_triton
from gpu_ops.attention_triton import paged_decode
from gpu_ops.kv_pool import GpuKVPool

HQ, HKV, D = 32, 8, 128
BS = 16  # --block-size sets it
ROTATE_BYTES = 512 << 20  # the layers a graph rotates over hold at least this much
CHECK_TOL = 1e-2
DTYPES = [KVDtype.BF16, KVDtype.INT8, KVDtype.INT4]


def block_bytes(kv: KVDtype) -> int:
    """Bytes the kernel reads of one sealed block and kv head (see the module doc)."""
    return {KVDtype.BF16: 2 * BS * D * 2, KVDtype.INT8: 2 * BS * D + 2 * 4 * BS,
            KVDtype.INT4: BS * D + 2 * 2 * D + 2 * 2 * BS * (D // 32)}[kv]


def call_bytes(kv: KVDtype, batch: int, ctx: int) -> int:
    """KV bytes one call reads: each sequence's sealed blocks, plus its last block from the bf16 tail."""
    n = ctx - 5
    blocks = -(-n // BS)
    tail = 2 * BS * D * 2
    return batch * HKV * ((blocks - 1) * block_bytes(kv) + (tail if kv is not KVDtype.BF16 else block_bytes(kv)))


def copy_bandwidth(dev: torch.device, nbytes: int = 1 << 30) -> float:
    """HBM bound, bytes/s: (read + written) / time of a device-to-device copy, median of 20."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * nbytes / statistics.median(times)


def make_pool(kv: KVDtype, batch: int, ctx: int, dev: torch.device):
    """→ (pool, block tables [B, MB] int32, lens [B] int32, q [B, HQ, D] bf16), random contents."""
    n = ctx - 5
    mb = -(-n // BS)
    layers = max(2, min(64, math.ceil(ROTATE_BYTES / call_bytes(kv, batch, ctx))))
    pool = GpuKVPool(layers, batch * mb, HKV, BS, D, device=dev, kv_dtype=kv, max_tails=batch)
    g = torch.Generator(device=dev).manual_seed(0)
    for name, t in pool.parts().items():
        if t.dtype == torch.int8:
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, device=dev, dtype=torch.int8))
        elif t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=g, device=dev, dtype=torch.uint8))
        elif name.endswith("scale"):  # int8 codes · scale ~ unit values; int4 likewise
            t.copy_(torch.rand(t.shape, generator=g, device=dev) * (0.02 if kv is KVDtype.INT8 else 0.3))
        else:  # k, v of bf16 pools; zeros
            t.copy_(torch.randn(t.shape, generator=g, device=dev))
    tables = torch.randperm(batch * mb, generator=g, device=dev).reshape(batch, mb).int()
    if pool.quantized:
        pool.tail_k.normal_(generator=g)
        pool.tail_v.normal_(generator=g)
        for blk in tables[:, -1].tolist():  # the block being filled
            pool.open_tail(blk)
    lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, D, generator=g, device=dev).bfloat16()
    return pool, tables, lens, q


def as_rows(tables, lens, q, k: int, runs: bool):
    """Each sequence as k rows at its last k positions → (tables, lens, q, RunRows or None)."""
    if k == 1:
        return tables, lens, q, None
    B = tables.shape[0]
    lens_k = (lens[:, None] - k + 1 + torch.arange(k, device=lens.device)[None, :]).reshape(-1).int()
    q_k = torch.randn(B * k, *q.shape[1:], device=q.device).to(q.dtype)
    rr = None
    if runs:
        rr = RunRows(torch.tensor(run_codes([k] * B), dtype=torch.int32, device=lens.device), k)
    return tables.repeat_interleave(k, 0), lens_k, q_k, rr


def attend(pool: GpuKVPool, layer: int, q, tables, lens, runs=None, launch=None):
    if pool.kv_dtype is KVDtype.BF16:
        return paged_decode(pool, layer, q, tables, lens, D**-0.5, out_dtype=torch.bfloat16, runs=runs)
    return paged_decode_quant(pool, layer, q, tables, lens, D**-0.5, out_dtype=torch.bfloat16, runs=runs,
                              launch=launch)


def time_call(pool: GpuKVPool, q, tables, lens, runs=None, launch=None, replays: int = 20) -> float:
    """µs a call: a graph of calls over the layers in turn, median over replays."""
    calls = max(16, pool.num_layers)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(pool.num_layers):  # compile, caches, allocator warm
            attend(pool, i, q, tables, lens, runs, launch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            attend(pool, i % pool.num_layers, q, tables, lens, runs, launch)
    graph.replay()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(times)


def parse_case(s: str) -> tuple[int, int]:
    b, c = s.lower().split("x")
    return int(b), int(c[:-1]) * 1024 if c.endswith("k") else int(c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON to this file")
    ap.add_argument("--cases", default="1x8k,1x32k,1x64k,16x8k,32x2k", help="batch x context, comma-separated")
    ap.add_argument("--rows", default="1", help="rows a sequence (a speculative step's k), comma-separated")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--launch", default="", help="the quantized kernels' warps x stages[x registers], "
                    "comma-separated (default: the kernels' own, attention_quant.LAUNCH)")
    ap.add_argument("--dtypes", default="bf16,int8,int4")
    ap.add_argument("--heads", default="32/8", help="query heads / kv heads (default Llama-3-8B's; Qwen3-30B-A3B: 32/4)")
    ap.add_argument("--step-tokens", default="", help="the bf16 kernel's tokens a step x warps, comma-separated "
                    "(default: its own, attention_triton.STEP_TOKENS and STEP_WARPS; the block size: a block a step)")
    a = ap.parse_args()
    global BS, HQ, HKV
    BS = a.block_size
    HQ, HKV = (int(x) for x in a.heads.split("/"))
    dev = torch.device("cuda")
    bound = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}: device copy {bound / 1e9:.0f} GB/s (read + written), block {BS}",
          flush=True)
    launches = [tuple(int(x) for x in s.split("x")) for s in a.launch.split(",")] if a.launch else [None]
    steps = [tuple(int(x) for x in s.split("x")) for s in a.step_tokens.split(",")] if a.step_tokens else [None]
    rows = []
    for case in a.cases.split(","):
        batch, ctx = parse_case(case)
        for kv in [KVDtype(d) for d in a.dtypes.split(",")]:
            pool, tables0, lens0, q0 = make_pool(kv, batch, ctx, dev)
            prepare(pool)
            for k, runs in ((int(k), r) for k in a.rows.split(",") for r in ((True, False) if int(k) > 1 else (True,))):
                tables, lens, q, rr = as_rows(tables0, lens0, q0, k, runs)
                for launch in launches if kv is not KVDtype.BF16 else steps:
                    if kv is KVDtype.BF16 and launch is not None:
                        attention_triton.STEP_TOKENS, attention_triton.STEP_WARPS = launch
                    out, _ = attend(pool, 0, q, tables, lens, rr, launch if kv is not KVDtype.BF16 else None)
                    ref, _ = decode_attention_torch(pool, 0, q, tables, lens, D**-0.5)
                    err = float((out.float() - ref).norm() / ref.norm())
                    us = time_call(pool, q, tables, lens, rr, launch)
                    nbytes = call_bytes(kv, batch, ctx)
                    rows.append(dict(case=case, batch=batch, ctx=ctx, kv=kv.value, rows=k,
                                     mode="run" if runs or k == 1 else "rows",
                                     launch="x".join(map(str, launch)) if launch else "own", us=us,
                                     kv_bytes=nbytes, gbps=nbytes / us / 1e3, of_bound=nbytes / (us * 1e-6) / bound,
                                     rel_err=err, layers=pool.num_layers))
                    print(json.dumps(rows[-1]), flush=True)
                    assert err < CHECK_TOL, f"{kv.value} {case}: rel err {err:.2e} against the torch twin"
            del pool, out, ref
            torch.cuda.empty_cache()
    first = rows[0]["launch"] if rows else None
    one = {(r["case"], r["kv"]): r["us"] for r in rows if r["rows"] == 1 and r["launch"] in (first, "own")}
    bf16_us = {r["case"]: r["us"] for r in rows if r["kv"] == "bf16" and r["rows"] == 1}
    print(f"\n{'case':>8} {'kv':>5} {'rows':>7} {'launch':>6} {'µs':>8} {'KV MB':>8} {'GB/s':>6} {'of copy':>7} "
          f"{'vs 1 row':>8} {'vs bf16':>7} {'err':>8}")
    for r in rows:
        vs_bf16 = f"{bf16_us[r['case']] / r['us']:6.2f}x" if r["case"] in bf16_us else "-"
        print(f"{r['case']:>8} {r['kv']:>5} {str(r['rows']) + ' ' + r['mode']:>7} {r['launch']:>6} {r['us']:8.1f} "
              f"{r['kv_bytes'] / 1e6:8.1f} {r['gbps']:6.0f} {r['of_bound']:7.0%} "
              f"{r['us'] / one.get((r['case'], r['kv']), r['us']):7.2f}x {vs_bf16:>7} {r['rel_err']:8.1e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), copy_gbps=bound / 1e9, shape=dict(
                q_heads=HQ, kv_heads=HKV, head_dim=D, block_size=BS), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
