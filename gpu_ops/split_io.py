"""A split decode step's two crossings between its GPU segments and the CPU, a kernel each.

Down: q, k and v [N, H, D] (views of one projection's output) as float32 into one flat staging
buffer [q rows | k rows | v rows], which goes to pinned host memory as one copy. Three `copy_`s
from the views each took a conversion kernel and a device-to-host copy, ~45 µs a layer in all
at 16 rows (torch.profiler on the GPU host: the copies wait ~9 µs for each other).

Up: the partials (o, lse) of the host tier, the device tier and the streamed host blocks
merged by their log-sum-exp and cast to the activations' dtype (`cpu_attention.merge`'s
formula, its twin). Pairwise through torch that was ~19 elementwise kernels a pair, ~80 µs a
layer with two pairs, on the step's serial path (the CPU waits for the next layer's q).
"""
from __future__ import annotations

import functools

import torch

from cpu_attention.merge import merge_attention

MERGE_ROWS = 16  # (sequence, query head) rows a program of the merge


@functools.cache
def _kernels():
    """(merge, pack), defined on first use: importing this module needs no Triton (CPU runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def merge_tiers(o0, l0, o1, l1, o2, l2, out, R, N: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                    ROWS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, DP)
        rok = r < R
        ok = rok[:, None] & (d < D)[None, :]
        at = r[:, None] * D + d[None, :]
        a = tl.load(l0 + r, mask=rok, other=float("-inf"))
        b = tl.load(l1 + r, mask=rok, other=float("-inf"))
        if N == 3:
            c = tl.load(l2 + r, mask=rok, other=float("-inf"))
        else:  # an unread third
            c = tl.full([ROWS], float("-inf"), tl.float32)
        m = tl.maximum(tl.maximum(a, b), c)
        m = tl.where(m == float("-inf"), 0.0, m)  # every partial empty: the weights stay finite (0)
        wa, wb, wc = tl.exp(a - m), tl.exp(b - m), tl.exp(c - m)
        den = wa + wb + wc
        inv = 1.0 / tl.where(den == 0.0, 1.0, den)
        acc = tl.load(o0 + at, mask=ok, other=0.0).to(tl.float32) * (wa * inv)[:, None]
        acc += tl.load(o1 + at, mask=ok, other=0.0).to(tl.float32) * (wb * inv)[:, None]
        if N == 3:
            acc += tl.load(o2 + at, mask=ok, other=0.0).to(tl.float32) * (wc * inv)[:, None]
        tl.store(out + at, acc.to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def pack_qkv(q, k, v, dst, Hq, Hkv, NQ, NK, sq0, sq1, sk0, sk1, sv0, sv1, D: tl.constexpr, DP: tl.constexpr):
        r = tl.program_id(0)  # a row of dst: q's N·Hq rows, then k's N·Hkv, then v's
        d = tl.arange(0, DP)
        ok = d < D
        if r < NQ:
            x = tl.load(q + (r // Hq) * sq0 + (r % Hq) * sq1 + d, mask=ok).to(tl.float32)
        elif r < NQ + NK:
            j = r - NQ
            x = tl.load(k + (j // Hkv) * sk0 + (j % Hkv) * sk1 + d, mask=ok).to(tl.float32)
        else:
            j = r - NQ - NK
            x = tl.load(v + (j // Hkv) * sv0 + (j % Hkv) * sv1 + d, mask=ok).to(tl.float32)
        tl.store(dst + r.to(tl.int64) * D + d, x, mask=ok)

    return merge_tiers, pack_qkv


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def merge_into(out: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """out [..., D] ← the merge of one to three partials (o [..., D], lse [...] float32) over
    disjoint token sets, in out's dtype; capturable in a graph. On a CPU tensor, or past three
    partials, the torch twin."""
    if not parts:
        raise ValueError("merge_into: no partials")
    if not out.is_cuda or len(parts) > 3:
        o, lse = parts[0]
        for o_p, lse_p in parts[1:]:
            o, lse = merge_attention(o_p, lse_p, o, lse)
        out.copy_(o)
        return
    if len(parts) == 1:
        out.copy_(parts[0][0])
        return
    D = out.shape[-1]
    R = out.numel() // D
    if not out.is_contiguous() or any(o.numel() != R * D or lse.numel() != R or lse.dtype != torch.float32
                                      for o, lse in parts):
        raise ValueError(f"merge_into: partials {[(tuple(o.shape), tuple(lse.shape)) for o, lse in parts]} "
                         f"(lse float32) for a contiguous output of {tuple(out.shape)}")
    flat = [t.contiguous() for o, lse in parts for t in (o, lse)]
    if len(parts) == 2:
        flat += flat[:2]  # the kernel's unread third
    merge, _ = _kernels()
    merge[(-(-R // MERGE_ROWS),)](*flat, out, R, N=len(parts), D=D, DP=_pow2(D), ROWS=MERGE_ROWS, num_warps=4)


def pack_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dst: torch.Tensor) -> None:
    """dst float32 [N·(Hq + 2·Hkv)·D] ← q [N, Hq, D], k and v [N, Hkv, D] (any strides with a unit
    last one), flattened one after the other; capturable in a graph. CPU tensors: plain copies."""
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    nq, nk = N * Hq * D, N * Hkv * D
    if dst.numel() != nq + 2 * nk or dst.dtype != torch.float32 or not dst.is_contiguous():
        raise ValueError(f"pack_rows: {tuple(dst.shape)} {dst.dtype} for q {tuple(q.shape)}, k/v {tuple(k.shape)}")
    if not dst.is_cuda or any(t.stride(-1) != 1 for t in (q, k, v)):
        for t, a, n in ((q, 0, nq), (k, nq, nk), (v, nq + nk, nk)):
            dst[a:a + n].view(t.shape).copy_(t)
        return
    _, pack = _kernels()
    pack[(N * (Hq + 2 * Hkv),)](q, k, v, dst, Hq, Hkv, N * Hq, N * Hkv, q.stride(0), q.stride(1), k.stride(0),
                                k.stride(1), v.stride(0), v.stride(1), D=D, DP=_pow2(D), num_warps=1)
