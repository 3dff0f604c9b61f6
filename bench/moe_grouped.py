"""The MoE prefill's grouped 4-bit GEMM (gpu_ops.moe_prefill) on its real shapes, µs a call:

    python3 -m bench.moe_grouped [--sweep] [--tokens 512]

Qwen3-30B-A3B (hidden 2048, expert FFN 768, 128 experts, 8 a token): a prompt's slots over the
layer's NF4 device experts (gate/up with SiLU·up, then down), and over a 64 MiB piece of the host's
int4 experts (24 of them) copied up. Bound: the weights' bytes over the HBM read rate, or the
product's FLOPs over the tensor cores' bf16 rate (both measured here), whichever is larger.
--sweep times a few launch configurations (gpu_ops.moe_prefill.CONFIG's fields) and marks the best.
"""
from __future__ import annotations

import argparse
import torch


def _case(name: str, tokens: int, experts: int, of: int, N: int, K: int, xdiv: int, swiglu: bool, int4: bool):
    """The arguments of one grouped_gemm call: `experts` of the layer's `of` in the stack, the
    prompt's slots routed uniformly over all `of` (the rest elsewhere)."""
    from gpu_ops.moe_prefill import block_rows, sort_slots

    g = torch.Generator(device="cuda").manual_seed(0)
    k = 8
    local = torch.randint(0, of, (tokens, k), generator=g, device="cuda", dtype=torch.int32)
    local = torch.where(local < experts, local, -1)
    P = tokens * k
    bm = block_rows(P, of)
    slots, blocks = sort_slots(local, experts, bm)
    if int4:
        packed = torch.randint(0, 256, (experts, N, K // 2), dtype=torch.uint8, device="cuda")
        absmax = torch.rand(experts, N, K // 64, device="cuda") * 0.01
    else:
        packed = torch.randint(0, 256, (experts, N * K // 2), dtype=torch.uint8, device="cuda")
        absmax = torch.rand(experts, N * K // 64, device="cuda") * 0.05
    x = torch.randn(P // xdiv, K, dtype=torch.bfloat16, device="cuda")
    routed = int((local >= 0).sum())
    nbytes = packed.numel() + 4 * absmax.numel()
    flops = 2 * routed * N * K
    args = (x, slots, blocks, bm, packed, absmax, (N, K))
    kw = dict(xdiv=xdiv, rows=P, swiglu=swiglu, int4=int4)
    return name, args, kw, nbytes, flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="time a grid of launch configurations")
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    from bench.gpu_decode import cuda_ms, hbm_gbps, matmul_tflops
    from gpu_ops.moe_prefill import CONFIG, grouped_gemm

    hbm, tflops = hbm_gbps() * 1e9, matmul_tflops() * 1e12
    print(f"HBM read {hbm / 1e9:.0f} GB/s · bf16 tensor cores {tflops / 1e12:.0f} TFLOP/s · {args.tokens} tokens")
    T = args.tokens
    cases = [_case("gate/up NF4, 128 experts", T, 128, 128, 1536, 2048, 8, True, False),
             _case("down NF4, 128 experts", T, 128, 128, 2048, 768, 1, False, False),
             _case("gate/up int4, 24 of 128", T, 24, 128, 1536, 2048, 8, True, True),
             _case("down int4, 24 of 128", T, 24, 128, 2048, 768, 1, False, True)]
    grid = [CONFIG]
    if args.sweep:  # (BLOCK_N, BLOCK_K, warps, stages, swap): around gpu_ops.nf4_mma's best at ≤ 64 rows
        grid += [c for c in [(64, 256, 4, 3, True), (128, 128, 4, 3, True), (128, 128, 8, 3, True), (64, 128, 8, 3, True),
                             (64, 128, 4, 3, False), (128, 128, 4, 3, False), (128, 128, 8, 3, False),
                             (128, 64, 4, 3, False), (64, 64, 4, 3, True)] if c != CONFIG]
    print(f"{'case':28} {'config':>24} {'µs':>8} {'GB/s':>7} {'TFLOP/s':>8} {'bound µs':>9}")
    for name, a, kw, nbytes, flops in cases:
        bound = max(nbytes / hbm, flops / tflops) * 1e6
        res = []
        for cfg in grid:
            try:
                s = cuda_ms(lambda: grouped_gemm(*a, **kw, config=cfg), warmup=1) / 1e3
            except Exception as e:  # noqa: BLE001  a configuration the GPU cannot run (shared memory)
                print(f"{name:28} {str(cfg):>24} failed: {type(e).__name__}")
                continue
            res.append((s, cfg))
            print(f"{name:28} {str(cfg):>24} {s * 1e6:8.1f} {nbytes / s / 1e9:7.0f} {flops / s / 1e12:8.1f} {bound:9.1f}",
                  flush=True)
        if len(res) > 1:
            s, cfg = min(res)
            print(f"{name:28} {'best ' + str(cfg):>24} {s * 1e6:8.1f} {nbytes / s / 1e9:7.0f} {flops / s / 1e12:8.1f} "
                  f"{bound:9.1f}  (default {CONFIG}: {res[0][0] * 1e6:.1f})", flush=True)


if __name__ == "__main__":
    main()
