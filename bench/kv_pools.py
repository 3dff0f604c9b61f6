"""Helpers of the host benchmarks (`bench.cpu_attention`, `bench.cpu_decode`): host KV pools of
random codes, and how many disjoint copies keep each call's KV out of the last-level cache. The
DRAM read rate they are measured against is `cpu_attention.dram_read_gbps`."""
from __future__ import annotations

import torch

from cpu_attention import HostKVPool, KVDtype

PAST_L3 = 2**30  # bytes of reads between two reads of the same KV (the GPU host's L3 holds ~300 MiB)


def fill(pool: HostKVPool, gen: torch.Generator) -> None:
    """Random codes of realistic magnitude (values are irrelevant to speed, not to nan-freedom),
    up to 64 MiB of them repeated over a larger pool."""
    if pool.dtype is KVDtype.BF16:
        for t in (pool.k, pool.v):
            _tile_fill(t.view(-1), torch.randn(min(t.numel(), 2**25), generator=gen).to(torch.bfloat16))
        return
    for t in (pool.k, pool.v):
        src = torch.randint(0, 256, (min(t.numel(), 2**26),), generator=gen, dtype=torch.uint8)
        _tile_fill(t.view(torch.uint8).view(-1), src)
    for t in (pool.k_scale, pool.v_scale):
        t.fill_(0.02)
    for t in (pool.k_zero, pool.v_zero):
        if t is not None:
            t.fill_(-0.15)


def _tile_fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (flat) := src repeated."""
    for i in range(0, dst.numel(), src.numel()):
        n = min(src.numel(), dst.numel() - i)
        dst[i:i + n].copy_(src[:n])


def copies_past_l3(dtype: KVDtype, kv_heads: int, block: int, head_dim: int, tokens: int, least: int = 2) -> int:
    """Disjoint copies of `tokens` tokens' KV to cycle through so that a call's bytes were last read
    more than PAST_L3 bytes of reads before (at least `least`)."""
    per_copy = tokens * HostKVPool(1, 1, kv_heads, block, head_dim, dtype).bytes_per_token
    return max(least, -(-PAST_L3 // int(per_copy)) + 1)
