"""Where the tensor-core NF4 GEMV's time goes: variants that leave one stage out, timed side by side.

    python3 -m bench.nf4_tc_probe [--out FILE] [--shapes qkv,gate_up,down,lm_head]

Each variant is `gpu_ops.nf4_tc`'s source with one stage replaced (wrong results, on purpose):
    base       the kernel as it is
    l2_256     weight loads with the L2::256B prefetch hint (l2_128: 128B)
    nodecode   the code-book lookup and the scaling replaced by one integer op a pair
    noscale    the scaling by absmax left out (its float op replaced by an integer one)
    selimad    the lookup's selectors shifted by multiplies (IMAD.HI, the float pipe) instead of shifts
               (the integer pipe); selimad_k with the shift constants hidden from ptxas
    nomma      the MMAs replaced by float adds of the operands' bits
    nox        x's loads replaced by registers
    loadonly   nodecode + nomma + nox: only the weights' and scales' loads
and `stream`, a plain kernel that reads the same bytes front to back (every lane 16 bytes, grid-
stride), the read rate this matrix's bytes allow. µs a call at 1 row inside a CUDA graph, copies
rotated past L2, GB/s of NF4 bytes beside the HBM copy rate.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import re
from pathlib import Path

import torch

from bench.gpu_decode import graph_ms, hbm_gbps
from gpu_ops import cuda_rtc, nf4_tc
from gpu_ops.nf4 import nf4_linear

DEV = torch.device("cuda")
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CONFIGS = [None, nf4_tc.TcConfig(2, 2, 4), nf4_tc.TcConfig(1, 8, 2)]

_DECODE = re.compile(r"__device__ __forceinline__ void decode\(.*?\n}\n", re.S)
_MMA = re.compile(r"__device__ __forceinline__ void mma\(.*?\n}\n", re.S)
_X = "*reinterpret_cast<const uint4*>(xp + 64 * j + 4 * i)"


def _variant(name: str) -> str:
    s = nf4_tc._SOURCE
    if name.startswith("l2_"):
        s = s.replace("L1::no_allocate", f"L1::no_allocate.L2::{name[3:]}B")
    if name in ("nodecode", "loadonly"):
        s = _DECODE.sub("__device__ __forceinline__ void decode(u32 q, u32 s2, const u32* T, u32* p) {\n"
                        "    p[0] = q; p[1] = q ^ s2; p[2] = q + s2; p[3] = q - s2;\n}\n", s, count=1)
    if name in ("nomma", "loadonly"):
        s = _MMA.sub("__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {\n"
                     "    d[0] += __uint_as_float(a0 ^ b0); d[1] += __uint_as_float(a1 ^ b1);\n"
                     "    d[2] += __uint_as_float(a2); d[3] += __uint_as_float(a3);\n}\n", s)
    if name == "noscale":
        s = s.replace('asm("fma.rn.bf16x2 %0, %0, %1, %2;" : "+r"(p[i]) : "r"(s2), "r"(z));', "p[i] ^= s2 & z;")
    if name.startswith("selimad"):
        hide = " + (blockDim.y - 1u)" if name.endswith("_k") else ""  # 0 at run time, unknown to ptxas
        old = ("    u32 q7 = q & 0x77777777u, q7h = q7 >> 16;\n"
               "    u32 t = ((q >> 1) & 0x44444444u) | 0x32103210u, th = t >> 16;\n")
        new = ("    u32 q7 = q & 0x77777777u, m = q & 0x88888888u, q7h, t, th;\n"
               f"    asm(\"mul.hi.u32 %0, %1, %2;\" : \"=r\"(q7h) : \"r\"(q7), \"r\"(65536u{hide}));\n"
               f"    asm(\"mad.hi.u32 %0, %1, %2, 0x32103210;\" : \"=r\"(t) : \"r\"(m), \"r\"(0x80000000u{hide}));\n"
               f"    asm(\"mad.hi.u32 %0, %1, %2, 0x3210;\" : \"=r\"(th) : \"r\"(m), \"r\"(0x8000u{hide}));\n")
        if old not in s:
            raise ValueError("the decoder's selector lines moved")
        s = s.replace(old, new)
    if name in ("nox", "loadonly"):
        s = s.replace(_X, "make_uint4(j, i, c, g)")
    if s == nf4_tc._SOURCE and name != "base":
        raise ValueError(f"variant {name} changed nothing: the kernel's source moved")
    return s


_STREAM = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, long long n, unsigned* __restrict__ out) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}
"""


def _call(lin, x, out, n, k, cfg, src) -> None:
    nf4_tc._launch(x, lin.packed, lin.absmax, out, None, None, n, k, 1, 1, 0, 1, False, cfg, source=src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shapes", default="qkv,gate_up,down,lm_head")
    ap.add_argument("--variants", default="base,l2_256,nodecode,selimad,selimad_k,loadonly")
    args = ap.parse_args()
    hbm = hbm_gbps()
    variants = args.variants.split(",")
    stream = cuda_rtc.Kernel(_STREAM, "stream_read")
    sink = torch.zeros(1, dtype=torch.int32, device=DEV)
    rows = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        copies = [nf4_linear(torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02, None, DEV)
                  for _ in range(max(1, min(8, -(-200_000_000 // (n * k // 2)))))]
        nbytes = copies[0].nbytes
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        it = iter(range(1 << 30))
        pick = lambda: copies[next(it) % len(copies)]  # noqa: E731
        row = {"shape": shape, "N": n, "K": k, "bytes": nbytes}
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count

        def read(c):
            words = c.packed.numel() // 16
            stream.launch(DEV, (sms * 8, 1, 1), 256, [ctypes.c_void_p(c.packed.data_ptr()), ctypes.c_longlong(words),
                                                       ctypes.c_void_p(sink.data_ptr())])
        row["stream_us"] = 1e3 * graph_ms(lambda: read(pick()), calls=len(copies) * 4)
        for v in variants:
            src = _variant(v)
            for cfg in CONFIGS:
                key = f"{v}:{'default' if cfg is None else f'{cfg.wr}x{cfg.wk}u{cfg.u}'}_us"
                out = torch.empty(1, n, dtype=torch.bfloat16, device=DEV)
                try:
                    row[key] = 1e3 * graph_ms(lambda: _call(pick(), x, out, n, k, cfg, src), calls=len(copies) * 4)
                except Exception as e:  # noqa: BLE001  a benchmark reports what failed and goes on
                    row[key] = None
                    print(f"{shape} {key} failed: {e!r}"[:400])
        rows.append(row)
        copies.clear()
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"hbm_gbps": hbm, "rows": rows}, indent=1))
    print(f"HBM copy {hbm:.0f} GB/s; µs a call (GB/s of NF4 bytes)")
    for r in rows:
        print(f"{r['shape']} {r['N']}x{r['K']}: bound {r['bytes'] / hbm / 1e3:.1f} µs, "
              f"stream {r['stream_us']:.1f} ({r['bytes'] / r['stream_us'] / 1e3:.0f})")
        for v in variants:
            cells = [f"{kk[len(v) + 1:-3]} {us:.1f} ({r['bytes'] / us / 1e3:.0f})"
                     for kk, us in r.items() if kk.startswith(v + ":") and us]
            print(f"  {v:9} " + "  ".join(cells))


if __name__ == "__main__":
    main()
