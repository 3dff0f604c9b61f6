"""The model's layer math in torch, split the way the runtime schedules it.

Per layer: `pre_attention` (norm, fused QKV projection, q/k norm, RoPE) → attention, which
the runtime computes over its paged KV tiers → `post_attention` (O projection, residual,
norm, MLP or routed experts, residual). Weights are held as `Linear` objects so that the
same math runs over dense, int8 or 4-bit weights on either device.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from hetero.config import ModelConfig


class Linear(Protocol):
    """y = x @ W.T (+ b) for x [N, in]; implementations differ in how W is stored."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Dense:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias  # [out, in], [out]
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv: Linear  # rows: q (Hq*D), k (Hkv*D), v (Hkv*D)
    o: Linear
    mlp_norm: torch.Tensor
    q_norm: torch.Tensor | None = None  # [D]
    k_norm: torch.Tensor | None = None
    gate_up: Linear | None = None  # dense MLP: rows gate (F), up (F)
    down: Linear | None = None
    router: torch.Tensor | None = None  # MoE: [E, H]
    experts: list[tuple[Linear, Linear]] = field(default_factory=list)  # (gate_up, down) per expert
    # The whole feed-forward when it is computed elsewhere, ffn(h, residual=x) → x + ffn(h) [N, H] in
    # h's dtype (offload.host_compute: by the CPU, from host copies of the weights above; offload.moe:
    # experts split between the devices); None: this module's math over the fields above.
    ffn: Linear | None = None
    routed: torch.Tensor | None = None  # MoE: [E] how often each expert was routed to, while counting


class FusedLayer(Protocol):
    """A layer's step in a few fused kernels, for weights of one format on one device (the CPU's
    int8 kernels in cpu_attention.linear, the GPU's NF4 ones in gpu_ops.fused). The loader picks
    one for the model (`Model.use_kernels`); which layers it fits is settled then, once."""

    def fits(self, lw: "LayerWeights") -> bool:
        """Whether these weights take the fused kernels at all."""

    def takes(self, lw: "LayerWeights", x: torch.Tensor) -> bool:
        """Whether a step over activations x [N, H] does (few rows, the kernels' dtype)."""

    def pre_attention(self, cfg: ModelConfig, lw: "LayerWeights", x: torch.Tensor, pos: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, kv_out: tuple | None): ...

    def post_attention(self, cfg: ModelConfig, lw: "LayerWeights", x: torch.Tensor,
                       attn: torch.Tensor) -> torch.Tensor | None:
        """The layer's output, or None where this layer's rest is not fused (the torch math runs)."""


class ElementwiseOps(Protocol):
    """One-kernel RMSNorm, in-place RoPE (and KV store), SiLU·up and projection plus residual
    (gpu_ops.fused) for CUDA bf16 activations."""

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

    def rope_(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
              D: int, norms: tuple[torch.Tensor, torch.Tensor, float, int] | None = None,
              kv_out: tuple | None = None) -> bool:
        """In place; kv_out: also store k and v in a GPU KV pool (`pre_attention`'s, with the q and
        kv head counts after it) → whether it did."""

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor: ...

    def linear_residual(self, lin: Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """residual + lin(x) in one kernel where lin's format and x's rows allow it, else None."""


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class Rope:
    """cos/sin tables for rotate-half RoPE, grown on demand; llama3 / linear scaling applied."""

    def __init__(self, cfg: ModelConfig, device: torch.device, freq_factors: torch.Tensor | None = None):
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        sc = cfg.rope_scaling
        if freq_factors is not None:  # GGUF carries llama3 scaling as per-frequency divisors
            inv = inv / freq_factors.double()
        elif sc is not None and sc.kind == "llama3":
            inv = _llama3_inv_freq(inv, sc)
        elif sc is not None and sc.kind == "linear":
            inv = inv / sc.factor
        self.inv_freq = inv
        self.device = device
        self.cos = self.sin = torch.empty(0, d, device=device)
        self.frozen = False  # tables fixed in size: no growth check, so no host sync (CUDA graphs)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cos.shape[0], 256)
        t = torch.arange(n, dtype=torch.float64)
        f = torch.outer(t, self.inv_freq)
        emb = torch.cat([f, f], dim=-1)
        self.cos = emb.cos().float().to(self.device)
        self.sin = emb.sin().float().to(self.device)

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D], grown to cover every position in pos [N]."""
        if not self.frozen and self.cos.shape[0] <= int(pos.max()):
            self._grow(int(pos.max()) + 1)
        return self.cos, self.sin

    @contextlib.contextmanager
    def positions_below(self, n: int):
        """Within: every position the caller passes is below n (it knows them), so the tables are
        grown once now and `tables` reads nothing back to the host (a prefill's layers, each a sync
        otherwise)."""
        if self.cos.shape[0] < n:
            self._grow(n)
        was, self.frozen = self.frozen, True
        try:
            yield self
        finally:
            self.frozen = was

    def fixed(self, max_pos: int) -> "Rope":
        """A copy whose tables cover positions < max_pos and never grow: calling it reads nothing
        back to the host, so it can be captured in a CUDA graph."""
        if self.cos.shape[0] < max_pos:
            self._grow(max_pos)
        frozen = copy.copy(self)
        frozen.frozen = True
        return frozen

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D], pos [N] → rotated x."""
        cos, sin = self.tables(pos)
        cos, sin = cos[pos][:, None, :], sin[pos][:, None, :]
        h = x.shape[-1] // 2
        rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
        return (x.float() * cos + rot.float() * sin).to(x.dtype)


def _llama3_inv_freq(inv: torch.Tensor, sc) -> torch.Tensor:
    low_wl = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wl = sc.original_max_position_embeddings / sc.high_freq_factor
    wl = 2 * math.pi / inv
    smooth = (sc.original_max_position_embeddings / wl - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    scaled = torch.where(wl > low_wl, inv / sc.factor, inv)
    mid = (wl <= low_wl) & (wl >= high_wl)
    return torch.where(mid, (1 - smooth) * inv / sc.factor + smooth * inv, scaled)


class Model:
    """Weights plus the per-layer math; attention itself belongs to the runtime."""

    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,  # [V, H]
        norm: torch.Tensor,
        lm_head: Linear,
        layers: list[LayerWeights],
        device: torch.device,
        act_dtype: torch.dtype = torch.float32,
        rope_freqs: torch.Tensor | None = None,
    ):
        self.cfg, self.embed_w, self.norm, self.lm_head, self.layers = cfg, embed, norm, lm_head, layers
        self.device, self.act_dtype = device, act_dtype
        self.rope = Rope(cfg, device, rope_freqs)
        self.scale = cfg.head_dim ** -0.5
        self.use_kernels(None, None)

    def use_kernels(self, fused: FusedLayer | None, ops: ElementwiseOps | None) -> None:
        """Take these kernels (None: the torch math) for the layers they fit; called by the loader,
        and again whenever a layer's weights are rebound (offload.placement)."""
        self.fused, self.ops = fused, ops
        self._fused_layers = [fused is not None and fused.fits(lw) for lw in self.layers]

    def capturable(self, rows: int) -> bool:
        """Whether a step of `rows` rows reads nothing back to the host, so that a CUDA graph can hold
        it: routed experts in this module's loop read their ids back; a feed-forward computed
        elsewhere says up to how many rows it does not (its `graph_rows`, default none)."""
        for lw in self.layers:
            if lw.ffn is not None and rows > getattr(lw.ffn, "graph_rows", 0) or lw.ffn is None and lw.router is not None:
                return False
        return True

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of token ids [N] → [N, H] on the model's device, in act_dtype."""
        w = self.embed_w
        rows = self.host_rows(ids) if w.device.type == "cpu" else w[ids.to(w.device)]
        return rows.to(self.device, self.act_dtype)

    def host_rows(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ids [N] of an embedding table in host memory, into out [N, H] (the table's dtype) or a
        new tensor. Gathered by numpy, not torch: torch's CPU indexing opens an OpenMP region even for
        one row, after which its threads spin for milliseconds on the cores that the engine's own
        threads (the host experts' pool) are computing on: Mixtral's host experts ran at about half
        their speed beside them, once a step (bench/RESULTS.md)."""
        w = self.embed_w
        idx = ids.cpu().numpy().astype(np.int64, copy=False)
        if out is None:
            out = torch.empty(len(idx), w.shape[1], dtype=w.dtype)
        np.take(w.view(torch.uint8).numpy(), idx, axis=0, out=out.view(torch.uint8).numpy())
        return out

    def pre_attention(self, i: int, x: torch.Tensor, pos: torch.Tensor, kv_out: tuple | None = None):
        """x [N, H], pos [N] → q [N, Hq, D], k, v [N, Hkv, D].

        kv_out: (k_pool, v_pool, layer, slots, block_size) of a GPU KV pool that the new k, v
        should go to; where the fused kernels can store them there themselves, they do and k, v
        come back None (the caller writes them otherwise)."""
        c, lw = self.cfg, self.layers[i]
        if self._fused_layers[i] and self.fused.takes(lw, x):  # a few kernels: norm, projection, RoPE
            cos, sin = self.rope.tables(pos)
            return self.fused.pre_attention(c, lw, x, pos, cos, sin, kv_out)
        ops = self._gpu_ops(x, lw.attn_norm)
        qkv = lw.qkv((ops or _TorchOps).rms_norm(x, lw.attn_norm, c.rms_norm_eps)).to(self.act_dtype)
        if ops is not None and qkv.is_contiguous() and c.head_dim & (c.head_dim - 1) == 0 and \
                (lw.q_norm is None or lw.q_norm.dtype == torch.bfloat16 == lw.k_norm.dtype):
            cos, sin = self.rope.tables(pos)  # q/k norms (Qwen3) and RoPE of q and k in one kernel, in place
            norms = None if lw.q_norm is None else (lw.q_norm, lw.k_norm, c.rms_norm_eps, c.num_heads)
            kv = None if kv_out is None else (*kv_out, c.num_heads, c.num_kv_heads)
            N = qkv.shape[0]
            if ops.rope_(qkv, pos, cos, sin, c.num_heads + c.num_kv_heads, c.head_dim, norms, kv):
                return qkv[:, :c.q_size].view(N, c.num_heads, c.head_dim), None, None  # k, v stored
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            return (q.view(N, c.num_heads, c.head_dim), k.view(N, c.num_kv_heads, c.head_dim),
                    v.view(N, c.num_kv_heads, c.head_dim))
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.reshape(-1, c.num_heads, c.head_dim)
        k = k.reshape(-1, c.num_kv_heads, c.head_dim)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        if lw.q_norm is not None:
            q = rms_norm(q, lw.q_norm, c.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, c.rms_norm_eps)
        return self.rope(q, pos), self.rope(k, pos), v

    def post_attention(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [N, H] residual stream, attn [N, Hq, D] → the layer's output [N, H]."""
        c, lw = self.cfg, self.layers[i]
        if self._fused_layers[i] and self.fused.takes(lw, x):  # O, norm, MLP and residuals in a few kernels
            out = self.fused.post_attention(c, lw, x, attn)
            if out is not None:
                return out
        a = attn.reshape(attn.shape[0], -1)
        ops = self._gpu_ops(x, lw.mlp_norm)
        xo = ops.linear_residual(lw.o, a, x) if ops is not None else None  # the add in the GEMV's epilogue
        x = xo if xo is not None else x + lw.o(a).to(self.act_dtype)
        h = (ops or _TorchOps).rms_norm(x, lw.mlp_norm, c.rms_norm_eps)
        if lw.ffn is not None:
            return lw.ffn(h, residual=x)
        return x + feed_forward(c, lw, h, silu_mul=ops.silu_mul if ops is not None else None)

    def _gpu_ops(self, x: torch.Tensor, w: torch.Tensor) -> ElementwiseOps | None:
        """The elementwise kernels (norm, RoPE, SiLU·up: one kernel each instead of ~7) on CUDA bf16
        activations at any row count (prefill, large batches), else None."""
        if self.ops is None or not (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
                                    and x.is_contiguous()) or torch.compiler.is_compiling():  # inductor fuses
            return None  # these itself (and mis-tracks the in-place RoPE kernel: compiled tokens differed)
        return self.ops

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] → float32 logits [N, V]."""
        return self.lm_head(rms_norm(x, self.norm, self.cfg.rms_norm_eps)).float()


class _TorchOps:  # the ops gpu_ops.fused replaces, where it does not
    rms_norm = staticmethod(rms_norm)


def feed_forward(c: ModelConfig, lw: LayerWeights, h: torch.Tensor, silu_mul=None) -> torch.Tensor:
    """The layer's MLP or routed experts over the normed h [N, H] → [N, H] (residual not added).
    silu_mul: a one-kernel silu(gate)·up over [N, 2F] (gpu_ops.fused) for the dense MLP."""
    if lw.router is not None:
        return _moe(c, lw, h)
    if silu_mul is not None:
        return lw.down(silu_mul(lw.gate_up(h))).to(h.dtype)
    return swiglu(lw.gate_up, lw.down, h)


def _moe(c: ModelConfig, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(F.linear(h.float(), lw.router.float()), dim=-1)  # [N, E]
    w, idx = probs.topk(c.num_experts_per_tok, dim=-1)
    if lw.routed is not None:
        lw.routed += torch.bincount(idx.reshape(-1), minlength=c.num_experts).to(lw.routed.device)
    if c.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        gate_up, down = lw.experts[e]
        y = swiglu(gate_up, down, h[tok])
        out.index_add_(0, tok, (y * w[tok, slot, None]).to(out.dtype))
    return out


def swiglu(gate_up: Linear, down: Linear, h: torch.Tensor) -> torch.Tensor:
    g, u = gate_up(h).chunk(2, dim=-1)
    return down((F.silu(g.float()) * u.float()).to(h.dtype)).to(h.dtype)


LinearFactory = Callable[[torch.Tensor, torch.Tensor | None], Linear]
