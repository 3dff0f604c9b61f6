"""Plain torch twins of the host attention kernels: gather the blocks, dequantize, softmax.

They define what the Numba kernels must compute, and serve as the fallback. Inputs and
outputs follow `cpu_attention.decode_attention` / `prefill_attention`.
"""
from __future__ import annotations

import torch

from cpu_attention.pool import HostKVPool


def decode_attention_ref(
    pool: HostKVPool,
    layer: int,
    q: torch.Tensor,  # [B, Hq, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] tokens on this tier per sequence
    scale: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query per sequence over its host-tier tokens → (out [B,Hq,D], lse [B,Hq])."""
    B, Hq, D = q.shape
    outs, lses = [], []
    for b in range(B):
        n = int(seq_lens[b])
        nb = (n + pool.block_size - 1) // pool.block_size
        k, v = pool.gather(layer, block_tables[b, :nb].long(), n)  # [Hkv, n, D]
        o, lse = _attend(q[b].to(dtype)[:, None, :], k.to(dtype), v.to(dtype), scale, None)
        outs.append(o[:, 0])
        lses.append(lse[:, 0])
    return torch.stack(outs).float(), torch.stack(lses).float()


def prefill_attention_ref(
    pool: HostKVPool,
    layer: int,
    q: torch.Tensor,  # [T, Hq, D] queries at positions q_pos0 .. q_pos0 + T - 1
    block_table: torch.Tensor,  # [max_blocks] int32
    kv_len: int,  # tokens of this sequence on this tier
    q_pos0: int,
    scale: float,
    kv_pos0: int = 0,  # position of the tier's first token
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a chunk of queries over host-tier tokens → (out [T,Hq,D], lse [T,Hq]).

    A query at position p sees the tier's tokens at positions ≤ p. A query that sees none gets
    out 0 and lse -inf, so merging it with another partial leaves that partial unchanged.
    """
    T = q.shape[0]
    nb = (kv_len + pool.block_size - 1) // pool.block_size
    k, v = pool.gather(layer, block_table[:nb].long(), kv_len)  # [Hkv, n, D]
    qpos = torch.arange(q_pos0, q_pos0 + T)[:, None]
    kpos = torch.arange(kv_pos0, kv_pos0 + kv_len)[None, :]
    mask = kpos <= qpos  # [T, n]
    o, lse = _attend(q.to(dtype).transpose(0, 1), k.to(dtype), v.to(dtype), scale, mask)
    return o.transpose(0, 1).float(), lse.transpose(0, 1).float()


def _attend(q, k, v, scale, mask):
    """q [Hq, T, D], k/v [Hkv, n, D], mask [T, n] or None → (out [Hq, T, D], lse [Hq, T])."""
    Hq, Hkv = q.shape[0], k.shape[0]
    k = k.repeat_interleave(Hq // Hkv, dim=0)
    v = v.repeat_interleave(Hq // Hkv, dim=0)
    s = (q @ k.transpose(1, 2)) * scale  # [Hq, T, n]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, T]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse
