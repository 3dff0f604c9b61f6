"""The weight groups a placement decides about, with their sizes, derived from the config.

A group is the unit the runtime moves as a whole: per layer its attention projections, its
MLP (or router + experts), its norms; plus the embedding, the final norm and lm_head. Sizes
come from the config alone, so a plan never needs tensor data.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from cpu_attention.layout import KVDtype, tail_bytes, token_bytes
from hetero.config import ModelConfig

NF4_BLOCK = 64  # bitsandbytes NF4: one fp32 absmax per 64 weights


class Kind(str, enum.Enum):
    EMBED = "embed"
    ATTN = "attn"  # q, k, v, o projections (+ biases, q/k norms)
    MLP = "mlp"  # gate, up, down
    EXPERTS = "experts"  # router + every expert's gate, up, down
    NORMS = "norms"  # input and post-attention RMSNorm
    FINAL_NORM = "final_norm"
    LM_HEAD = "lm_head"


class WDtype(str, enum.Enum):
    NF4 = "nf4"  # bitsandbytes, GPU
    Q4 = "q4"  # linear 4-bit (gpu_ops.q4), GPU: NF4's bytes, decoded by arithmetic; experts stay NF4
    INT8 = "int8"  # per-row scale, the CPU kernel (cpu_attention.linear)
    INT4 = "int4"  # a scale per 64 weights, the CPU's expert kernel (cpu_attention.experts)
    BF16 = "bf16"
    F32 = "f32"

    def nbytes(self, params: int, rows: int = 0) -> int:
        """Bytes of `params` weights in `rows` output rows (int8 keeps a fp32 scale a row)."""
        if self in (WDtype.NF4, WDtype.Q4, WDtype.INT4):
            return params // 2 + 4 * (-(-params // NF4_BLOCK))
        if self is WDtype.INT8:
            return params + 4 * rows
        return params * (2 if self is WDtype.BF16 else 4)


GPU_4BIT = frozenset({WDtype.NF4, WDtype.Q4})  # the GPU's 4-bit formats (gpu_ops.nf4.NF4Linear's codes)
# Groups whose matrices a 4-bit linear can take; the rest (lookups, norms, biases) stay 16-bit.
QUANTIZABLE = frozenset({Kind.ATTN, Kind.MLP, Kind.EXPERTS, Kind.LM_HEAD})


@dataclass(frozen=True)
class Group:
    layer: int  # -1 for embed, final norm, lm_head
    kind: Kind
    params: int  # weights a 4-bit linear would take (matrices)
    small_params: int  # weights always kept 16-bit (biases, norms, router)
    active_params: int  # params one token reads (MoE: top-k experts + router)
    expert_params: int = 0  # one expert's params (MoE only)
    rows: int = 0  # output rows of the matrices (int8 stores a scale per row)

    @property
    def name(self) -> str:
        return self.kind.value if self.layer < 0 else f"layers.{self.layer}.{self.kind.value}"

    def nbytes(self, dtype: WDtype) -> int:
        return dtype.nbytes(self.params, self.rows) + WDtype.BF16.nbytes(self.small_params)

    def dtype_for(self, weights: WDtype) -> WDtype:
        if self.kind is Kind.EXPERTS and weights is WDtype.Q4:
            return WDtype.NF4  # the GPU's grouped expert kernels read NF4
        return weights if self.kind in QUANTIZABLE else WDtype.BF16


def weight_groups(cfg: ModelConfig) -> list[Group]:
    """Embedding, per layer (attn, mlp|experts, norms), final norm, lm_head."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    attn = h * q + 2 * h * kv + q * h
    attn_small = (q + 2 * kv if cfg.attention_bias else 0) + (2 * cfg.head_dim if cfg.qk_norm else 0)
    mlp = 3 * h * cfg.intermediate_size
    out = [Group(-1, Kind.EMBED, 0, cfg.vocab_size * h, h)]  # a lookup reads one row a token
    for i in range(cfg.num_layers):
        out.append(Group(i, Kind.ATTN, attn, attn_small, attn + attn_small, rows=q + 2 * kv + h))
        if cfg.moe_layers[i]:
            one = 3 * h * cfg.moe_intermediate_size
            router = h * cfg.num_experts
            out.append(Group(i, Kind.EXPERTS, one * cfg.num_experts, router, one * cfg.num_experts_per_tok + router,
                             expert_params=one, rows=cfg.num_experts * (2 * cfg.moe_intermediate_size + h)))
        else:
            out.append(Group(i, Kind.MLP, mlp, 0, mlp, rows=2 * cfg.intermediate_size + h))
        out.append(Group(i, Kind.NORMS, 0, 2 * h, 2 * h))
    out.append(Group(-1, Kind.FINAL_NORM, 0, h, h))
    # A tied lm_head shares the checkpoint's embedding, but its 4-bit copy is its own tensor.
    out.append(Group(-1, Kind.LM_HEAD, cfg.vocab_size * h, 0, cfg.vocab_size * h, rows=cfg.vocab_size))
    return out


def total_params(cfg: ModelConfig) -> int:
    """Parameters as the checkpoint stores them (a tied lm_head counted once)."""
    n = sum(g.params + g.small_params for g in weight_groups(cfg))
    return n - (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)


def experts_touched(E: int, k: int, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens route to (top-k of E), routing taken as
    uniform: E · (1 − (1 − k/E)^tokens)."""
    return E * (1.0 - (1.0 - k / E) ** tokens) if E else 0.0


def kv_bytes_per_token_layer(cfg: ModelConfig, dtype: KVDtype, block_size: int) -> float:
    """K and V of one token in one layer as the host pool stores them (`cpu_attention.layout.
    token_bytes`): scales and zeros included, int4's per-block key scales at this block size."""
    return token_bytes(dtype, cfg.num_kv_heads, cfg.head_dim, block_size)


def kv_bytes_per_seq_layer(cfg: ModelConfig, dtype: KVDtype, block_size: int) -> int:
    """Host bytes a sequence adds per layer besides its tokens: int4's bf16 tail of the block
    being filled (`cpu_attention.layout.tail_bytes`), 0 for the other dtypes."""
    return tail_bytes(dtype, cfg.num_kv_heads, cfg.head_dim, block_size)


def cpu_dtype(weights: WDtype, kind: Kind | None = None) -> WDtype:
    """What a host-computed matrix is stored as: experts in int4 beside 4-bit GPU weights (the
    CPU's expert kernel reads that format), other groups in int8 (the CPU has no 4-bit GEMV)."""
    if weights in GPU_4BIT:
        return WDtype.INT4 if kind is Kind.EXPERTS else WDtype.INT8
    return weights


def expert_bytes(g: Group, dtype: WDtype) -> int:
    """One expert's bytes in dtype (an experts group's matrices are E equal experts)."""
    E = g.params // g.expert_params
    return dtype.nbytes(g.expert_params, g.rows // E)


def router_bytes(g: Group) -> int:
    return WDtype.BF16.nbytes(g.small_params)
