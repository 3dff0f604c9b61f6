"""A mixture-of-experts layer's routing (after the router's product) and its weighted sum, one Triton
kernel each (`offload.moe.MoEFeedForward` takes them on CUDA: decode steps and prefill chunks).

Why: in torch the routing is six small launches a layer (the router's product, a cast, top-k,
softmax, the device's and the host's index maps) and the sum five (a cast, the product by the
weights, the sum over a token's slots, the host's share added, a cast back): at 48 layers of a
few µs each, the Qwen3-30B-A3B step with every expert on the GPU measured ~55 µs a layer of such
kernels (bench.moe, H100), next to ~100 µs of its two grouped expert kernels. Here they are three.

`route`: the router's product by cuBLAS (its bf16 logits, as the model's torch code has them),
then one program a row: the top k by k passes of an argmax (first index on ties), each slot's
weight (the softmax over the k where the model renormalizes them, `norm_topk_prob`, else the
softmax over all E at the k), and the expert's index among the device's and the host's experts
(−1: not theirs). `combine`: out[n] = Σ_j w[n, j] · y[n·k + j] (+ host[n]) in float32, written
in the activations' dtype. Their torch twins, which CPU stand-ins run, are
`offload.moe.route` and `combine`. Nothing syncs: capturable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _route_kernel(l_ptr, gmap_ptr, hmap_ptr, idx_ptr, w_ptr, gslot_ptr, hslot_ptr, h_ptr, sf_ptr, si_ptr, N, H,
                  E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                  STAGE: tl.constexpr, BH: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    logit = tl.load(l_ptr + n * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    m = tl.max(logit, 0)
    j = tl.arange(0, KP)
    top = tl.full([KP], float("-inf"), tl.float32)
    ids = tl.zeros([KP], tl.int32)
    left = logit
    for s in tl.static_range(K):
        best = tl.argmax(left, 0)
        top = tl.where(j == s, tl.max(left, 0), top)
        ids = tl.where(j == s, best, ids)
        left = tl.where(e == best, float("-inf"), left)
    p = tl.exp(top - m)  # padding slots: exp(-inf) = 0
    if NORM:
        w = p / tl.sum(p, 0)
    else:
        w = p / tl.sum(tl.exp(logit - m), 0)
    ok = j < K
    out = n * K + j
    tl.store(idx_ptr + out, ids, mask=ok)
    tl.store(w_ptr + out, w, mask=ok)
    tl.store(gslot_ptr + out, tl.load(gmap_ptr + ids, mask=ok, other=-1), mask=ok)
    hslot = tl.load(hmap_ptr + ids, mask=ok, other=-1)
    tl.store(hslot_ptr + out, hslot, mask=ok)
    if STAGE:  # the host's call's input, in its page-locked buffer: h as float32, then w, then the host slots
        for c0 in range(0, H, BH):
            c = c0 + tl.arange(0, BH)
            tl.store(sf_ptr + n * H + c, tl.load(h_ptr + n * H + c, mask=c < H).to(tl.float32), mask=c < H)
        tl.store(sf_ptr + N * H + out, w, mask=ok)
        tl.store(si_ptr + N * (H + K) + out, hslot, mask=ok)


@triton.jit
def _combine_kernel(y_ptr, w_ptr, host_ptr, res_ptr, o_ptr, H, K: tl.constexpr, BH: tl.constexpr, HOST: tl.constexpr,
                    RES: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = c < H
    acc = tl.zeros([BH], tl.float32)
    for s in tl.static_range(K):
        acc += tl.load(w_ptr + n * K + s) * tl.load(y_ptr + (n * K + s) * H + c, mask=ok, other=0.0).to(tl.float32)
    if HOST:  # page-locked host memory the CPU wrote since the last launch: read past the caches
        acc += tl.load(host_ptr + n * H + c, mask=ok, other=0.0, cache_modifier=".cv")
    if RES:  # rounded to the output's dtype first, as torch adds a residual to it
        acc = acc.to(o_ptr.dtype.element_ty).to(tl.float32) + tl.load(res_ptr + n * H + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(o_ptr + n * H + c, acc.to(o_ptr.dtype.element_ty), mask=ok)


def route(h: torch.Tensor, router: torch.Tensor, k: int, norm_topk: bool, gpu_map: torch.Tensor,
          host_map: torch.Tensor, stage: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [N, H], router [E, H], maps [E] int32 (an expert's index among the device's / the host's
    experts, −1: not there) → idx [N, k] int32 (experts, by weight, descending), w [N, k] float32,
    gpu_slots and host_slots [N, k] int32 (the maps at idx). The router's product is cuBLAS's.
    stage: a page-locked float32 buffer of ≥ N·(H + 2k) that also receives h as float32, w and the
    host slots (as int32 bits), in that order: the host's experts' input, written by this kernel
    where a copy kernel, a cast and a copy down did it (`offload.moe.MoEFeedForward._queue_host`)."""
    logits = F.linear(h.to(router.dtype), router)  # [N, E]
    N, E = logits.shape
    H = h.shape[1]
    dev = h.device
    idx = torch.empty((N, k), dtype=torch.int32, device=dev)
    w = torch.empty((N, k), dtype=torch.float32, device=dev)
    gslot, hslot = (torch.empty((N, k), dtype=torch.int32, device=dev) for _ in range(2))
    sf = stage if stage is not None else w
    _route_kernel[(N,)](logits, gpu_map, host_map, idx, w, gslot, hslot, h.contiguous(), sf, sf.view(torch.int32), N,
                        H, E=E, EP=triton.next_power_of_2(E), K=k, KP=triton.next_power_of_2(k), NORM=norm_topk,
                        STAGE=stage is not None, BH=1024, num_warps=1 if stage is None else 4)
    return idx, w, gslot, hslot


def combine(y: torch.Tensor, w: torch.Tensor, host: torch.Tensor | None, dtype: torch.dtype,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """y [N·k, H] (each slot's expert output; zero rows for slots computed elsewhere), w [N, k]
    float32, host [N, H] float32 or None → Σ over a row's slots of w · y (+ host) [N, H] in dtype,
    then + residual [N, H] (dtype) where given."""
    N, k = w.shape
    H = y.shape[1]
    out = torch.empty((N, H), dtype=dtype, device=y.device)
    BH = 512
    res = residual.contiguous() if residual is not None else out
    _combine_kernel[(N, triton.cdiv(H, BH))](y.contiguous(), w.contiguous(), host if host is not None else w, res, out,
                                             H, K=k, BH=BH, HOST=host is not None, RES=residual is not None,
                                             num_warps=4)
    return out
