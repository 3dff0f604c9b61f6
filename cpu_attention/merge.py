"""Merge two attention partials over disjoint token sets by their log-sum-exp.

o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b}), computed from the larger lse so
nothing overflows; a partial over no tokens (lse = -inf) contributes nothing. Pure torch,
so the same function serves on the CPU and on the GPU.
"""
from __future__ import annotations

import torch


def merge_attention(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """o_* [..., D], lse_* [...] → merged (o [..., D], lse [...]) in o_a's dtype."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both empty: keep weights finite
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    denom = wa + wb
    lse = m + torch.log(denom)
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)
    o = (o_a.float() * (wa / denom)[..., None] + o_b.float() * (wb / denom)[..., None]).to(o_a.dtype)
    return o, lse
