"""gpu_ops.moe_prefill under Triton's CPU interpreter (no GPU): the slots' sort into per-expert
blocks (against its torch twin too, whole and for a piece of the experts), and the grouped GEMM over NF4 and int4 stacks (plain and with SiLU·up) against the dequantized weights applied
slot by slot, for routings with experts of no slot, of one, of several blocks, and slots routed
elsewhere.

    pip install --target /tmp/tritonlib triton
    PYTHONPATH=/tmp/tritonlib:. TRITON_INTERPRET=1 python3 tests/moe_prefill_interpret.py

Not collected by pytest (the `gpu` test in tests/test_moe.py runs a MoE prefill on CUDA against
the one-expert-at-a-time path).
"""
from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
from gpu_ops.moe_prefill import block_rows, grouped_gemm, sort_slots, sort_slots_reference  # noqa: E402
from gpu_ops.nf4 import quantize_nf4  # noqa: E402
from gpu_ops.nf4_code import BLOCK, NF4_CODE  # noqa: E402


def stack(E: int, N: int, K: int, g: torch.Generator, int4: bool = False):
    """E random NF4 (or int4: cpu_attention.experts) matrices [N, K] stacked, and each as float64."""
    ws = [torch.randn(N, K, generator=g) * 0.05 for _ in range(E)]
    if int4:
        from cpu_attention.experts import dequantize_int4, quantize_int4

        q = [quantize_int4(w) for w in ws]
        return (torch.stack([c for c, _ in q]), torch.stack([s for _, s in q]),
                [dequantize_int4(c, s, torch.float64) for c, s in q])
    q = [quantize_nf4(w) for w in ws]
    packed, absmax = torch.stack([p for p, _ in q]), torch.stack([a for _, a in q])
    dense = [(NF4_CODE.double()[torch.stack([p >> 4, p & 15], -1).view(-1).long()] * a.double().repeat_interleave(BLOCK))
             .view(N, K) for p, a in q]
    return packed, absmax, dense


def check(T: int, k: int, E: int, H: int, F: int, bm: int | None, seed: int, int4: bool) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    local = torch.randint(-1, E, (T, k), generator=g, dtype=torch.int32)
    if T > 3:
        local[: T // 2, 0] = 0  # one expert with several blocks' worth
    bm = bm or block_rows(T * k, E)
    slots, blocks = sort_slots(local, E, bm)
    bad = []
    flat = local.reshape(-1)
    seen = torch.zeros(T * k, dtype=torch.int64)
    for b, e in enumerate(blocks.tolist()):
        rows = slots[b * bm:(b + 1) * bm]
        live = rows[rows >= 0].long()
        if e < 0:
            if live.numel():
                bad.append(f"block {b} has no expert but slots {live.tolist()}")
            continue
        if not bool((flat[live] == e).all()):
            bad.append(f"block {b} of expert {e} holds slots of experts {flat[live].tolist()}")
        seen[live] += 1
    want_seen = (flat >= 0).long()
    if not torch.equal(seen, want_seen):
        bad.append("a device slot is in no block, or in two")
    gu_p, gu_a, gu_w = stack(E, 2 * F, H, g, int4)
    dn_p, dn_a, dn_w = stack(E, H, F, g, int4)
    x = torch.randn(T, H, generator=g)
    act = grouped_gemm(x, slots, blocks, bm, gu_p, gu_a, (2 * F, H), xdiv=k, rows=T * k, swiglu=True, dot_f32=True,
                       int4=int4)
    y = grouped_gemm(act, slots, blocks, bm, dn_p, dn_a, (H, F), xdiv=1, rows=T * k, zero=True, dot_f32=True, int4=int4)
    for s in range(T * k):
        e = int(flat[s])
        if e < 0:
            if y[s].abs().max() != 0:
                bad.append(f"slot {s} is routed elsewhere but has a nonzero row")
            continue
        gu = gu_w[e] @ x[s // k].double()
        a = torch.nn.functional.silu(gu[:F]) * gu[F:]
        if not torch.allclose(act[s].double(), a, rtol=1e-4, atol=1e-5):
            bad.append(f"slot {s}: gate/up off by {(act[s].double() - a).abs().max():.2e}")
        want = dn_w[e] @ act[s].double()
        if not torch.allclose(y[s].double(), want, rtol=1e-4, atol=1e-5):
            bad.append(f"slot {s}: down off by {(y[s].double() - want).abs().max():.2e}")
    return bad


def check_sort(T: int, k: int, E: int, bm: int, lo: int, experts: int, seed: int) -> list[str]:
    """The kernel's sort against its torch twin: the same block experts and slots, in the same order."""
    g = torch.Generator().manual_seed(seed)
    local = torch.randint(-1, E, (T, k), generator=g, dtype=torch.int32)
    local[: T // 2, 0] = lo  # a run of several blocks
    slots, blocks = sort_slots(local, experts, bm, lo)
    want_slots, want_blocks = sort_slots_reference(local, experts, bm, lo)
    if not torch.equal(blocks, want_blocks):
        return [f"block experts {blocks.tolist()[:12]} against {want_blocks.tolist()[:12]}"]
    return [f"block {b}: slots {slots[b * bm:(b + 1) * bm].tolist()}" for b in range(blocks.numel())
            if not torch.equal(slots[b * bm:(b + 1) * bm], want_slots[b * bm:(b + 1) * bm])]


def main() -> None:
    failed = 0
    for c in [(64, 8, 128, 16, 0, 128, 0), (512, 8, 128, 32, 0, 128, 1), (300, 8, 128, 16, 24, 40, 2),
              (100, 8, 74, 16, 60, 14, 3), (1, 8, 128, 16, 0, 128, 4), (5, 2, 4, 64, 0, 4, 5)]:
        bad = check_sort(*c)
        print(("ok  " if not bad else "FAIL") + f" sort T={c[0]} k={c[1]} E={c[2]} bm={c[3]} experts [{c[4]}, "
              f"{c[4] + c[5]})", *bad[:3])
        failed += bool(bad)
    cases = [(37, 3, 5, 128, 64, None, 0), (9, 2, 7, 128, 128, 16, 1), (70, 4, 3, 64, 192, 32, 2),
             (1, 1, 4, 64, 64, None, 3), (40, 8, 16, 256, 64, 64, 4)]
    for c in cases:
        for int4 in (False, True):
            bad = check(*c, int4)
            print(("ok  " if not bad else "FAIL") + f" {'int4' if int4 else 'nf4 '} T={c[0]} k={c[1]} E={c[2]} H={c[3]} "
                  f"F={c[4]} bm={c[5]}", *bad[:3])
            failed += bool(bad)
    print(f"{2 * len(cases) + 6 - failed}/{2 * len(cases) + 6} passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
