"""NF4 W4A16 tensor-core matmul (gpu_ops.nf4_mma) at decode-batch shapes: check, sweep, time.

    python3 -m bench.nf4_mma --out DIR [--rows 4,8,16,32,64] [--budget-s 170] [--workers 12] [--codes q4]

--codes q4: the linear q4 format (`gpu_ops.q4`) instead of NF4 (bitsandbytes and nf4_gemv not timed).

1. HBM read bandwidth (a streaming Triton read and torch's sum; the best is the bounds' divisor),
   and the copy rate the other benches report.
2. Every kernel variant of the grid (KERNELS × BLOCK_M × split-K or not) is compiled in
   worker processes, in parallel, and run once there on a small odd shape against the dequantized
   reference: a variant that fails to compile, faults or is wrong is reported and skipped (a
   fault there cannot poison this process's CUDA context); variants a worker did not finish
   (pool broken, timeout, --workers 0) compile in this process.
3. Per Llama-3-8B linear and row count: each variant (× split-K 1/2/4/8 for narrow W) is checked
   (‖y − x·W_deqᵀ‖/‖x·W_deqᵀ‖, float32 reference) and timed: µs a call inside a CUDA graph of
   calls rotating over weight copies (≥ 256 MB, so L2 does not serve them), median of replays;
   bitsandbytes and (≤ 8 rows) nf4_gemv the same way. Past --budget-s the remaining cases time
   only the default config.
4. Tables: per (shape, rows) the best config; per row count the decode step's linears (32 layers
   × qkv, o, gate_up, down + lm_head) in ms, best MMA vs bitsandbytes vs the bound; the CONFIGS
   dict to paste into gpu_ops/nf4_mma.py (per (N, K, BLOCK_M), the config fastest summed over the
   bucket's row counts).
Bytes a call = packed + absmax + x + y; bound = bytes / HBM read. Log, JSON and the CONFIGS text
under DIR.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import logging
import math
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from gpu_ops.nf4 import NF4Linear, Nf4Kernel, dequantize_nf4, quantize_nf4
from gpu_ops.nf4_gemv import Decode
from gpu_ops.nf4_mma import MmaConfig, Scale, mma_config, nf4_mma, row_bucket
from gpu_ops.q4 import dequantize_q4, quantize_q4

log = logging.getLogger("bench")
DEV = torch.device("cuda")
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
LAYER = ("qkv", "o", "gate_up", "down")
LAYERS = 32  # Llama-3-8B
WIDE_N = 16384  # N at or above: no split-K (enough tiles for every SM)
SPLITS = (1, 2, 4, 8)
L2_ROTATION_BYTES = 256 << 20
OK_ERR = 1e-2
# the grid: tiles, warps, stages, scale placement and orientation (split is swept per shape); the
# default of gpu_ops.nf4_mma.default_config (x·Wᵀ, 128 × 128, 8 warps, 3 stages) is in it.
# compiled for sm_90, none of these spills (256 × 256 did; 64 × 256 × 4 warps took 255 registers);
# x·Wᵀ's loops are the leanest (~5.3 SASS instructions a weight), W·xᵀ's with 4 warps serialize
# their wgmmas (A from registers)
KERNELS = [MmaConfig(128, 128, 8, 3), MmaConfig(128, 128, 8, 2), MmaConfig(128, 128, 8, 4), MmaConfig(128, 128, 4, 3),
           MmaConfig(64, 128, 4, 3), MmaConfig(256, 128, 8, 2), MmaConfig(128, 256, 8, 3),
           MmaConfig(128, 64, 8, 3), MmaConfig(128, 64, 8, 3, scale=Scale.SUM),
           MmaConfig(128, 128, 4, 3, swap=True), MmaConfig(64, 128, 4, 3, swap=True),
           MmaConfig(256, 128, 8, 2, swap=True), MmaConfig(128, 256, 8, 3, swap=True),
           MmaConfig(128, 64, 4, 3, scale=Scale.SUM, swap=True)]
# q4's decoder always scales the weights (nf4_mma runs Scale.SUM as WEIGHT)
GRID = {"nf4": KERNELS, "q4": [k for k in KERNELS if k.scale is Scale.WEIGHT]}
FORMATS = {"nf4": (quantize_nf4, Decode.PRMT), "q4": (quantize_q4, Decode.LINEAR)}  # codes → (quantize, decode)


def kernel_tag(c: MmaConfig) -> str:
    """A config's compile-time part (split is a launch argument, only split-or-not is compiled in)."""
    return f"n{c.block_n}k{c.block_k}w{c.warps}s{c.stages}{'-sum' if c.scale is Scale.SUM else ''}" \
           f"{'-swap' if c.swap else ''}"


# ---------------------------------------------------------------------------------- HBM
def _cuda_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


@triton.jit
def _read_kernel(x_ptr, out_ptr, per_prog, BLOCK: tl.constexpr):
    base = x_ptr + tl.program_id(0).to(tl.int64) * per_prog
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, per_prog, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def hbm() -> dict:
    """GB/s: read (max of a Triton streaming read and torch's sum over 2 GiB) and copy."""
    n = 1 << 29  # int32: 2 GiB
    x = torch.ones(n, dtype=torch.int32, device=DEV)
    out = {}
    progs = 2048
    part = torch.empty(progs, dtype=torch.int32, device=DEV)
    try:
        ms = _cuda_ms(lambda: _read_kernel[(progs,)](x, part, n // progs, BLOCK=4096, num_warps=8, num_stages=3), 3, 10)
        out["read_triton"] = 4 * n / ms / 1e6
    except Exception as e:  # noqa: BLE001  a benchmark reports what failed and goes on
        log.warning("triton read kernel failed: %r", e)
    out["read_torch_sum"] = 4 * n / _cuda_ms(lambda: x.sum(), 3, 10) / 1e6
    y = torch.empty_like(x)
    out["copy"] = 8 * n / _cuda_ms(lambda: y.copy_(x), 3, 10) / 1e6
    out["read"] = max(v for k, v in out.items() if k.startswith("read"))
    return out


# ---------------------------------------------------------------------------------- compile, in workers
def _variant(cfg: MmaConfig, bm: int, split: bool) -> str:
    return f"{kernel_tag(cfg)}/m{bm}/{'split' if split else 'one'}"


def dequantize(packed: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], codes: str) -> torch.Tensor:  # float32
    return dequantize_q4(packed, scales) if codes == "q4" else dequantize_nf4(packed, scales, shape)


def _compile_one(task: tuple[dict, int, bool, str]) -> dict:
    """In a worker: compile one variant by running it once on a small odd shape (N, K multiples of
    16 as the bench's are, so this process finds the binary in Triton's cache), and check it."""
    fields, bm, split, codes = task
    cfg = MmaConfig(**{**fields, "scale": Scale(fields["scale"]), "split": 2 if split else 1})
    key = _variant(cfg, bm, split)
    try:
        N, K, rows = 320, 1024, bm // 2 + 1  # rows: a BLOCK_M of bm in either orientation
        torch.manual_seed(0)
        packed, absmax = FORMATS[codes][0](torch.randn(N, K, device=DEV) * 0.02)
        x = torch.randn(rows, K, device=DEV, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        y = nf4_mma(x, packed, absmax, (N, K), cfg, decode=FORMATS[codes][1])
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        ref = x.float() @ dequantize(packed, absmax, (N, K), codes).T
        err = float((y.float() - ref).norm() / ref.norm())
        return {"variant": key, "ok": err < OK_ERR, "rel_err": err, "first_call_s": secs}
    except Exception as e:  # noqa: BLE001
        return {"variant": key, "ok": False, "error": repr(e)[-3000:]}


def precompile(rows_list: list[int], workers: int, timeout_s: float, codes: str) -> dict[str, dict]:
    tasks = [(dict(dataclasses.asdict(k), scale=int(k.scale)), bm, split, codes)
             for k in GRID[codes] for bm in sorted({k.block_m(r) for r in rows_list}) for split in (False, True)]
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    ex = cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    futs = {ex.submit(_compile_one, t): t for t in tasks}
    try:
        for f in cf.as_completed(futs, timeout=timeout_s):
            fields, bm, split, _ = futs[f]
            key = _variant(MmaConfig(**{**fields, "scale": Scale(fields["scale"])}), bm, split)
            try:
                results[key] = r = f.result()
            except Exception as e:  # noqa: BLE001  a worker died, and the pool with it: untested, not failed
                log.warning("compile %s: worker died (%r); left to the main process", key, e)
                continue
            log.info("compile %s %s", "ok  " if r["ok"] else "FAIL", json.dumps(r)[:600])
    except cf.TimeoutError:
        log.warning("precompile: %d of %d variants not done after %.0f s; the rest compile in the main process",
                    len(tasks) - len(results), len(tasks), timeout_s)
    procs = list(getattr(ex, "_processes", {}).values())
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:  # ours: a hung compile must not hold the run
        if p.is_alive():
            p.kill()
    log.info("precompile: %d variants, %d ok, %.1f s", len(results), sum(r["ok"] for r in results.values()),
             time.perf_counter() - t0)
    return results


# ---------------------------------------------------------------------------------- timing
def graph_us(call, n_copies: int, reps: int = 7) -> float:
    """µs a call: a CUDA graph of calls rotating over the copies (each at least twice), median of replays."""
    calls = max(8, 2 * n_copies)
    for i in range(n_copies):  # eager first: compile, lazy state
        call(i)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            call(i % n_copies)
    ms = _cuda_ms(g.replay, 2, reps)
    del g
    return 1e3 * ms / calls


def _reference(packed: torch.Tensor, absmax: torch.Tensor, n: int, k: int, x: torch.Tensor, codes: str) -> torch.Tensor:
    """x · W_deqᵀ in float32, W dequantized 8192 rows at a time (lm_head's float32 copy would be 2 GiB)."""
    out = []
    for n0 in range(0, n, 8192):
        n1 = min(n, n0 + 8192)
        p, a = ((slice(n0, n1),) * 2 if codes == "q4"  # q4: [N, K/8] words, [N, K/64] group words
                else (slice(n0 * k // 2, n1 * k // 2), slice(n0 * k // 64, n1 * k // 64)))
        out.append(x.float() @ dequantize(packed[p], absmax[a], (n1 - n0, k), codes).T)
    return torch.cat(out, 1)


def sweep_shape(name: str, rows_list: list[int], bad_variants: set[str], deadline: float, sms: int,
                codes: str) -> list[dict]:
    n, k = SHAPES[name]
    torch.manual_seed(n)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
    quantize, decode = FORMATS[codes]
    packed, absmax = quantize(w)
    del w
    nf4_bytes = packed.numel() * packed.element_size() + 4 * absmax.numel()
    n_copies = max(1, min(32, math.ceil(L2_ROTATION_BYTES / nf4_bytes)))
    copies = [(packed, absmax)] + [(packed.clone(), absmax.clone()) for _ in range(n_copies - 1)]
    lins = [NF4Linear(p, a, (n, k), kernel=Nf4Kernel.BNB) for p, a in copies] if codes == "nf4" else []
    splits = SPLITS if n < WIDE_N else (1,)
    out = []
    for rows in rows_list:
        x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
        ref = _reference(packed, absmax, n, k, x, codes)
        nbytes = nf4_bytes + 2 * rows * (k + n)
        row = {"shape": name, "N": n, "K": k, "rows": rows, "bucket": row_bucket(rows), "bytes": nbytes,
               "copies": n_copies, "configs": {}, "failed": {}}
        default = mma_config(n, k, rows, sms)
        cands = [default]
        if time.perf_counter() < deadline:
            cands += [dataclasses.replace(c, split=s) for c in GRID[codes] for s in splits]
        else:
            row["truncated"] = True
        seen = set()
        for cfg in cands:
            cfg = cfg.fit(k)
            if cfg in seen:
                continue
            seen.add(cfg)
            if _variant(cfg, cfg.block_m(rows), cfg.split > 1) in bad_variants:  # failed in a worker: not here
                continue
            try:
                y = nf4_mma(x, packed, absmax, (n, k), cfg, decode=decode)
                err = float((y.float() - ref).norm() / ref.norm())
                us = graph_us(lambda i: nf4_mma(x, *copies[i], (n, k), cfg, decode=decode), n_copies)
                row["configs"][cfg.tag] = {"config": dataclasses.asdict(cfg) | {"scale": cfg.scale.name},
                                           "us": us, "gbps": nbytes / us / 1e3, "rel_err": err, "ok": err < OK_ERR}
                if cfg == default:
                    row["default"] = cfg.tag
            except Exception as e:  # noqa: BLE001  a benchmark reports what failed and goes on
                row["failed"][cfg.tag] = repr(e)[-1500:]
                log.warning("%s rows %d %s failed: %r", name, rows, cfg.tag, e)
        good = {t: c for t, c in row["configs"].items() if c["ok"]}
        if good:
            row["best"] = min(good, key=lambda t: good[t]["us"])
            row["best_us"] = good[row["best"]]["us"]
        bad = [t for t, c in row["configs"].items() if not c["ok"]]
        if bad:
            log.warning("%s rows %d: wrong results (rel err ≥ %g) from %s", name, rows, OK_ERR, bad)
        try:
            if lins:
                row["bnb_us"] = graph_us(lambda i: lins[i](x), n_copies)
        except Exception as e:  # noqa: BLE001
            log.warning("bitsandbytes %s rows %d failed: %r", name, rows, e)
        if rows <= 8 and lins:
            try:
                from gpu_ops.nf4_gemv import nf4_gemv

                row["gemv_us"] = graph_us(lambda i: nf4_gemv(x, *copies[i], (n, k)), n_copies)
            except Exception as e:  # noqa: BLE001
                log.warning("nf4_gemv %s rows %d failed: %r", name, rows, e)
        log.info("linear %s", json.dumps({kk: v for kk, v in row.items() if kk != "configs"}))
        out.append(row)
    return out


# ---------------------------------------------------------------------------------- tables
def configs_text(rows: list[dict]) -> str:
    """CONFIGS for gpu_ops/nf4_mma.py: per (N, K, row bucket) the config with the least µs summed over
    the bucket's measured row counts (among those measured, correct, at every one of them)."""
    lines = ["CONFIGS: dict[tuple[int, int, int], MmaConfig] = {"]
    by_bucket: dict[tuple[int, int, int], list[dict]] = {}
    for r in rows:
        by_bucket.setdefault((r["N"], r["K"], r["bucket"]), []).append(r)
    for key, rs in sorted(by_bucket.items()):
        tags = set.intersection(*({t for t, c in r["configs"].items() if c["ok"]} for r in rs))
        if not tags:
            continue
        best = min(tags, key=lambda t: sum(r["configs"][t]["us"] for r in rs))
        c = rs[0]["configs"][best]["config"]
        us = ", ".join(f"{r['rows']}: {r['configs'][best]['us']:.1f}" for r in rs)
        extra = (", scale=Scale.SUM" if c["scale"] == "SUM" else "") + (", swap=True" if c["swap"] else "")
        lines.append(f"    # µs at rows {us}")
        lines.append(f"    {key}: MmaConfig(block_n={c['block_n']}, block_k={c['block_k']}, warps={c['warps']}, "
                     f"stages={c['stages']}, split={c['split']}{extra}),")
    lines.append("}")
    return "\n".join(lines)


def step_table(rows: list[dict], bw: float) -> list[dict]:
    """Per row count: the step's linears, 32 × (qkv + o + gate_up + down) + lm_head, in ms."""
    out = []
    for m in sorted({r["rows"] for r in rows}):
        by = {r["shape"]: r for r in rows if r["rows"] == m}
        if set(by) != set(SHAPES):
            continue
        total = lambda f: (LAYERS * sum(f(by[s]) for s in LAYER) + f(by["lm_head"])) / 1e3  # noqa: E731
        t = {"rows": m, "bound_ms": total(lambda r: r["bytes"] / bw / 1e3)}
        if all("best_us" in r for r in by.values()):
            t["mma_ms"] = total(lambda r: r["best_us"])
        if all("bnb_us" in r for r in by.values()):
            t["bnb_ms"] = total(lambda r: r["bnb_us"])
        if all("gemv_us" in r for r in by.values()):
            t["gemv_ms"] = total(lambda r: r["gemv_us"])
        out.append(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="4,8,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=170, help="sweep the grid until then; the default config after")
    ap.add_argument("--workers", type=int, default=12, help="compile processes (0: compile in this one, lazily)")
    ap.add_argument("--codes", choices=("nf4", "q4"), default="nf4", help="the 4-bit format: NF4 or the linear q4")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.FileHandler(args.out / "nf4_mma.log"), logging.StreamHandler()])
    t0 = time.perf_counter()
    rows_list = [int(r) for r in args.rows.split(",")]
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "codes": args.codes, "kernels": [kernel_tag(k) for k in GRID[args.codes]]}
    save = lambda: (args.out / "nf4_mma.json").write_text(json.dumps(res, indent=1))  # noqa: E731
    res["hbm_gbps"] = hbm()
    torch.cuda.empty_cache()
    bw = res["hbm_gbps"]["read"]
    log.info("HBM %s", json.dumps(res["hbm_gbps"]))
    bad_variants: set[str] = set()  # variants not compiled in workers (timeout, --workers 0) run here
    if args.workers:
        res["compile"] = precompile(rows_list, args.workers, timeout_s=150, codes=args.codes)
        bad_variants = {k for k, r in res["compile"].items() if not r["ok"]}
    save()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    deadline = t0 + args.budget_s
    res["linears"] = []
    for name in args.shapes.split(","):
        res["linears"] += sweep_shape(name, rows_list, bad_variants, deadline, sms, args.codes)
        torch.cuda.empty_cache()  # this shape's weight copies
        save()
    res["step"] = step_table(res["linears"], bw)
    res["configs_text"] = configs_text(res["linears"])
    (args.out / "nf4_mma_configs.txt").write_text(res["configs_text"] + "\n")
    res["wall_s"] = time.perf_counter() - t0
    save()

    h = res["hbm_gbps"]
    print(f"\n{res['device']}, triton {res['triton']}, {args.codes} codes: HBM read {bw:.0f} GB/s (copy {h['copy']:.0f}); "
          f"{res['wall_s']:.0f} s")
    if "compile" in res:
        bad: dict[str, list[str]] = {}  # error → variants: one line per distinct error
        for k, r in sorted(res["compile"].items()):
            if not r["ok"]:
                bad.setdefault(str(r.get("error", f"wrong: rel err {r.get('rel_err')}"))[-400:], []).append(k)
        print(f"variants: {sum(r['ok'] for r in res['compile'].values())}/{len(res['compile'])} compiled and correct"
              + "".join(f"\n  FAILED {len(v)} ({', '.join(v[:3])}{', ...' if len(v) > 3 else ''}): {e}"
                        for e, v in bad.items()))
    wrong = [(r["shape"], r["rows"], t) for r in res["linears"] for t, c in r["configs"].items() if not c["ok"]]
    if wrong:
        print(f"WRONG RESULTS (rel err ≥ {OK_ERR}):", wrong)
    print(f"{'linear':8} {'rows':>4} {'bound':>6} {'best µs':>8} {'GB/s':>5} {'rel err':>8} {'dflt µs':>8} "
          f"{'bnb µs':>7} {'gemv µs':>7} {'win':>4}  best config")
    for r in res["linears"]:
        b = r["configs"].get(r.get("best"), {})
        d = r["configs"].get(r.get("default"), {})
        times = {"mma": r.get("best_us"), "bnb": r.get("bnb_us"), "gemv": r.get("gemv_us")}
        win = min((v, k) for k, v in times.items() if v)[1] if any(times.values()) else "-"
        print(f"{r['shape']:8} {r['rows']:>4} {r['bytes'] / bw / 1e3:6.1f} {b.get('us', 0):8.1f} "
              f"{b.get('gbps', 0):5.0f} {b.get('rel_err', 0):8.1e} {d.get('us', 0):8.1f} {r.get('bnb_us', 0):7.1f} "
              f"{r.get('gemv_us', 0):7.1f} {win:>4}  {r.get('best', '-')}{' (truncated)' if r.get('truncated') else ''}")
    print(f"\nstep linears, ms ({LAYERS} × {' + '.join(LAYER)} + lm_head; 0: not measured on every shape):")
    print(f"{'rows':>4} {'mma':>7} {'bnb':>7} {'gemv':>7} {'bound':>7}")
    for t in res["step"]:
        print(f"{t['rows']:>4} {t.get('mma_ms', 0):7.2f} {t.get('bnb_ms', 0):7.2f} {t.get('gemv_ms', 0):7.2f} "
              f"{t['bound_ms']:7.2f}")
    wins = [t["rows"] for t in res["step"] if "mma_ms" in t and t["mma_ms"] < min(t.get("bnb_ms", 1e9), t.get("gemv_ms", 1e9))]
    print(f"rows where MMA's step sum beats bitsandbytes and nf4_gemv: {wins} (gpu_ops.nf4.MMA_AUTO_ROWS)")
    print("\n# gpu_ops/nf4_mma.py\n" + res["configs_text"])


if __name__ == "__main__":
    main()
