"""The prefill's cost model: a prompt's tokens in chunks, each chunk's GEMMs, attention, MoE
experts and copies (`prefill_seconds`), beside `planner.cost`'s decode step."""
from __future__ import annotations

from typing import Sequence

from cpu_attention.layout import KVDtype
from hetero.config import ModelConfig
from planner.cost import (GB, PREFILL_EXPERT_GBPS, PREFILL_HOST_EXPERT_GBPS, layer_groups, touched_experts, read_bytes,
                          split_experts)
from planner.hardware import HardwareProfile
from planner.plan import KVPlan, Mode, Placement
from planner.tensors import Group, Kind, expert_bytes, kv_bytes_per_token_layer
from planner.workspace import PREFILL_PIECE

PREFILL_MFU = 0.6  # share of the measured bf16 matmul rate a 4-bit prefill GEMM reaches (stated, not measured)
# Per MoE layer and prefill chunk, what the GEMMs' bytes and FLOPs leave out: the launches of the
# layer's other kernels (routing, the slots' sort, the weighted sum), which the GPU partly waits for.
# Fitted on the H200 host, 2026-11-29 (bench/moe.py, a 512-token prompt of the Qwen3-30B-A3B shape
# with every expert on the GPU: 44.0 ms; at 8 GiB 190 ms, 184 on another machine, predicted 186).
PREFILL_MOE_LAYER_S = 0.11e-3


def prefill_seconds(
    cfg: ModelConfig, hw: HardwareProfile, placements: Sequence[Placement], kv: KVPlan,
    prompt: int, ubatch: int, threads: int,
) -> float:
    """Prefill of one sequence's `prompt` tokens in chunks of `ubatch`.

    Chunk of u tokens at positions [s, s+u):
      flops  = 2 · u · Σ active params  +  L · 4 · u · (s + u/2) · q_size      (GEMMs + causal attention)
      gpu    = flops on GPU-computed groups / (MFU · bf16 matmul rate)
      cpu    = CPU-mode groups: min(2·u·params / CPU flop rate, W / PCIe)    (compute there or stream)
      split experts' host part: its experts the chunk routes to go up (h2d) and the GPU computes them
      (offload/moe.py copies them up for chunks of the plan's moe_upload_rows or more; a shorter
      chunk is computed by the CPU, like a decode step: priced here as the copy too)
      gpu   += bytes of the experts the chunk routes to / PREFILL_EXPERT_GBPS (_HOST_EXPERT_GBPS: host)
      moe    = MoE layers · PREFILL_MOE_LAYER_S                                  (not overlapped)
      h2d    = streamed W + host-tier KV written before each piece start in [s, s+u) (read back
               for attention once a piece, `PREFILL_PIECE`, as stored) / PCIe
      d2h    = host-tier KV of the chunk / PCIe
      t      = max(gpu, h2d, d2h) + cpu + moe + L · overhead                     (copies double-buffered)
    Without a GPU: t = all flops / CPU flop rate.
    """
    pairs = layer_groups(cfg, placements)
    L = cfg.num_layers
    kv_bf16 = kv_bytes_per_token_layer(cfg, KVDtype.BF16, kv.block_size)
    kv_host = kv_bytes_per_token_layer(cfg, kv.host_dtype, kv.block_size)
    active_gpu = active_cpu = streamed = cpu_bytes = host_experts = 0.0
    host_parts: list[tuple[Group, Placement]] = []
    moe_parts: list[tuple[Group, Placement]] = []
    moe_layers = sum(any(g.kind is Kind.EXPERTS for g, _ in groups) for groups in pairs.values())
    for layer, groups in pairs.items():
        for g, pl in groups:
            if g.kind is Kind.EMBED:
                continue
            act = g.params + g.small_params if g.kind is not Kind.EXPERTS else g.active_params
            if split_experts(pl):
                act = act * (pl.share if pl.share is not None else len(pl.experts) / (g.params // g.expert_params))
            if g.kind is Kind.LM_HEAD:
                act = act / ubatch  # logits of the chunk's last token only
            if g.kind is Kind.EXPERTS:
                moe_parts.append((g, pl))
            if split_experts(pl) and pl.mode is Mode.CPU:
                host_experts += act
                host_parts.append((g, pl))
            elif pl.mode is Mode.CPU:
                active_cpu += act
                cpu_bytes += pl.nbytes
            else:
                active_gpu += act
                streamed += pl.nbytes if pl.mode is Mode.STREAM else 0.0
    total, s = 0.0, 0
    while s < prompt:
        u = min(ubatch, prompt - s)
        attn_flops = L * 4.0 * u * (s + u / 2) * cfg.q_size
        if all(p.mode is Mode.CPU for p in placements):
            total += (2.0 * u * (active_gpu + active_cpu + host_experts) + attn_flops) / (hw.cpu_gflops * GB)
        else:
            gpu = (2.0 * u * (active_gpu + host_experts) + attn_flops) / (PREFILL_MFU * hw.gpu_tflops * 1e12)
            gpu += sum(touched_experts(g, pl, u) * expert_bytes(g, pl.dtype) / GB /
                       (PREFILL_HOST_EXPERT_GBPS if pl.mode is Mode.CPU and split_experts(pl) else PREFILL_EXPERT_GBPS)
                       for g, pl in moe_parts)
            cpu = min(2.0 * u * active_cpu / (hw.cpu_gflops * GB), cpu_bytes / (hw.pcie_h2d_gbps * GB))
            up = sum(read_bytes(g, pl, u) for g, pl in host_parts)
            read_back = sum(max(0, p - kv.gpu_tokens) for p in range(-(-s // PREFILL_PIECE) * PREFILL_PIECE, s + u,
                                                                     PREFILL_PIECE))
            host_chunk = max(0, s + u - max(s, kv.gpu_tokens))
            h2d = (streamed + up + L * read_back * kv_host) / (hw.pcie_h2d_gbps * GB)
            d2h = L * host_chunk * kv_bf16 / (hw.pcie_d2h_gbps * GB)
            moe = moe_layers * PREFILL_MOE_LAYER_S
            total += max(gpu, h2d, d2h) + cpu + moe + L * hw.layer_overhead_s
        s += u
    return total
