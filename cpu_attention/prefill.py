"""Causal prefill attention of a chunk of queries over host-tier KV, in torch.

Prefill is compute-bound (T queries reuse each K/V row), so the matrix products go to
torch's GEMMs rather than Numba loops. Against the reference twin it avoids two costs:
the GQA `repeat_interleave` (q is reshaped to [Hkv, G*T, D] instead) and materialising all
n tokens' scores and dequantized K/V at once (KV is walked in CHUNK-token pieces, each
partial merged by log-sum-exp), so memory stays O(T * CHUNK) whatever the context length.
"""
from __future__ import annotations

import torch

from cpu_attention.pool import HostKVPool
from cpu_attention.merge import merge_attention

CHUNK = 2048  # KV tokens dequantized and scored at a time


def prefill_attention(
    pool: HostKVPool,
    layer: int,
    q: torch.Tensor,  # [T, Hq, D] queries at positions q_pos0 .. q_pos0 + T - 1
    block_table: torch.Tensor,  # [max_blocks] int32
    kv_len: int,  # tokens of this sequence on this tier
    q_pos0: int,
    scale: float,
    kv_pos0: int = 0,  # position of the tier's first token
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention → (out [T, Hq, D] f32, lse [T, Hq] f32); a query seeing no token gets 0, -inf."""
    T, Hq, D = q.shape
    Hkv, BS = pool.num_kv_heads, pool.block_size
    G = Hq // Hkv
    prev = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        qg = (q.float() * scale).reshape(T, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * T, D)
        qpos = torch.arange(q_pos0, q_pos0 + T).repeat(G)  # [G*T], row r is query r % T
        out = torch.zeros(Hkv, G * T, D)
        lse = torch.full((Hkv, G * T), float("-inf"))
        # tokens past the last query's position are never seen
        n = min(kv_len, max(0, q_pos0 + T - kv_pos0))
        chunk = max(BS, CHUNK // BS * BS)
        for c0 in range(0, n, chunk):
            c1 = min(c0 + chunk, n)
            b0, b1 = c0 // BS, (c1 + BS - 1) // BS
            k, v = pool.gather(layer, block_table[b0:b1].long(), c1 - b0 * BS)  # [Hkv, *, D]
            k, v = k[:, c0 - b0 * BS:], v[:, c0 - b0 * BS:]
            s = torch.bmm(qg, k.transpose(1, 2))  # [Hkv, G*T, c]
            kpos = torch.arange(kv_pos0 + c0, kv_pos0 + c1)
            if kv_pos0 + c1 - 1 > q_pos0:  # some token is later than some query
                s.masked_fill_((kpos[None, :] > qpos[:, None])[None], float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            p = torch.exp(s - m)
            l_ = p.sum(-1)
            o = torch.bmm(p, v) / l_.clamp_min(1e-30)[..., None]
            lse_c = torch.where(l_ > 0, m[..., 0] + torch.log(l_), torch.full_like(l_, float("-inf")))
            out, lse = merge_attention(out, lse, o, lse_c)
    finally:
        if threads is not None:
            torch.set_num_threads(prev)
    out = out.reshape(Hkv, G, T, D).permute(2, 0, 1, 3).reshape(T, Hq, D)
    lse = lse.reshape(Hkv, G, T).permute(2, 0, 1).reshape(T, Hq)
    return out.contiguous(), lse.contiguous()
