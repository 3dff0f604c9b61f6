"""gpu_ops.moe_route under Triton's CPU interpreter (no GPU): the routing and combining kernels
against their torch twins (`offload.moe.route`, `combine`) on the shapes of Qwen3-30B-A3B's and
Mixtral's layers and odd ones, both weightings, with and without the host's share. bf16 logits
tie often: there the experts must be a top k in weight order (which of tied ones is free).

    pip install --target /tmp/tritonlib triton
    PYTHONPATH=/tmp/tritonlib:. TRITON_INTERPRET=1 python3 tests/moe_route_interpret.py

Not collected by pytest (the `gpu` tests in tests/test_moe.py run the same checks on CUDA).
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
from gpu_ops.moe_route import combine, route  # noqa: E402
from offload.moe import combine as combine_torch, route as route_torch  # noqa: E402


def check(N: int, H: int, E: int, k: int, norm: bool, dtype: torch.dtype, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    router = (torch.randn(E, H, generator=g) * H**-0.5).to(dtype)
    gpu_map = torch.randint(-1, 5, (E,), generator=g, dtype=torch.int32)
    host_map = torch.where(gpu_map < 0, torch.arange(E, dtype=torch.int32), -1).to(torch.int32)
    got, want = route(h, router, k, norm, gpu_map, host_map), route_torch(h, router, k, norm, gpu_map, host_map)
    bad = []
    idx = got[0].long()
    logits = torch.nn.functional.linear(h.to(router.dtype), router).float()  # both take these
    top = logits.gather(1, idx)
    if not (bool((top >= logits.topk(k, dim=-1).values[:, -1:]).all()) and bool((top[:, :-1] >= top[:, 1:]).all())):
        bad.append(f"experts {idx.tolist()} are not a top {k} by weight (the twin's: {want[0].tolist()})")
    if dtype is torch.float32 and not torch.equal(idx, want[0]):  # no ties: the twin's experts exactly
        bad.append(f"experts differ: {idx.tolist()} against {want[0].tolist()}")
    w = torch.softmax(top, -1) if norm else torch.exp(top - torch.logsumexp(logits, -1, keepdim=True))
    if not torch.allclose(got[1], w, rtol=1e-5, atol=1e-6):
        bad.append(f"weights differ by {(got[1] - w).abs().max():.2e}")
    if not (torch.equal(got[2], gpu_map[idx]) and torch.equal(got[3], host_map[idx])):
        bad.append("slot maps differ")
    y = torch.randn(N * k, H, generator=g).to(dtype)
    for host in (None, torch.randn(N, H, generator=g)):
        a, b = combine(y, got[1], host, dtype), combine_torch(y, got[1], host, dtype)
        tol = 1e-5 if dtype is torch.float32 else 1e-2
        if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
            what = "combine with host" if host is not None else "combine"
            bad.append(f"{what} differs by {(a.float() - b.float()).abs().max():.2e}")
    return bad


def main() -> None:
    failed = 0
    cases = list(itertools.product([(1, 2048, 128, 8), (5, 2048, 128, 8), (3, 4096, 8, 2), (2, 200, 60, 3)],
                                   (True, False), (torch.float32, torch.bfloat16)))
    for n, ((N, H, E, k), norm, dtype) in enumerate(cases):
        bad = check(N, H, E, k, norm, dtype, seed=n)
        failed += bool(bad)
        print(f"N {N} H {H} E {E} k {k} norm {norm} {str(dtype)[6:]}: {'; '.join(bad) or 'ok'}", flush=True)
    print(f"{len(cases) - failed}/{len(cases)} passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
