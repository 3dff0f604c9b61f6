"""All-GPU decode and prefill of a random-weight Llama-3-8B-shaped model with NF4 weights.

    python3 -m bench.gpu_decode --out DIR [--quick] [--no-compile] [--only b1]

Measures, in one run: HBM bandwidth (a large device copy, bytes read + written) and the bf16
matmul rate; per linear shape and row count, each NF4 kernel's time beside its bound (bytes
moved / HBM); then batch-1 decode at short context, batch 32 × 2k context, and a 512-token
prefill, each in tokens/s beside its bound. Full log and JSON under DIR; a short table last.
The model is built directly in GPU memory, tensor by tensor (hetero.random_weights; no checkpoint).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from gpu_ops.attention import AttnKernel
from gpu_ops.decode_step import GpuDecoder, prefill
from gpu_ops.kv_pool import GpuKVPool
from gpu_ops.nf4 import NF4Linear, Nf4Kernel, nf4_linear
from gpu_ops.nf4_triton import nf4_gemv
from hetero.config import LLAMA3_8B, ModelConfig
from hetero.model import Model
from offload.loader import kernels_for

log = logging.getLogger("bench")
DEV = torch.device("cuda")


def cuda_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of fn() by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn, calls: int = 20, reps: int = 10) -> float:
    """Median milliseconds of one fn() call, from replays of a graph of `calls` calls (no launch gaps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return cuda_ms(g.replay, 2, reps) / calls


def hbm_gbps() -> float:
    x = torch.randn(1 << 29, device=DEV)  # 2 GiB
    y = torch.empty_like(x)
    ms = cuda_ms(lambda: y.copy_(x), 3, 20)
    return 2 * x.numel() * 4 / ms / 1e6


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = cuda_ms(lambda: a @ b, 3, 10)
    return 2 * 8192**3 / ms / 1e9


def random_nf4(n: int, k: int) -> NF4Linear:
    return nf4_linear(torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02, None, DEV)


def build_model(cfg: ModelConfig, q4: bool = False) -> Model:
    """Random 4-bit weights of cfg's shapes (NF4, or the linear q4), made on the GPU tensor by tensor
    (hetero.random_weights, read by the engine's own loader)."""
    from offload.loader import WeightFormat, load_model
    from hetero.random_weights import RandomCheckpoint

    return load_model(RandomCheckpoint(cfg, DEV), WeightFormat.Q4 if q4 else WeightFormat.NF4, DEV)


def linears(model: Model) -> list[NF4Linear]:
    out = [model.lm_head]
    for lw in model.layers:
        out += [lw.qkv, lw.o, lw.gate_up, lw.down]
    return out


def set_kernel(model: Model, kernel: Nf4Kernel) -> None:
    for lin in linears(model):
        lin.kernel = kernel


GEMV_CONFIGS = [(16, 4, 4), (16, 8, 4), (32, 8, 8), (64, 4, 8), (8, 8, 2)]


def _pa(lin: NF4Linear) -> tuple[torch.Tensor, torch.Tensor]:
    return lin.packed, lin.absmax


def shape_table(cfg: ModelConfig, hbm: float, rows_list: list[int]) -> list[dict]:
    """Each NF4 kernel per matrix shape: time vs bytes / HBM (copies rotate so L2 does not help)."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, H), "o": (H, cfg.q_size), "gate_up": (2 * F, H),
              "down": (H, F), "lm_head": (cfg.vocab_size, H)}
    rows_out = []
    for name, (n, k) in shapes.items():
        copies = [random_nf4(n, k) for _ in range(max(1, min(8, -(-200_000_000 // (n * k // 2)))))]
        for m in rows_list:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            nbytes = copies[0].nbytes + 2 * m * (k + n)
            row = {"shape": name, "N": n, "K": k, "rows": m, "bytes": nbytes, "bound_us": nbytes / hbm / 1e3}
            for kern in (Nf4Kernel.BNB, Nf4Kernel.TRITON, Nf4Kernel.GEMV):
                if kern is Nf4Kernel.TRITON and m > 64 or kern is Nf4Kernel.GEMV and m > 8:
                    continue
                for c in copies:
                    c.kernel = kern
                it = iter(range(1 << 30))
                us = 1e3 * graph_ms(lambda: copies[next(it) % len(copies)](x), calls=len(copies) * 4)
                row[f"{kern.value}_us"] = us
                row[f"{kern.value}_gbps"] = nbytes / us / 1e3
            if m == 1:  # the one-row Triton kernel's tile shapes: (rows, 64-groups, warps) a program
                for bn, g, w in GEMV_CONFIGS:
                    if k % (64 * g):
                        continue
                    it = iter(range(1 << 30))
                    us = 1e3 * graph_ms(lambda: nf4_gemv(x, *_pa(copies[next(it) % len(copies)]), (n, k), bn, g, w),
                                        calls=len(copies) * 4)
                    row[f"gemv_{bn}x{g}w{w}_us"] = us
                    if us < row["triton_us"]:
                        row["triton_us"], row["triton_gbps"], row["triton_best"] = us, nbytes / us / 1e3, f"{bn}x{g}w{w}"
            rows_out.append(row)
            log.info("linear %s", json.dumps(row))
        copies.clear()  # the weights go before the next shape's
    torch.cuda.empty_cache()
    return rows_out


def decode_case(model: Model, batch: int, ctx: int, block_size: int, attn: AttnKernel, hbm: float,
                graphs: bool = True, compile: bool = False, steps: int = 30, fused: bool = True,
                kernels: bool = False) -> dict:
    cfg = model.cfg
    model.use_kernels(*(kernels_for(model.device) if fused else (None, None)))
    mb = ctx // block_size + 1
    pool = GpuKVPool(cfg.num_layers, batch * mb, cfg.num_kv_heads, block_size, cfg.head_dim)
    for t in (pool.k, pool.v):  # random KV, filled layer by layer to bound the temporary
        for i in range(cfg.num_layers):
            t[i].normal_()
    tables = torch.arange(batch * mb, dtype=torch.int32, device=DEV).view(batch, mb)
    pos = torch.full((batch,), ctx, dtype=torch.int64, device=DEV)
    slots = tables[:, ctx // block_size].long() * block_size + ctx % block_size
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=DEV)
    dec = GpuDecoder(model, pool, max_batch=batch, max_blocks_per_seq=mb, graphs=graphs, attn=attn, compile=compile)
    step = lambda: dec.step(ids, pos, slots, tables, pos + 1)  # noqa: E731  same token again: idempotent
    t0 = time.perf_counter()
    step()  # the first call captures (and compiles)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    ms = cuda_ms(step, 3, steps)
    top = kernel_table(step) if kernels else None
    w_bytes = sum(lin.nbytes for lin in linears(model)) + batch * cfg.hidden_size * 2
    kv_bytes = batch * (ctx + 1) * cfg.kv_bytes_per_token(2.0)
    bound_ms = (w_bytes + kv_bytes) / hbm / 1e6
    dec = pool = None  # the closure above holds them: release both before empty_cache
    torch.cuda.empty_cache()
    return {"batch": batch, "ctx": ctx, "attn": attn.value, "graphs": graphs, "compile": compile, "fused": fused,
            "kernels": top, "first_call_s": first_s, "step_ms": ms,
            "tok_s": batch / ms * 1e3, "bound_tok_s": batch / bound_ms * 1e3, "weight_bytes": w_bytes,
            "kv_bytes": kv_bytes}


def kernel_table(step, reps: int = 5) -> dict:
    """GPU kernels of one step (torch.profiler over `reps` steps): count, busy µs, top names."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            per.setdefault(e.name[:70], []).append(e.device_time)
    n = sum(len(v) for v in per.values()) / reps
    busy = sum(sum(v) for v in per.values()) / reps
    top = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:14]
    return {"kernels_per_step": n, "busy_us_per_step": busy,
            "top": [(name, len(v) / reps, sum(v) / reps) for name, v in top]}


def prefill_case(model: Model, T: int, hbm: float, tflops: float, block_size: int = 32) -> dict:
    cfg = model.cfg
    nb = T // block_size + 1
    pool = GpuKVPool(cfg.num_layers, nb, cfg.num_kv_heads, block_size, cfg.head_dim)
    table = torch.arange(nb, dtype=torch.int32, device=DEV)
    ids = torch.randint(0, cfg.vocab_size, (T,), device=DEV)
    slots = torch.arange(T, device=DEV)
    run = lambda: prefill(model, pool, ids, 0, slots, table)  # noqa: E731
    ms = cuda_ms(run, 2, 5)
    graph = graph_ms(run, calls=1, reps=5)  # one chunk's shapes are static: a graph removes Python's share
    params = sum(lin.out_features * lin.in_features for lin in linears(model))
    flops = 2 * params * T
    bytes_ = sum(lin.nbytes for lin in linears(model)) + T * cfg.kv_bytes_per_token(2.0)
    bound_ms = max(flops / tflops / 1e9, bytes_ / hbm / 1e6)
    pool = None  # the closure above holds it
    torch.cuda.empty_cache()
    return {"tokens": T, "ms": ms, "tok_s": T / ms * 1e3, "graph_ms": graph, "graph_tok_s": T / graph * 1e3,
            "bound_tok_s": T / bound_ms * 1e3,
            "flops": flops, "bytes": bytes_, "compute_bound_ms": flops / tflops / 1e9,
            "memory_bound_ms": bytes_ / hbm / 1e6}


def case_name(batch, ctx, linear, attn, graphs, compile, fused) -> str:
    return (f"decode b{batch} ctx{ctx} lin={linear} attn={attn}{'' if graphs else ' eager'}"
            f"{' compiled' if compile else ''}{'' if fused else ' unfused'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="4 layers: a smoke run, figures not comparable")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd decode cases")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no compiled case after this many seconds")
    ap.add_argument("--only", default="", help="comma-separated decode case names to run (see the table), e.g. 'b1'"
                    " for every batch-1 case; prefill and the per-linear table are skipped when set")
    args = ap.parse_args()
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.FileHandler(args.out / "gpu_decode.log"), logging.StreamHandler()])
    cfg = LLAMA3_8B
    if args.quick:
        from dataclasses import replace
        cfg = replace(cfg, num_layers=4)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": cfg.name,
                 "layers": cfg.num_layers}
    res["hbm_gbps"] = hbm = hbm_gbps()
    res["matmul_tflops"] = tflops = matmul_tflops()
    log.info("HBM copy %.0f GB/s, bf16 matmul %.0f TFLOP/s", hbm, tflops)
    res["linears"] = [] if args.only else shape_table(cfg, hbm, [1, 32, 512])
    t0 = time.perf_counter()
    model = build_model(cfg)
    torch.cuda.synchronize()
    res["build_s"] = time.perf_counter() - t0
    res["weight_gib"] = sum(lin.nbytes for lin in linears(model)) / 2**30
    log.info("model built in %.1f s: NF4 linears %.2f GiB", res["build_s"], res["weight_gib"])
    res["decode"] = cases = []
    out_json = args.out / "gpu_decode.json"
    A = AttnKernel.AUTO
    plan = [  # (linear kernel, batch, ctx, attention, graphs, compile, fused); compiled cases last (slow to build)
        (Nf4Kernel.AUTO, 1, 128, A, True, False, True),  # AUTO: our GEMV at ≤ 2 rows (fused layer)
        (Nf4Kernel.AUTO, 1, 128, A, True, False, False),  # the same without gpu_ops.fused: torch's ops
        (Nf4Kernel.BNB, 1, 128, A, True, False, True),
        (Nf4Kernel.AUTO, 1, 128, A, False, False, True),
        (Nf4Kernel.TRITON, 1, 128, A, True, False, True),
        (Nf4Kernel.AUTO, 32, 2048, A, True, False, True),  # AUTO: nf4_mma in its row range
        (Nf4Kernel.BNB, 32, 2048, A, True, False, True),
        (Nf4Kernel.TRITON, 32, 2048, A, True, False, True),
        (Nf4Kernel.AUTO, 32, 2048, AttnKernel.TORCH, True, False, True),
    ]
    if not args.no_compile:
        plan += [(Nf4Kernel.AUTO, 1, 128, A, True, True, True), (Nf4Kernel.AUTO, 1, 128, A, True, True, False),
                 (Nf4Kernel.AUTO, 32, 2048, A, True, True, True)]
    if args.only:
        keep = set(args.only.split(","))
        plan = [c for c in plan if case_name(c[1], c[2], c[0].value, c[3].value, c[4], c[5], c[6]) in keep
                or f"b{c[1]}" in keep]
    else:
        res["prefill"] = prefill_case(model, 512, hbm, tflops)
        log.info("prefill %s", json.dumps(res["prefill"]))
    out_json.write_text(json.dumps(res, indent=1))
    for kern, batch, ctx, attn, graphs, comp, fused in plan:
        if comp and time.perf_counter() - started > args.budget_s:
            log.info("skipping compiled b%d: past --budget-s", batch)
            continue
        set_kernel(model, kern)
        try:
            c = decode_case(model, batch, ctx, 32, attn, hbm, graphs, comp, fused=fused,
                            kernels=batch == 1 and graphs and not comp)
        except Exception as e:  # noqa: BLE001  a benchmark reports what failed and goes on
            log.exception("decode case failed")
            c = {"batch": batch, "ctx": ctx, "attn": attn.value, "graphs": graphs, "compile": comp, "fused": fused,
                 "error": repr(e)}
        c["linear"] = kern.value
        cases.append(c)
        log.info("decode %s", json.dumps(c))
        out_json.write_text(json.dumps(res, indent=1))

    print(f"\n{res['device']}: HBM {hbm:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s, NF4 weights {res['weight_gib']:.2f} GiB")
    print(f"{'linear':8} {'N×K':>13} {'rows':>4} {'bound µs':>9} {'bnb µs':>8} {'triton µs':>9} {'gemv µs':>8} "
          f"{'bnb GB/s':>8} {'tri GB/s':>8} {'gemv GB/s':>9}")
    for r in res["linears"]:
        print(f"{r['shape']:8} {r['N']:>6}×{r['K']:<6} {r['rows']:>4} {r['bound_us']:9.1f} {r.get('bnb_us', 0):8.1f} "
              f"{r.get('triton_us', 0):9.1f} {r.get('gemv_us', 0):8.1f} {r.get('bnb_gbps', 0):8.0f} "
              f"{r.get('triton_gbps', 0):8.0f} {r.get('gemv_gbps', 0):9.0f}")
    print(f"{'case':44} {'tok/s':>8} {'bound':>8} {'% bound':>7}")
    for c in cases:
        name = case_name(c["batch"], c["ctx"], c["linear"], c["attn"], c["graphs"], c["compile"], c["fused"])
        if "error" in c:
            print(f"{name:44} FAILED {c['error'][:60]}")
        else:
            print(f"{name:44} {c['tok_s']:8.0f} {c['bound_tok_s']:8.0f} {100 * c['tok_s'] / c['bound_tok_s']:6.0f}%")
    for c in cases:
        k = c.get("kernels")
        if k:
            print(f"\n{case_name(c['batch'], c['ctx'], c['linear'], c['attn'], c['graphs'], c['compile'], c['fused'])}: "
                  f"{k['kernels_per_step']:.0f} kernels a step, busy {k['busy_us_per_step']:.0f} µs of "
                  f"{1e3 * c['step_ms']:.0f}")
            for name, n, us in k["top"]:
                print(f"  {us:8.1f} µs {n:6.0f}×  {name}")
    if "prefill" not in res:
        return
    p = res["prefill"]
    print(f"{'prefill 512 eager':44} {p['tok_s']:8.0f} {p['bound_tok_s']:8.0f} {100 * p['tok_s'] / p['bound_tok_s']:6.0f}%")
    print(f"{'prefill 512 CUDA graph':44} {p['graph_tok_s']:8.0f} {p['bound_tok_s']:8.0f} "
          f"{100 * p['graph_tok_s'] / p['bound_tok_s']:6.0f}%")


if __name__ == "__main__":
    main()
