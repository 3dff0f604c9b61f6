"""Attention over the GPU-tier paged KV pool, returning output and log-sum-exp.

Conventions are those of `cpu_attention.reference` (its functions are the reference twins:
tests copy a `GpuKVPool` into a float32 `HostKVPool` and compare): decode attends one new query
per sequence over its first `seq_lens[b]` tier tokens; chunked prefill is causal, a query at
position p seeing the tier's tokens at positions ≤ p; a query that sees none gets out 0 and
lse -inf, so `cpu_attention.merge.merge_attention` with the CPU's share leaves that share as is.

Decode has two kernels: plain torch (gather the blocks, float32 softmax; the fallback, and the
CPU path) and Triton (`gpu_ops.attention_triton`: reads each K/V byte once, no gather copy;
`gpu_ops.attention_quant` for int8 / int4 pools, dequantizing in registers).
Prefill is torch only: it is compute-bound in the projections, not here.
"""
from __future__ import annotations

import enum

import torch

from cpu_attention.merge import merge_attention
from gpu_ops.kv_pool import GpuKVPool, quant_shapes_ok
from gpu_ops.runs import RunRows

PREFILL_KV_CHUNK = 4096  # tier tokens per score matrix in prefill, to bound its memory


class AttnKernel(str, enum.Enum):
    AUTO = "auto"  # Triton on cuda where the shapes allow, torch otherwise
    TORCH = "torch"
    TRITON = "triton"


def decode_attention(
    pool: GpuKVPool,
    layer: int,
    q: torch.Tensor,  # [B, Hq, D]
    block_tables: torch.Tensor,  # [B, MB] int32, on the pool's device; rows padded with any valid block
    seq_lens: torch.Tensor,  # [B] int32, tier tokens per sequence (the new token included)
    scale: float,
    kernel: AttnKernel = AttnKernel.AUTO,
    out_dtype: torch.dtype = torch.float32,
    runs: RunRows | None = None,  # rows of one sequence that may share a program (None: each row its own)
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (out [B, Hq, D] out_dtype, lse [B, Hq] float32). No host sync: capturable in a CUDA graph.
    (out_dtype bf16 where nothing merges the result: the Triton kernels write it, no cast kernel.)"""
    if kernel is AttnKernel.AUTO:
        kernel = AttnKernel.TRITON if triton_ok(pool, q) else AttnKernel.TORCH
    if kernel is AttnKernel.TRITON and pool.quantized:
        from gpu_ops.attention_quant import paged_decode_quant

        return paged_decode_quant(pool, layer, q, block_tables, seq_lens, scale, out_dtype=out_dtype, runs=runs)
    if kernel is AttnKernel.TRITON:
        from gpu_ops.attention_triton import paged_decode

        return paged_decode(pool, layer, q, block_tables, seq_lens, scale, out_dtype=out_dtype, runs=runs)
    o, lse = decode_attention_torch(pool, layer, q, block_tables, seq_lens, scale)
    return o.to(out_dtype), lse


def triton_ok(pool: GpuKVPool, q: torch.Tensor) -> bool:
    D, BS = pool.head_dim, pool.block_size
    if pool.quantized:
        return q.is_cuda and quant_shapes_ok(pool.kv_dtype, D, BS)
    return q.is_cuda and BS >= 16 and D >= 16 and D & (D - 1) == 0 and BS & (BS - 1) == 0


def decode_attention_torch(pool, layer, q, block_tables, seq_lens, scale):
    B, Hq, D = q.shape
    k, v = pool.gather(layer, block_tables)  # [B, Hkv, T, D]
    Hkv, T = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, Hq // Hkv, D).float()
    s = (qg @ k.float().transpose(-1, -2)) * scale  # [B, Hkv, G, T]
    valid = torch.arange(T, device=q.device)[None, :] < seq_lens.to(q.device)[:, None]  # [B, T]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = p @ v.float()  # [B, Hkv, G, D]
    return out.reshape(B, Hq, D), lse.reshape(B, Hq)


def prefill_attention(
    pool: GpuKVPool,
    layer: int,
    q: torch.Tensor,  # [T, Hq, D] queries at positions q_pos0 .. q_pos0 + T - 1
    block_table: torch.Tensor,  # [max_blocks] int32
    kv_len: int,  # tokens of this sequence on this tier (the chunk's own included)
    q_pos0: int,
    scale: float,
    kv_pos0: int = 0,  # position of the tier's first token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a chunk of queries over tier tokens → (out [T, Hq, D], lse [T, Hq]) float32."""
    T, Hq, D = q.shape
    Hkv, BS = pool.num_kv_heads, pool.block_size
    G = Hq // Hkv
    qh = q.float().reshape(T, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * T, D)  # rows: (g, t)
    qpos = torch.arange(q_pos0, q_pos0 + T, device=q.device).repeat(G)  # [G * T]
    out = torch.zeros(Hkv, G * T, D, device=q.device)
    lse = torch.full((Hkv, G * T), float("-inf"), device=q.device)
    bt = block_table.to(q.device, torch.int64)
    for c0 in range(0, kv_len, PREFILL_KV_CHUNK):  # PREFILL_KV_CHUNK is a multiple of BS
        n = min(PREFILL_KV_CHUNK, kv_len - c0)
        k, v = pool.gather(layer, bt[c0 // BS: (c0 + n + BS - 1) // BS][None])  # [1, Hkv, nb * BS, D]
        k, v = k[0, :, :n].float(), v[0, :, :n].float()
        kpos = torch.arange(kv_pos0 + c0, kv_pos0 + c0 + n, device=q.device)
        s = (qh @ k.transpose(1, 2)) * scale  # [Hkv, G*T, n]
        s = s.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        l_c = torch.logsumexp(s, dim=-1)
        o_c = torch.exp(s - l_c[..., None]).nan_to_num(0.0) @ v
        out, lse = merge_attention(out, lse, o_c, l_c)
    out = out.reshape(Hkv, G, T, D).permute(2, 0, 1, 3).reshape(T, Hq, D)
    return out, lse.reshape(Hkv, G, T).permute(2, 0, 1).reshape(T, Hq)
