"""GPU memory a plan keeps besides weights and KV (`workspace_bytes`), and the piece of host
experts a MoE prefill copies up at once, which it counts (`moe_host_piece_bytes`; offload/moe.py
copies by it).
"""
from __future__ import annotations

from hetero.config import ModelConfig
from planner.plan import Workload


MOE_HOST_PIECE_BYTES = 64 * 2**20  # host experts a prefill chunk copies up at once (two in flight: offload/moe.py)
# Tokens of a prompt the runtime prefills layer by layer before the next piece starts (offload/prefill.py):
# each piece reads a layer's earlier KV back once (planner/prefill_cost.py prices it so).
PREFILL_PIECE = 8192


def moe_host_piece_bytes(cfg: ModelConfig) -> int:
    """The bytes of a piece of host experts going up for a prefill: MOE_HOST_PIECE_BYTES, or one
    expert (int4, its scales included) where that is larger; 0 for a dense model."""
    if not cfg.num_experts:
        return 0
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * (0.5 + 4 / 64)
    return int(max(MOE_HOST_PIECE_BYTES, expert))


def workspace_bytes(cfg: ModelConfig, wl: Workload) -> int:
    """GPU memory besides weights and KV: a prefill chunk's activations (bf16: residual, norm,
    q, k, v, attention out, gate, up; for MoE also each routed slot's expert output, which the
    grouped GEMM writes before the weighted sum: gpu_ops.moe_prefill), the largest dequantized
    matrix of a 4-bit prefill GEMM, two pieces of host experts going up (MoE), and the logits
    (f32) of a decode step."""
    inter = max(cfg.intermediate_size, cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    slots = cfg.num_experts_per_tok * cfg.hidden_size if cfg.num_experts else 0
    acts = wl.ubatch * (4 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + 2 * inter + slots) * 2
    dequant = 2 * cfg.hidden_size * max(cfg.intermediate_size, cfg.q_size, cfg.moe_intermediate_size)
    logits = max(wl.batch, 1) * cfg.vocab_size * 4
    return acts + dequant + 2 * moe_host_piece_bytes(cfg) + logits + 256 * 2**20  # + allocator slack, graphs' pools
