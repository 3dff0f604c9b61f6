"""NF4 matrix-vector kernels at decode shapes: check against the dequantized reference, then time.

    python3 -m bench.nf4_gemv --out DIR [--rows 1,2,4,8] [--sweep] [--step]

First a correctness pass (odd shapes, 1/3/8 rows, split-K and not), then per Llama-3-8B linear
shape and row count: bitsandbytes, the Triton one-row kernel (`gpu_ops.nf4_triton`), the Triton
GEMV `gpu_ops.nf4_gemv` (with --sweep several tile shapes at 1 row) and the tensor-core GEMV
`gpu_ops.nf4_tc` (with --sweep several block shapes), and the latter over the linear 4-bit format
of `gpu_ops.q4` (same bytes, the "q4" column), µs a call inside a CUDA graph with copies
rotated so that L2 does not serve them, and GB/s of NF4 bytes (+ x and y). --step adds the
graphed batch-1 decode step of the whole model: bitsandbytes, the Triton GEMV with this run's
best tiles, the tensor-core GEMV, and the model in the linear q4 format. Full JSON and log under DIR; a short table last.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import time
from pathlib import Path

import torch

from bench.gpu_decode import build_model, decode_case, graph_ms, hbm_gbps, linears, set_kernel
from gpu_ops import nf4_tc
from gpu_ops.attention import AttnKernel
from gpu_ops.nf4 import Nf4Kernel, dequantize_nf4, nf4_linear
from gpu_ops.nf4_gemv import Decode, gemv_config, nf4_gemv
from gpu_ops.nf4_triton import nf4_gemv as old_gemv
from gpu_ops.q4 import quantize_q4
from hetero.config import LLAMA3_8B

log = logging.getLogger("bench")
DEV = torch.device("cuda")
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
# (BLOCK_N, H, warps, split-K) tried at 1 row with --sweep, beside the default (gemv_config); the
# first list on the narrow shapes, the second on the wide ones; shapes K does not divide are skipped
SWEEP = [(4, 128, 8, 1), (2, 128, 4, 1), (8, 128, 8, 1), (4, 64, 4, 1), (8, 64, 8, 1), (4, 64, 4, 7), (4, 32, 4, 1),
         (16, 16, 4, 1), (8, 16, 2, 1)]
SWEEP_WIDE = [(4, 128, 8, 1), (8, 64, 8, 1), (16, 16, 4, 1)]
TC_SWEEP = [nf4_tc.TcConfig(1, 8, 1), nf4_tc.TcConfig(1, 8, 2), nf4_tc.TcConfig(2, 2, 4), nf4_tc.TcConfig(1, 4, 4),
            nf4_tc.TcConfig(4, 2, 2), nf4_tc.TcConfig(2, 4, 2)]


def check(decodes: list[Decode]) -> list[dict]:
    """‖y − ref‖/‖ref‖ against x·W_deqᵀ in float64, fresh random inputs each case."""
    out = []
    cases = [((384, 1024), None), ((1000, 832), None), ((4096, 1024), (16, 16, 4, 1))]
    for (n, k), cfg in cases:
        w = torch.randn(n, k, device=DEV) * 0.02
        lin = nf4_linear(w, None, DEV)
        ref_w = dequantize_nf4(lin.packed, lin.absmax, (n, k)).double()
        for m in (1, 3, 8):
            x = torch.randn(m, k, device=DEV).bfloat16()
            ref = x.double() @ ref_w.T
            runs = [(d.name, lambda d=d: nf4_gemv(x, lin.packed, lin.absmax, (n, k), d, cfg or gemv_config(n, k, 132)))
                    for d in decodes]
            runs.append(("TC", lambda: nf4_tc.nf4_tc_gemv(x, lin.packed, lin.absmax, (n, k))))
            for name, fn in runs:
                y = fn()
                torch.cuda.synchronize()
                err = float((y.double() - ref).norm() / ref.norm())
                ok = y.shape == (m, n) and bool(torch.isfinite(y).all()) and err < 1e-2
                out.append({"N": n, "K": k, "rows": m, "decode": name, "config": cfg or gemv_config(n, k, 132),
                            "rel_err": err, "ok": ok})
                log.info("check %s", json.dumps(out[-1]))
    return out


def _time(fn_of_copy, copies) -> float:
    it = iter(range(1 << 30))
    return 1e3 * graph_ms(lambda: fn_of_copy(copies[next(it) % len(copies)]), calls=len(copies) * 4)


def shape_table(rows_list: list[int], decodes: list[Decode], sweep: bool, save=lambda rows: None) -> list[dict]:
    res = []
    for name, (n, k) in SHAPES.items():
        copies = [nf4_linear(torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02, None, DEV)
                  for _ in range(max(1, min(8, -(-200_000_000 // (n * k // 2)))))]
        q4s = [quantize_q4(c.dequantize(torch.bfloat16)) for c in copies]  # the linear 4-bit format, same weights
        for m in rows_list:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            nbytes = copies[0].nbytes + 2 * m * (k + n)
            row = {"shape": name, "N": n, "K": k, "rows": m, "bytes": nbytes}
            for c in copies:
                c.kernel = Nf4Kernel.BNB
            row["bnb_us"] = _time(lambda c: c(x), copies)
            if m == 1:
                row["old_us"] = _time(lambda c: old_gemv(x, c.packed, c.absmax, (n, k)), copies)
            configs = [None] + ([c for c in (SWEEP if n < 16384 else SWEEP_WIDE) if k % (32 * c[1] * c[3]) == 0]
                                if sweep and m == 1 else [])
            for d in decodes:
                for cfg in configs:
                    key = f"{d.name.lower()}_{'default' if cfg is None else '%dx%dw%ds%d' % cfg}_us"
                    cfg = cfg or gemv_config(n, k, 132)  # a config keeps nf4_gemv on its Triton kernel
                    try:
                        row[key] = _time(lambda c: nf4_gemv(x, c.packed, c.absmax, (n, k), d, cfg), copies)
                    except Exception as e:  # noqa: BLE001  a benchmark reports what failed and goes on
                        log.warning("%s %s rows %d %s failed: %r", name, d.name, m, cfg, e)
            for tc in [None] + (TC_SWEEP if sweep else []):
                key = "tc_default_us" if tc is None else f"tc_{tc.wr}x{tc.wk}u{tc.u}_us"
                try:
                    row[key] = _time(lambda c: nf4_tc.nf4_tc_gemv(x, c.packed, c.absmax, (n, k), config=tc), copies)
                except Exception as e:  # noqa: BLE001
                    log.warning("%s tc rows %d %s failed: %r", name, m, tc, e)
            try:
                row["q4_us"] = _time(lambda c: nf4_tc.q4_tc_gemv(x, c[0], c[1], (n, k)), q4s)
            except Exception as e:  # noqa: BLE001
                log.warning("%s q4 rows %d failed: %r", name, m, e)
            tri = {kk: v for kk, v in row.items() if kk.endswith("_us") and kk.split("_")[0] in ("prmt", "gather")}
            if tri:
                row["triton_best"] = min(tri, key=tri.get)
                row["triton_us"] = tri[row["triton_best"]]
            ours = {kk: v for kk, v in row.items() if kk.endswith("_us") and kk.split("_")[0] in ("prmt", "gather", "tc")}
            if ours:
                row["best"] = min(ours, key=ours.get)
                row["best_us"] = ours[row["best"]]
            res.append(row)
            save(res)
            log.info("linear %s", json.dumps(row))
        del copies, q4s
        torch.cuda.empty_cache()
    return res


def best_configs(rows: list[dict]) -> dict[tuple[int, int], tuple[int, int, int, int] | None]:
    """(N, K) → the fastest nf4_gemv tile config measured at 1 row (None: the default)."""
    out = {}
    for r in rows:
        if r["rows"] == 1 and "triton_best" in r:
            tag = r["triton_best"].split("_")[1]
            out[(r["N"], r["K"])] = None if tag == "default" else tuple(int(v) for v in re.findall(r"\d+", tag))
    return out


def step_cases(hbm: float, configs: dict) -> list[dict]:
    """Graphed batch-1 decode of the whole model (ctx 128): bitsandbytes vs nf4_gemv linears, the
    latter with each shape's best tile config of this run."""
    model = build_model(LLAMA3_8B)
    out = []
    for kern, tc in ((Nf4Kernel.BNB, False), (Nf4Kernel.GEMV, False), (Nf4Kernel.GEMV, True)):
        set_kernel(model, kern)
        nf4_tc.use(tc)
        for lin in linears(model):  # Triton with this run's best tiles, or the tensor-core kernel's defaults
            lin.gemv_config = None if tc else configs.get(lin.shape) or gemv_config(*lin.shape, 132)
        c = decode_case(model, 1, 128, 32, AttnKernel.AUTO, hbm, graphs=True)
        c["linear"] = "tc" if tc else kern.value
        out.append(c)
        log.info("decode %s", json.dumps(c))
    nf4_tc.use(True)
    del model
    torch.cuda.empty_cache()
    try:  # the same step over the linear 4-bit format (--weights q4)
        c = decode_case(build_model(LLAMA3_8B, q4=True), 1, 128, 32, AttnKernel.AUTO, hbm, graphs=True)
        c["linear"] = "q4"
        out.append(c)
        log.info("decode %s", json.dumps(c))
    except Exception as e:  # noqa: BLE001  a benchmark reports what failed and goes on
        log.warning("the q4 step failed: %r", e)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--decode", default="prmt")
    ap.add_argument("--sweep", action="store_true", help="try the SWEEP tile shapes at 1 row")
    ap.add_argument("--step", action="store_true", help="also the whole-model batch-1 decode step")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.FileHandler(args.out / "nf4_gemv.log"), logging.StreamHandler()])
    decodes = [Decode[d.upper()] for d in args.decode.split(",")]
    t0 = time.perf_counter()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["hbm_gbps"] = hbm = hbm_gbps()
    res["check"] = [] if args.no_check else check(decodes)
    res["check_s"] = time.perf_counter() - t0
    (args.out / "nf4_gemv.json").write_text(json.dumps(res, indent=1))
    save = lambda rows: (args.out / "nf4_gemv.json").write_text(json.dumps({**res, "linears": rows}, indent=1))  # noqa: E731
    res["linears"] = shape_table([int(r) for r in args.rows.split(",")], decodes, args.sweep, save)
    if args.step:
        res["step_configs"] = {f"{n}x{k}": c for (n, k), c in best_configs(res["linears"]).items()}
        res["decode"] = step_cases(hbm, best_configs(res["linears"]))
        (args.out / "nf4_gemv.json").write_text(json.dumps(res, indent=1))

    bad = [c for c in res["check"] if not c["ok"]]
    print(f"\n{res['device']}: HBM copy {hbm:.0f} GB/s; check: {len(res['check']) - len(bad)}/{len(res['check'])} ok, "
          f"max rel err {max([c['rel_err'] for c in res['check']], default=0):.2e}")
    for c in bad:
        print("  FAILED", c)
    print(f"{'linear':8} {'rows':>4} {'bound':>6} {'bnb µs':>7} {'triton':>7} {'tc µs':>7} {'best µs':>8} "
          f"{'triton GB/s':>11} {'best GB/s':>9} {'q4 µs':>7} {'q4 GB/s':>7}  best")
    for r in res["linears"]:
        gb = lambda us: r["bytes"] / us / 1e3 if us else 0  # noqa: E731
        print(f"{r['shape']:8} {r['rows']:>4} {r['bytes'] / hbm / 1e3:6.1f} {r['bnb_us']:7.1f} {r.get('triton_us', 0):7.1f} "
              f"{r.get('tc_default_us', 0):7.1f} {r.get('best_us', 0):8.1f} {gb(r.get('triton_us')):11.0f} "
              f"{gb(r.get('best_us')):9.0f} {r.get('q4_us', 0):7.1f} {gb(r.get('q4_us')):7.0f}  {r.get('best', '')}")
    for c in res.get("decode", []):
        print(f"decode b1 ctx128 graph lin={c['linear']:6} {c['step_ms']:6.2f} ms {c['tok_s']:7.1f} tok/s "
              f"(bound {c['bound_tok_s']:.0f})")
    if "step_configs" in res:
        print("step configs:", res["step_configs"])


if __name__ == "__main__":
    main()
