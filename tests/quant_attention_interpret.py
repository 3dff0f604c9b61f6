"""gpu_ops.attention_quant under Triton's CPU interpreter (no GPU): small shapes, every code path.

    pip install --target /tmp/tritonlib triton
    PYTHONPATH=/tmp/tritonlib:. TRITON_INTERPRET=1 python3 tests/quant_attention_interpret.py [--quick]

The interpreter mishandles bf16 dots and casts float32 → bf16 by truncation, so this runs the
kernels with float32 dots (dot_f32: DT float32, `_rot_dot` one ieee product): what it checks is
the byte addressing of every layout (int8 and int4 keys and values, scales, zeros, tails, layers),
the rotations, the int4 one-hot scale expansion, masks, empty sequences and splits, the split-K
merge. Not checked here: the bf16 operand path (hi/lo halves), PDL, compilation for a GPU, speed;
the `gpu` tests in tests/test_gpu_quant_attention.py do those on CUDA.
"""
from __future__ import annotations

import itertools
import math
import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
import torch  # noqa: E402

from cpu_attention.layout import KVDtype  # noqa: E402
from gpu_ops.attention import decode_attention_torch  # noqa: E402
from gpu_ops.attention_quant import paged_decode_quant  # noqa: E402
from test_gpu_quant_attention import check_against_references, make_case, rel  # noqa: E402  (tests/ is sys.path[0])

TOL = 2e-5  # float32 dots against float64 / the float32 twin over the same bytes


def main() -> int:
    quick = "--quick" in sys.argv
    fails = runs = 0
    t0 = time.time()
    shapes = [(32, 16), (64, 16), (64, 32), (16, 16), (128, 16)]
    groups = [1, 3, 8]
    for kv, (D, BS), G in itertools.product([KVDtype.INT8, KVDtype.INT4], shapes, groups):
        if kv is KVDtype.INT4 and D < 32 or quick and (G == 3 or D == 128):
            continue
        # odd lengths, an empty sequence, tails (partly filled, and one complete but unsealed); the
        # 33-block sequence makes splits of several blocks (MB ≥ 32), the rest one-block splits
        for lens in ([1, 17, 0, 2 * BS + 3], [33 * BS + 5]):
            case = make_case(kv, D, BS, lens, G=G, seed=D + BS + G, open_full=True)
            pool, bt, sl, q, _ = case
            scale = 1 / math.sqrt(D)
            out, lse = paged_decode_quant(pool, 1, q, bt, sl, scale, dot_f32=True)
            to, tlse = decode_attention_torch(pool, 1, q, bt, sl, scale)
            full = sl > 0
            runs += 1
            try:
                check_against_references(out, lse, case, scale, TOL, TOL)
                assert rel(out[full], to[full]) < TOL and (lse[full] - tlse[full]).abs().max() < TOL
                status = "ok"
            except AssertionError as e:
                fails += 1
                status = f"FAIL {e!r:.200}"
            print(f"{kv.value} D {D} BS {BS} G {G} lens {lens}: rel {rel(out[full], to[full]):.1e} {status}", flush=True)
    print(f"{runs - fails}/{runs} passed in {time.time() - t0:.0f} s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
