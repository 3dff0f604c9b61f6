"""A linear 4-bit weight format for the GPU that decodes by arithmetic, not by table.

Why: the NF4 GEMV is bound by its code-book lookup (21 integer ops a word of 8 codes; the loads
alone run at HBM speed, bench/RESULTS.md "4-bit linears"). Here a code c of group g stands for
(c − z_g) · s_g, which the GPU decodes with a mask and an or (`lop3`: 0x4300 | c is the bf16 of
128 + c, exactly) and two bf16x2 float ops, 7 integer ops a word (`gpu_ops.nf4_tc`, FORMAT 1).
The same bytes as NF4: 4 bits a weight and 4 bytes a group of 64.

Format (a matrix W [N, K], K a multiple of 64):

    packed  int32  [N, K/8]   8 codes a word: element 8w + 2i in nibble i, 8w + 2i + 1 in nibble
                              i + 4 (i < 4), so that a mask of 0x000F000F (after a shift by 4i)
                              leaves the pair (2i, 2i + 1) in the two bf16 halves
    sz      int32  [N, K/64]  the group's scale s as bf16 bits in the high half, 128 + z (z in
                              0..15, the code of zero) as bf16 bits in the low half
    w ≈ bf16((c − z) · s)     computed exactly in float32 and rounded once, as the kernel does

Quantization: min–max per group (Q4_1's range), with the group's largest magnitude kept exact (as
NF4's absmax is): z is ⌊−min / s₀⌋ or ⌈−min / s₀⌉ (s₀ = (max − min) / 15), s is then the one that
puts that extreme on a code, and the group keeps whichever of the two has the smaller squared
error. Rounding z instead leaves the extremes up to s/2 off, and on SmolLM2-135M that costs more
than NF4 does (teacher-forced agreement with bf16 0.68, perplexity 36.9, against NF4's 0.65 and
32.2); with the extreme exact, 0.72 and 31.5. Clipping outliers to cut the squared error (a
searched range) measured worse still. The torch functions here are the reference twin of the kernel.
"""
from __future__ import annotations

import torch

GROUP = 64


_CHUNK = 1 << 24  # weights quantized at a time, to bound the float32 temporaries (as quantize_nf4)


def quantize_q4(w: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 64, any float dtype, any device) → (packed int32 [N, K/8], sz int32
    [N, K/64]) on `device` (default: w's), a piece of rows at a time."""
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"quantize_q4 needs K divisible by {GROUP}, got {tuple(w.shape)}")
    device = w.device if device is None else torch.device(device)
    packed = torch.empty(N, K // 8, dtype=torch.int32, device=device)
    sz = torch.empty(N, K // GROUP, dtype=torch.int32, device=device)
    rows = max(1, _CHUNK // K)
    for r in range(0, N, rows):
        packed[r: r + rows], sz[r: r + rows] = _quantize_rows(w[r: r + rows].to(device))
    return packed, sz


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1).clamp(max=0.0), g.amax(-1).clamp(min=0.0)  # zero stays representable
    z0 = torch.floor(-lo / ((hi - lo) / 15).clamp_min(1e-30))
    (s, z, c, err), (s1, z1, c1, err1) = (_fit(g, lo, hi, z.clamp(1, 14)) for z in (z0, z0 + 1))
    keep = err1 < err
    bs, bz, bc = torch.where(keep, s1, s), torch.where(keep, z1, z), torch.where(keep[..., None], c1, c)
    c = bc.to(torch.int32).reshape(N, K // 8, 8)
    packed = torch.zeros(N, K // 8, dtype=torch.int32, device=w.device)
    for i in range(4):
        packed |= c[..., 2 * i] << (4 * i)
        packed |= c[..., 2 * i + 1] << (16 + 4 * i)
    s_bits = bs.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    z_bits = (bz + 128).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return packed, (s_bits << 16) | z_bits


def _fit(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, z: torch.Tensor):
    """Groups g [..., 64] with zero code z: the scale that puts the larger of lo, hi on a code
    (bf16-exact, float32), z, the codes (float32) and each group's squared error."""
    s = torch.where(hi >= -lo, hi / (15 - z), -lo / z).to(torch.bfloat16).float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale, every code z
    c = (torch.round(g / s[..., None]) + z[..., None]).clamp(0, 15)
    return s, z, c, (((c - z[..., None]) * s[..., None]).to(torch.bfloat16).float() - g).square_().sum(-1)


def dequantize_q4(packed: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_q4` → W [N, K] in dtype: bf16((c − z) · s), widened to dtype."""
    N, KW = packed.shape
    c = torch.stack([(packed >> (4 * i + 16 * h)) & 15 for i in range(4) for h in range(2)], dim=-1)  # [N, K/8, 8]
    c = c.reshape(N, KW * 8 // GROUP, GROUP).float()
    s = ((sz >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()
    z = (sz & 0xFFFF).to(torch.int16).view(torch.bfloat16).float() - 128
    return ((c - z[..., None]) * s[..., None]).to(torch.bfloat16).reshape(N, KW * 8).to(dtype)
