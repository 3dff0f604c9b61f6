"""Heterogeneous decode: 4-bit Llama-3-8B-shaped weights on the GPU, KV on the host (and split).

    python3 -m bench.offload_decode --out DIR [--quick] [--only NAMES]

One run measures the machine (planner.profile.measure: HBM, DRAM, PCIe, CPU attention), then
for each workload (`WORKLOADS`; each in a fresh process) builds the plan (planner) and the runtime from it (offload), fills
the KV cache to the context (constant values: attention's speed does not depend on them; the
prefill path has its own benchmark), times decode steps, and prints tokens/s beside the bound
max(weight bytes / HBM, host KV bytes / DRAM) per step, the engine's own timers (GPU segments,
CPU attention, transfers) for the overlap check, and the planner's prediction beside the
measurement. GPU memory is fenced to each workload's --gpu-mem.
"""
from __future__ import annotations

import argparse
import json
import os
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts
import torch  # noqa: E402

from cpu_attention import KVDtype  # noqa: E402
from hetero.config import LLAMA3_8B  # noqa: E402
from offload.build import fence_gpu_memory, runtime_from_plan  # noqa: E402
from planner.plan import Budget, Overrides, Workload  # noqa: E402
from planner.profile import HardwareProfile, measure  # noqa: E402
from planner.search import plan as make_plan  # noqa: E402
from planner.tensors import Kind  # noqa: E402

GiB = 2**30
log = logging.getLogger("bench")

# (name, context, batch, host KV dtype, --gpu-mem GiB, device-tier tokens per seq: 0 = all host, None = planner
#  [, sub-batches: None = planner])
WORKLOADS = [  # name, context, batch, host KV dtype, --gpu-mem GiB, GPU-tier tokens, sub-batches, streamed tokens
    ("8k bf16", 8192, 1, "bf16", 6, 0, None, None),
    ("8k int8", 8192, 1, "int8", 6, 0, None, None),
    ("32k bf16", 32768, 1, "bf16", 6, 0, None, None),
    ("32k int8", 32768, 1, "int8", 6, 0, None, None),
    ("32k int4", 32768, 1, "int4", 6, 0, None, None),
    ("8k bf16 cpu-only attn", 8192, 1, "bf16", 6, 0, None, 0),
    ("32k int8 cpu-only attn", 32768, 1, "int8", 6, 0, None, 0),
    ("32x2k bf16", 2048, 32, "bf16", 6, 0, None, None),
    ("32x2k bf16 2sb", 2048, 32, "bf16", 6, 0, 2, None),
    ("64k bf16 all-host", 65536, 1, "bf16", 12, 0, None, 0),
    ("64k bf16 split", 65536, 1, "bf16", 12, None, None, None),
]


def fill(cache, seqs: list[int], ctx: int) -> None:
    """Reserve ctx tokens per sequence and fill both pools with constants (what values, does not matter)."""
    for s in seqs:
        cache.reserve(s, ctx)
    for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
        t = getattr(cache.host, name)
        if t is not None:
            t.fill_(1 if t.dtype in (torch.int8, torch.uint8) else 0.01)
    if cache.gpu is not None:
        cache.gpu.k.fill_(0.01)
        cache.gpu.v.fill_(0.01)


def run_workload(model, prof, name, ctx, batch, kv, gpu_mem, gpu_tokens, steps, sub_batches=None,
                 stream_tokens=None, block_size=None) -> dict:
    torch.cuda.reset_peak_memory_stats()
    budget = Budget(gpu_bytes=gpu_mem * GiB, host_bytes=int(prof.host_available_bytes * 0.8))
    wl = Workload(ctx_size=ctx + steps + 8, batch=batch, prompt_tokens=ctx, gen_tokens=steps + 8)
    ov = Overrides(kv_dtype=KVDtype(kv), gpu_kv_tokens=gpu_tokens, threads=prof.physical_cores, sub_batches=sub_batches,
                   stream_tokens=stream_tokens, block_size=block_size)
    plan = make_plan(LLAMA3_8B, prof, budget, wl, ov)
    # do what the plan says with the embedding table (the planner may keep it on the host)
    model.embed_w = model.embed_w.to(model.device if plan.placement(-1, Kind.EMBED).on_gpu else "cpu")
    torch.cuda.empty_cache()  # building the model left cached blocks the fence would count
    fence_gpu_memory(budget.gpu_bytes, model.device)
    runner = runtime_from_plan(model, plan, detailed_timing=True)
    cache = runner.cache
    seqs = list(range(batch))
    fill(cache, seqs, ctx)
    toks, pos = [1] * batch, [ctx] * batch
    for _ in range(3):  # warm-up: JIT, allocator, Triton autotune
        runner.decode(seqs, toks, pos)
        pos = [p + 1 for p in pos]
    times, parts = [], []
    for _ in range(steps):
        t = time.perf_counter()
        runner.decode(seqs, toks, pos)
        times.append(time.perf_counter() - t)
        parts.append(runner.metrics.last)
        pos = [p + 1 for p in pos]
    step = statistics.median(times)
    gpu_t = statistics.median(p.gpu for p in parts)
    cpu_t = statistics.median(p.cpu_attention for p in parts)
    xfer = statistics.median(p.transfer for p in parts)
    g_tok, h_tok = cache.tier_tokens()
    streamed = len(runner.streamer.blocks) * cache.block_size if runner.streamer is not None else 0
    host_kv_bytes = h_tok * cache.host.bytes_per_token
    cpu_kv_bytes = (h_tok - streamed) * cache.host.bytes_per_token  # what the CPU kernels read
    gpu_kv_bytes = g_tok * LLAMA3_8B.kv_bytes_per_token(2.0)
    weight_bytes = model_bytes(model)
    # Bound per step: the weights (and the device tier's KV) once over HBM, the host KV once over DRAM.
    bound_s = max((weight_bytes + gpu_kv_bytes) / (prof.hbm_gbps * 1e9), host_kv_bytes / (prof.dram_read_gbps * 1e9))
    peak = torch.cuda.max_memory_allocated(model.device)
    out = dict(
        name=name, ctx=ctx, batch=batch, kv=kv, gpu_mem_gib=gpu_mem, sub_batches=runner._split(seqs).__len__(),
        gpu_kv_tokens=g_tok, host_kv_tokens=h_tok, step_ms=step * 1e3, tok_s=batch / step,
        bound_tok_s=batch / bound_s, gpu_ms=gpu_t * 1e3, cpu_attn_ms=cpu_t * 1e3, transfer_ms=xfer * 1e3,
        overlap_ratio=step / (max(gpu_t, cpu_t) + xfer),
        # the busiest resource alone (the copies run on their own stream, beside both devices)
        busiest_ratio=step / max(gpu_t, cpu_t, xfer), host_kv_gb=host_kv_bytes / 1e9,
        cpu_attn_gbps=cpu_kv_bytes / cpu_t / 1e9 if cpu_t else 0.0, streamed_tokens=streamed,
        predicted_tok_s=plan.prediction.decode_tok_s, bottleneck=plan.prediction.bottleneck,
        plan=f"{plan.kv.gpu_tokens} GPU / {plan.kv.host_tokens} host tokens per seq "
             f"({plan.kv.stream_tokens} streamed), block {plan.kv.block_size}, embed on "
             f"{'GPU' if plan.placement(-1, Kind.EMBED).on_gpu else 'CPU'}, sub-batches {plan.sub_batches}",
        peak_gpu_gib=peak / GiB, within_budget=peak <= budget.gpu_bytes,
    )
    runner.close()
    return out


def model_bytes(model) -> int:
    n = model.lm_head.nbytes  # a decode step reads one embedding row, not the table
    for lw in model.layers:
        n += lw.qkv.nbytes + lw.o.nbytes + lw.gate_up.nbytes + lw.down.nbytes
    return n


def workload(name: str) -> tuple:
    """A WORKLOADS row by name, plus its block size (None: the planner's); 'NAME bN' is NAME in
    blocks of N tokens, 'NAME sN' is NAME with N streamed tokens (either, or bN then sN)."""
    base, _, n = name.rpartition(" s")
    if base and n.isdigit():
        row = workload(base)
        return (name, *row[1:7], int(n), row[8])
    base, _, n = name.rpartition(" b")
    if base and n.isdigit():
        return (name, *workload(base)[1:8], int(n))
    return (*next(w for w in WORKLOADS if w[0] == name), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated workload names; a name + ' s<N>' (e.g. '8k bf16 s3072')"
                    " runs that workload with N streamed tokens, + ' b<N>' in blocks of N tokens")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # child: run this workload, print its row
    ap.add_argument("--profile", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.FileHandler(args.out / "offload_decode.log"), logging.StreamHandler()])
    if args.one:  # one workload in a fresh process: nothing left over from another's allocations
        from bench.gpu_decode import build_model  # the random NF4 model, built on the GPU

        prof = HardwareProfile.from_json(args.profile.read_text())
        name, ctx, batch, kv, mem, gpu_tok, sb, stream, block = workload(args.one)
        model = build_model(LLAMA3_8B)
        row = run_workload(model, prof, name, ctx, batch, kv, mem, gpu_tok, steps=8 if args.quick else 24,
                           sub_batches=sb, stream_tokens=stream, block_size=block)
        print("ROW " + json.dumps(row))
        return
    t = time.perf_counter()
    prof = HardwareProfile.from_json(args.profile.read_text()) if args.profile else measure(quick=args.quick)
    log.info("hardware profile took %.1f s%s", time.perf_counter() - t, " (loaded)" if args.profile else "")
    (args.out / "profile.json").write_text(prof.to_json())
    log.info("profile: %s", json.dumps(prof.to_dict()))
    rows = []
    for name in args.only.split(",") if args.only else [w[0] for w in WORKLOADS]:
        cmd = [sys.executable, "-m", "bench.offload_decode", "--one", name, "--profile", str(args.out / "profile.json"),
               "--out", str(args.out)]
        r = subprocess.run(cmd + (["--quick"] if args.quick else []), capture_output=True, text=True)
        found = [ln[4:] for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
        row = json.loads(found[0]) if found else dict(name=name, error=(r.stderr or r.stdout)[-400:])
        log.info("%s", json.dumps(row))
        rows.append(row)
    (args.out / "offload_decode.json").write_text(json.dumps(dict(profile=prof.to_dict(), rows=rows), indent=1))
    print(f"\nHBM {prof.hbm_gbps:.0f} GB/s (copy, r+w) · DRAM read {prof.dram_read_gbps:.1f} GB/s · "
          f"PCIe h2d {prof.pcie_h2d_gbps:.1f} / d2h {prof.pcie_d2h_gbps:.1f} GB/s · {prof.physical_cores} cores")
    print(f"{'workload':24} {'tok/s':>7} {'bound':>7} {'pred':>7} {'step ms':>8} {'gpu':>6} {'cpu':>6} {'xfer':>5} "
          f"{'ovl':>5} {'busy':>5} {'KV GB/s':>7} {'GPU GiB':>7} {'streamed':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:24} ERROR {r['error'][-200:]}")
            continue
        print(f"{r['name']:24} {r['tok_s']:7.1f} {r['bound_tok_s']:7.1f} {r['predicted_tok_s']:7.1f} {r['step_ms']:8.2f} "
              f"{r['gpu_ms']:6.2f} {r['cpu_attn_ms']:6.2f} {r['transfer_ms']:5.2f} {r['overlap_ratio']:5.2f} "
              f"{r.get('busiest_ratio', 0):5.2f} {r['cpu_attn_gbps']:7.1f} {r['peak_gpu_gib']:7.2f} {r['streamed_tokens']:8d}")


if __name__ == "__main__":
    main()
