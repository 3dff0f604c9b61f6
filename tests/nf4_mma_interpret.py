"""nf4_mma under Triton's CPU interpreter (no GPU): small shapes, every code path but the PTX decoder;
also its linear decode (gpu_ops.q4) and that format's bf16 dequantization (gpu_ops.q4_triton).

    PYTHONPATH=/tmp/tritonlib:. TRITON_INTERPRET=1 python3 tests/nf4_mma_interpret.py

(triton installed in /tmp/tritonlib with the interpreter patched as bench/RESULTS.md's notes say.)
The interpreter runs no inline PTX and mishandles bf16 dots, so this runs the GATHER decoder
with float32 dots: the tiling, K order, split-K counters, masks and epilogues are what it checks;
the PRMT decoder is checked bit for bit by tests/test_gpu_ops.py's PTX emulator, the whole on
the GPU by the `gpu` tests and bench/nf4_mma.py.
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from gpu_ops.nf4 import dequantize_nf4, quantize_nf4  # noqa: E402
from gpu_ops.nf4_gemv import Decode  # noqa: E402
from gpu_ops.nf4_mma import MmaConfig, Scale, _counters, mma_config, nf4_mma  # noqa: E402

# Against x · W_deqᵀ in float64: the bf16 output's rounding (‖Δy‖/‖y‖ ≈ 1.6e-3 on these random
# sums) plus the code book's (SUM) or each weight's (WEIGHT) rounding to bf16: 2.0-2.6e-3 measured.
# Scale.WEIGHT under GATHER is bitsandbytes' arithmetic: bf16(x · bf16(code · absmax)), equal to
# the bf16-dequantized reference rounded, up to float32 summation order.
TOL = 4e-3


def _round_to_bf16_like_the_gpu() -> None:
    """The interpreter casts float32 → bf16 by truncation; the GPU (and torch) round to nearest
    even. Without this, every bf16 rounding in the kernel would be off by up to an ulp."""
    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).bfloat16().view(torch.int16).numpy()
            return interpreter.TensorHandle(bits.view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_rne


def main() -> int:
    _round_to_bf16_like_the_gpu()
    torch.manual_seed(0)
    fails = 0
    shapes = [(97, 128), (40, 320), (130, 256)]  # N not a multiple of any tile; K = 64·{2, 5, 4}
    configs = [MmaConfig(block_n=32, block_k=64, swap=True), MmaConfig(block_n=16, block_k=128, swap=True),
               MmaConfig(block_n=64, block_k=64, split=3, swap=True), MmaConfig(block_n=32, block_k=128, split=2),
               MmaConfig(block_n=32, block_k=64, split=2, scale=Scale.SUM, swap=True),
               MmaConfig(block_n=16, block_k=64, scale=Scale.SUM), MmaConfig(block_n=64, block_k=128, warps=4),
               None]  # None: default_config
    for (n, k), cfg, rows in itertools.product(shapes, configs, (3, 17, 33)):
        w = torch.randn(n, k) * 0.02
        packed, absmax = quantize_nf4(w)
        wd = dequantize_nf4(packed, absmax, (n, k)).double()
        x = torch.randn(rows, k).bfloat16()
        res = torch.randn(rows, n).bfloat16()
        ref = x.double() @ wd.T
        y = nf4_mma(x, packed, absmax, (n, k), cfg, decode=Decode.GATHER, dot_f32=True)
        err = float((y.double() - ref).norm() / ref.norm())
        # bitsandbytes' way: weights dequantized to bf16, float32 sums
        bnb = x.float() @ dequantize_nf4(packed, absmax, (n, k), torch.bfloat16).float().T
        err_bnb = float((y.double() - bnb.double()).norm() / bnb.norm())
        y_res = nf4_mma(x, packed, absmax, (n, k), cfg, residual=res, decode=Decode.GATHER, dot_f32=True)
        res_ok = torch.equal(y_res, res + y)
        again = torch.equal(nf4_mma(x, packed, absmax, (n, k), cfg, decode=Decode.GATHER, dot_f32=True), y)
        counters_clear = int(_counters(x.device).abs().sum()) == 0
        ok = (y.shape == (rows, n) and err < TOL and res_ok and again and counters_clear
              and bool(torch.isfinite(y).all()))
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} N={n:4} K={k:4} rows={rows:2} {(cfg or mma_config(n, k, rows, 8)).fit(k).tag:22} rel err {err:.2e} "
              f"(vs bf16 weights {err_bnb:.2e}) residual {res_ok} repeatable {again} counters 0 {counters_clear}")
    fails += _linear_format(shapes, configs)
    fails += _linear_dequantize()
    print(f"{fails} failed")
    return int(fails > 0)


def _linear_dequantize() -> int:
    """gpu_ops.q4_triton's bf16 dequantization (a Q4 prefill's) equals dequantize_q4's, bit for bit."""
    from gpu_ops.q4 import dequantize_q4, quantize_q4
    from gpu_ops.q4_triton import dequantize_q4_gpu

    fails = 0
    for shape in [(3, 64), (97, 320), (5, 4160)]:
        packed, sz = quantize_q4(torch.randn(shape) * 0.02)
        ok = torch.equal(dequantize_q4_gpu(packed, sz), dequantize_q4(packed, sz, torch.bfloat16))
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} linear dequantize {shape}")
    return fails


def _linear_format(shapes, configs) -> int:
    """decode=LINEAR_F32 (LINEAR without PTX): gpu_ops.q4's weights, whose decoded bf16 values are
    dequantize_q4's exactly, so only the output's rounding is left (Scale.SUM configs run as WEIGHT)."""
    from gpu_ops.q4 import dequantize_q4, quantize_q4

    fails = 0
    for (n, k), cfg, rows in itertools.product(shapes, configs[::2], (5, 33)):
        packed, sz = quantize_q4(torch.randn(n, k) * 0.02)
        x = torch.randn(rows, k).bfloat16()
        ref = x.double() @ dequantize_q4(packed, sz, torch.float64).T
        y = nf4_mma(x, packed, sz, (n, k), cfg, decode=Decode.LINEAR_F32, dot_f32=True)
        err = float((y.double() - ref).norm() / ref.norm())
        ok = y.shape == (rows, n) and err < TOL and bool(torch.isfinite(y).all())
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} linear N={n:4} K={k:4} rows={rows:2} "
              f"{(cfg or mma_config(n, k, rows, 8)).fit(k).tag:22} rel err {err:.2e}")
    return fails


if __name__ == "__main__":
    sys.exit(main())
