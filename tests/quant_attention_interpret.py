"""gpu_ops.attention_quant under Triton's CPU interpreter (no GPU): small shapes, every code path.

    pip install --target /tmp/tritonlib triton
    PYTHONPATH=/tmp/tritonlib:. TRITON_INTERPRET=1 python3 tests/quant_attention_interpret.py [--quick]

Two passes. float32: the kernels with float32 dots (dot_f32: DT float32, `_rot_dot` one ieee
product) against float64 and the twin to 2e-5: the byte addressing of every layout (int8 and
int4 keys and values, scales, zeros, tails, layers), the rotations, the int4 scale
expansion, masks, empty sequences, splits and their merge. bf16: the path the GPU runs (bf16
operands, `_rot_dot`'s hi/lo halves) within the gpu tests' bounds; the interpreter multiplies a
bf16 dot's raw bits and casts ints and float32 to bf16 wrongly (bits, truncation), so this pass
patches those two builder methods (`_interpreter_bf16`) to do what the GPU does.
Not checked here: compilation for a GPU, PDL, speed (the `gpu` tests and bench/gpu_kv_attention.py).
"""
from __future__ import annotations

import itertools
import math
import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from cpu_attention.layout import KVDtype  # noqa: E402
from gpu_ops.attention import decode_attention_torch, quant_shapes_ok  # noqa: E402
from gpu_ops.attention_quant import paged_decode_quant  # noqa: E402
# tests/ is sys.path[0] when this file runs as a script
from test_gpu_quant_attention import TRITON_TOL, as_runs, check_against_references, make_case, rel  # noqa: E402

TOL = 2e-5  # float32 dots against float64 / the float32 twin over the same bytes
BF16_LSE_TOL = 2e-2  # bf16 q in the scores: the gpu tests' bound


def _interpreter_bf16() -> None:
    """Casts to bf16 round to nearest even from float32 and ints (the interpreter truncates floats
    and stores an int's value as bits); a dot of bf16 operands multiplies their values, not bits."""
    B = interpreter.InterpreterBuilder
    cast, dot = B.cast_impl, B.create_dot

    def cast_rne(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and (src.dtype.scalar == tl.float32 or src.dtype.scalar.is_int()):
            x = torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float32))
            return interpreter.TensorHandle(x.bfloat16().view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    def as_f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    B.cast_impl = cast_rne
    B.create_dot = lambda self, a, b, d, *args: dot(self, as_f32(a), as_f32(b), d, *args)


def main() -> int:
    quick = "--quick" in sys.argv
    t0 = time.time()
    fails, runs = run(quick, bf16=False)
    _interpreter_bf16()
    f, r = run(True, bf16=True)
    print(f"{runs + r - fails - f}/{runs + r} passed in {time.time() - t0:.0f} s")
    return 1 if fails + f else 0


def run(quick: bool, bf16: bool) -> tuple[int, int]:
    fails = runs = 0
    shapes = [(32, 16), (64, 16), (64, 32), (16, 16), (128, 16)]
    groups = [1, 3, 8]
    for kv, (D, BS), G in itertools.product([KVDtype.INT8, KVDtype.INT4], shapes, groups):
        if not quant_shapes_ok(kv, D, BS) or quick and (G == 3 or D == 128):
            continue
        # odd lengths, an empty sequence, tails (partly filled, and one complete but unsealed); the
        # 33-block sequence makes splits of several blocks (MB ≥ 32), the rest one-block splits
        for lens in ([1, 17, 0, 2 * BS + 3], [33 * BS + 5]):
            case = make_case(kv, D, BS, lens, G=G, seed=D + BS + G, open_full=True)
            pool, bt, sl, q, _ = case
            scale = 1 / math.sqrt(D)
            out, lse = paged_decode_quant(pool, 1, q, bt, sl, scale, dot_f32=not bf16)
            to, tlse = decode_attention_torch(pool, 1, q, bt, sl, scale)
            full = sl > 0
            runs += 1
            try:
                tol, lse_tol = (TRITON_TOL, BF16_LSE_TOL) if bf16 else (TOL, TOL)
                check_against_references(out, lse, case, scale, tol, lse_tol)
                assert rel(out[full], to[full]) < tol and (lse[full] - tlse[full]).abs().max() < lse_tol
                status = "ok"
            except AssertionError as e:
                fails += 1
                status = f"FAIL {e!r:.200}"
            err = (lse[full] - tlse[full]).abs().max()
            print(f"{'bf16' if bf16 else 'f32 '} {kv.value} D {D} BS {BS} G {G} lens {lens}: out rel "
                  f"{rel(out[full], to[full]):.1e} lse {err:.1e} {status}", flush=True)
            if G == 3 or D == 128:
                continue
            # the same sequences as runs of 5 rows (a program takes 16 // G of them) against the rows one by one
            rcase, rr = as_runs(case, 5, seed=G)
            pool, bt, sl, q, _ = rcase
            out, lse = paged_decode_quant(pool, 1, q, bt, sl, scale, dot_f32=not bf16, runs=rr)
            ro, rl = paged_decode_quant(pool, 1, q, bt, sl, scale, dot_f32=not bf16)
            full = sl > 0
            runs += 1
            try:
                check_against_references(out, lse, rcase, scale, tol, lse_tol)
                assert rel(out[full], ro[full]) < 1e-5 and (lse[full] - rl[full]).abs().max() < 1e-5
                status = "ok"
            except AssertionError as e:
                fails += 1
                status = f"FAIL {e!r:.200}"
            print(f"  runs of 5: out rel to rows {rel(out[full], ro[full]):.1e} {status}", flush=True)
    return fails, runs


if __name__ == "__main__":
    sys.exit(main())
