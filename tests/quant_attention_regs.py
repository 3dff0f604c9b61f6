"""Compile gpu_ops.attention_quant's kernels for sm_90 without a GPU and print ptxas's registers,
spills and shared memory per shape: a compile check, and the number that decides how many
programs an SM holds (65536 registers / (128 threads × registers); the bf16 kernel takes 72-80),
for one row a sequence and runs of 4 and 8.

    pip install --target /tmp/tritonlib triton
    PYTHONPATH=/tmp/tritonlib:. python3 tests/quant_attention_regs.py

Uses the ptxas Triton ships (its newest, the one Triton itself runs). Not collected by pytest.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gpu_ops import attention_quant as aq

PTRS8 = dict(q_ptr="*bf16", k_ptr="*i8", v_ptr="*i8", ks_ptr="*fp32", vs_ptr="*fp32", tk_ptr="*bf16", tv_ptr="*bf16",
             tob_ptr="*i32", rot_ptr="*i8", bt_ptr="*i32", len_ptr="*i32", run_ptr="*i32", o_ptr="*fp32",
             lse_ptr="*fp32")
PTRS4 = dict(PTRS8, k_ptr="*u8", v_ptr="*u8", ks_ptr="*bf16", kz_ptr="*bf16", vs_ptr="*bf16", vz_ptr="*bf16")


def ptxas_report(fn, ptrs: dict, consts: dict, warps: int = 4, stages: int = 2) -> str:
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in ("scale", "inv_sqrt") else "i32")
           for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(cc.asm["ptx"])
        r = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", path, "-o", path + ".o"], capture_output=True, text=True)
    info = [ln.split("info    :")[-1].strip() for ln in (r.stderr + r.stdout).splitlines() if "Used" in ln or "spill" in ln]
    return f"smem {cc.metadata.shared} B; " + "; ".join(info)


def main() -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for bits, D, BS, G, rows in itertools.product((8, 4), (64, 128), (16, 32), (1, 4, 8), (1, 4, 8)):
        fn, ptrs = (aq._int8_kernel, PTRS8) if bits == 8 else (aq._int4_kernel, PTRS4)
        consts = dict(G=G, GP=max(16, triton.next_power_of_2(G * rows)), BS=BS, D=D, RC=min(32, D), DT=tl.bfloat16,
                      DOT_F32=False, PDL=True, RUNS=rows > 1)
        print(f"int{bits} D {D} BS {BS} G {G} run rows {rows}: {ptxas_report(fn, ptrs, consts)}", flush=True)


if __name__ == "__main__":
    main()
