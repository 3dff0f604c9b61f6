"""int4 host KV in torch: the reference twins of the Numba append (`append.py`) and the
dequantization every reader of an int4 pool goes through (see `layout.py` for the layout).

Values are quantized per token, in groups of 32 along the head dim, after the fixed rotation
of `rotation.py`. Keys are quantized per channel over the tokens of a block (KIVI's split):
after RoPE a key's few large channels carry a near-constant offset and the rest vary, so one
step per group of 32 channels (what values use) is far too coarse for the small channels;
one step per channel follows each channel's own spread over the block's tokens. On
SmolLM2-135M (bench/kv_accuracy.py) that lifts argmax agreement with bf16 KV from ~0.90
(per-token groups, rotated, clip search) to ~0.96.

Keys arrive one token at a time, so a block's per-channel range grows as tokens come: when a
new key falls outside a channel's grid (by more than half a step) the channel's range is
widened to include it and the codes already in the block are re-rounded onto the new grid
(from their dequantized values: the originals are gone). `append_keys` states the rule.
"""
from __future__ import annotations

import torch

from cpu_attention import rotation

GROUP = 32  # values: elements per (scale, zero) group; also the nibble interleave unit
CLIPS = (1.0, 0.94, 0.88, 0.82)  # values: range shrink factors tried per group
MIN_SCALE = 2.0**-100  # the scale of a constant range: keeps (x - zero) / scale finite


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., D] (0..15) → bytes [..., D/2]: byte 16g + i holds element 32g + i in its low
    nibble and 32g + 16 + i in its high one."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2, GROUP // 2)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*codes.shape[:-1], codes.shape[-1] // 2)


def unpack(data: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: bytes [..., D/2] → codes [..., D] (uint8)."""
    lo = (data & 0xF).reshape(*data.shape[:-1], -1, GROUP // 2)
    hi = (data >> 4).reshape(*data.shape[:-1], -1, GROUP // 2)
    return torch.stack([lo, hi], dim=-2).reshape(*data.shape[:-1], data.shape[-1] * 2)


def quantize_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] → (bytes [..., D/2], scale, zero [..., D/32] bf16) of x @ R, per group of 32."""
    y = rotation.rotate(x.float())
    g = y.reshape(*y.shape[:-1], -1, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    # Clip search: of a few ranges shrunk towards the group's centre, keep the one with the
    # least squared error (clipping the two extremes often beats 16 coarser levels; ~10%
    # lower rms error on gaussian groups than plain min-max).
    best_err = best_scale = best_zero = best_codes = None
    for f in CLIPS:
        c = (hi + lo) / 2
        scale = ((hi - lo) * f / 15.0).clamp_min(MIN_SCALE).to(torch.bfloat16)
        zero = (c - (hi - lo) * f / 2).to(torch.bfloat16)
        sf, zf = scale.float()[..., None], zero.float()[..., None]
        codes = torch.round((g - zf) / sf).clamp(0, 15)
        err = ((codes * sf + zf - g) ** 2).sum(-1)
        if best_err is None:
            best_err, best_scale, best_zero, best_codes = err, scale, zero, codes
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
            best_codes = torch.where(better[..., None], codes, best_codes)
    return pack(best_codes.reshape(y.shape)), best_scale, best_zero


def dequantize_values(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_values` up to rounding: [..., D] float32, rotated back."""
    g = unpack(data).float().reshape(*data.shape[:-1], -1, GROUP)
    y = g * scale.float()[..., None] + zero.float()[..., None]
    return rotation.unrotate(y.reshape(*data.shape[:-1], data.shape[-1] * 2))


def dequantize_keys(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Keys of whole blocks: bytes [..., BS, D/2], scale, zero [..., D] → [..., BS, D] float32."""
    return unpack(data).float() * scale.float()[..., None, :] + zero.float()[..., None, :]


def append_keys(
    data: torch.Tensor,  # [NB, Hkv, BS, D/2] uint8, one layer's key codes (updated in place)
    scale: torch.Tensor,  # [NB, Hkv, D] bfloat16 (in place)
    zero: torch.Tensor,  # [NB, Hkv, D] bfloat16 (in place)
    blocks: torch.Tensor,  # [T] block of each new token
    offs: torch.Tensor,  # [T] offset in its block
    x: torch.Tensor,  # [T, Hkv, D] the new keys
) -> None:
    """Write keys at (blocks, offs), the rule the Numba append follows bit for bit:

    Per block the call writes to, its tokens X taken together, per head and channel:
    - a write at offset 0 starts the block: the range is [min X, max X];
    - otherwise, if some x of X lies outside the grid [zero - scale/2, zero + 15.5 scale],
      the range becomes [min(zero, min X), max(zero + 15 scale, max X)] and the codes at
      every offset of the block are re-rounded: code' = round((code * scale + zero - zero') / scale');
    - a new range gives scale' = bf16(max(range / 15, MIN_SCALE)), zero' = bf16(range start);
    - then code = clamp(round((x - zero) / scale), 0, 15) for the new tokens.
    Tokens of a block must be written in order (a write at offset 0 discards what the block
    held), which is how the cache fills its blocks.
    """
    x = x.float()
    codes_all = unpack(data)  # [NB, Hkv, BS, D]
    for b in torch.unique(blocks).tolist():
        sel = blocks == b
        xs, os_ = x[sel], offs[sel]  # [m, Hkv, D], [m]
        xmin, xmax = xs.amin(0), xs.amax(0)  # [Hkv, D]
        s, z = scale[b].float(), zero[b].float()
        codes = codes_all[b].float()  # [Hkv, BS, D]
        if bool((os_ == 0).any()):
            lo, hi, grow = xmin, xmax, torch.ones_like(xmin, dtype=torch.bool)
        else:
            grow = (xmin < z - s / 2) | (xmax > z + 15.5 * s)
            lo, hi = torch.minimum(z, xmin), torch.maximum(z + 15 * s, xmax)
            s2 = ((hi - lo) / 15).clamp_min(MIN_SCALE).to(torch.bfloat16).float()
            z2 = lo.to(torch.bfloat16).float()
            old = codes * s[:, None] + z[:, None]
            re = torch.round((old - z2[:, None]) / s2[:, None]).clamp(0, 15)
            codes = torch.where(grow[:, None], re, codes)
        s = torch.where(grow, ((hi - lo) / 15).clamp_min(MIN_SCALE).to(torch.bfloat16).float(), s)
        z = torch.where(grow, lo.to(torch.bfloat16).float(), z)
        new = torch.round((xs - z) / s).clamp(0, 15)  # [m, Hkv, D]
        codes[:, os_] = new.transpose(0, 1)
        codes_all[b] = codes.to(torch.uint8)
        scale[b], zero[b] = s.to(torch.bfloat16), z.to(torch.bfloat16)
    data.copy_(pack(codes_all))
