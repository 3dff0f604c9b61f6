"""Compile gpu_ops.nf4_mma's kernel for sm_90 without a GPU and count its main loop's SASS.

    python3 bench/nf4_mma_sass.py [--scale WEIGHT,SUM] [--block-m 16,32,64] [--dump DIR]

Triton's compiler and the ptxas/cuobjdump its wheel bundles need no device: every variant of
bench/nf4_mma.py's grid (× BLOCK_M × split-K or not) is compiled as the GPU would compile it
(same signature and divisibility as the Llama-3-8B shapes), then reported: registers, local
memory (spills), shared memory, and the loop's instructions by opcode, per decoded weight.
What it tells before any timing: that every variant compiles, which spill, and what the decode
costs (PRMT, shifts and logic per code; STS/LDSM/BAR: the decoded tile's trip through shared
memory to the wgmma operand layout), and whether ptxas serializes the wgmmas.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.nf4_mma import KERNELS  # noqa: E402
from gpu_ops.nf4_mma import MmaConfig, Scale, _nf4_mma_kernel  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TARGET = GPUTarget("cuda", 90, 32)


def compile_variant(cfg: MmaConfig, bm: int, split: bool, res: bool = False):
    part = "*fp32" if split else "*bf16"
    sig = {"x_ptr": "*bf16", "w32_ptr": "*i32", "absmax_ptr": "*fp32", "book_ptr": "*fp32", "y_ptr": "*bf16",
           "res_ptr": "*bf16", "part_ptr": part, "count_ptr": "*i32" if split else "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_rm": "i32",
           "k_per_split": "i32", "splits": "i32"}
    constexprs = {"BLOCK_N": cfg.block_n, "BLOCK_M": bm, "BLOCK_K": cfg.block_k, "SCALE": int(cfg.scale),
                  "SWAP": cfg.swap, "DECODE": 0,
                  "SPLIT": split, "RES": res, "DOT_F32": False, "PDL": True}
    sig |= {k: "constexpr" for k in constexprs}
    names = list(sig)
    div16 = [n for n in names if n.endswith("_ptr")] + ["N", "K", "stride_xm", "stride_ym", "stride_rm", "k_per_split"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=_nf4_mma_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": cfg.warps, "num_stages": cfg.stages,
                                                       "launch_pdl": True})


def sass_of(cubin: bytes) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([BIN / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([BIN / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    return usage, sass


def ptxas_advice(ptx: str) -> str:
    """ptxas's performance notes (e.g. wgmma serialized: each MMA waits for the one before)."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        log = subprocess.run([BIN / "ptxas", "-arch=sm_90a", "-v", "k.ptx", "-o", "k.cubin"], cwd=d,
                             capture_output=True, text=True).stderr
    return "wgmma serialized" if "serialized" in log else ""


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes of the longest backward-branch loop that holds the MMAs (the K loop)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    mma = [i for i, (_, t) in enumerate(ins) if "HGMMA" in t or "HMMA" in t]
    best = None
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            j = next(j for j, (a, _) in enumerate(ins) if a >= int(m.group(1), 16))
            if any(j <= h <= i for h in mma) and (best is None or i - j > best[1] - best[0]):
                best = (j, i)
    ops = collections.Counter()
    for _, text in ins[best[0]: best[1] + 1] if best else []:
        ops[re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="WEIGHT,SUM")
    ap.add_argument("--block-m", default="16,32,64", help="row buckets (x·Wᵀ always takes 64)")
    ap.add_argument("--dump", type=Path, help="write each variant's TTGIR, PTX and SASS here")
    args = ap.parse_args()
    scales = {Scale[s] for s in args.scale.split(",")}
    for cfg in (k for k in KERNELS if k.scale in scales):
        for bm in sorted({cfg.block_m(int(b)) for b in args.block_m.split(",")}):
            for split in (False, True):
                name = f"{cfg.block_n}x{cfg.block_k} w{cfg.warps} s{cfg.stages} {cfg.scale.name:6} " \
                       f"{'W·xT' if cfg.swap else 'x·WT'} m{bm:<2} {'split' if split else 'one  '}"
                try:
                    k = compile_variant(cfg, bm, split)
                except Exception as e:  # noqa: BLE001  a survey reports what failed and goes on
                    print(f"{name} FAILED: {str(e).strip().splitlines()[-1][:300]}")
                    continue
                usage, sass = sass_of(k.asm["cubin"])
                reg, local = (int(re.search(rf"{f}:(\d+)", usage).group(1)) for f in ("REG", "LOCAL"))
                ops = loop_opcodes(sass)
                per = cfg.block_n * cfg.block_k / (32 * cfg.warps)  # weights a thread decodes a step
                top = " ".join(f"{o}:{n}" for o, n in ops.most_common(12))
                print(f"{name} reg {reg:3} spill {local:4} smem {k.metadata.shared:6}  loop {sum(ops.values()):5} "
                      f"= {sum(ops.values()) / per:.2f}/weight  {ptxas_advice(k.asm['ptx']):16} {top}", flush=True)
                if args.dump:
                    args.dump.mkdir(parents=True, exist_ok=True)
                    stem = args.dump / name.replace(" ", "_").replace("__", "_")
                    for ext in ("ttgir", "ptx"):
                        stem.with_suffix(f".{ext}").write_text(k.asm[ext])
                    stem.with_suffix(".sass").write_text(sass)


if __name__ == "__main__":
    main()
