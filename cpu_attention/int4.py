"""int4 host KV: the format's arithmetic in torch, the reference twin of the Numba append
(`append.py`) and what every reader of an int4 pool dequantizes with (the pool: `layout.py`).

Bytes, per layer, block b and kv head h (L layers, NB blocks, BS tokens a block, D head dim,
a multiple of 32; all tensors C-contiguous, bf16 stored as its 16 bits):

    k[b, h]        uint8 [D/8, BS, 4]  key codes in the VNNI order: byte (r, o, j) holds channel
                                       8r + j of token o in its low nibble, 8r + 4 + j in its high
    k_scale[b, h]  bf16  [D]           per channel over the block's BS keys:
    k_zero[b, h]   bf16  [D]             k[o, d] ≈ code(o, d) · k_scale[d] + k_zero[d]
    v[b, h]        uint8 [BS4/4, D/2, 4]  codes of y = v @ R, the value rotated (`rotation.py`),
                                       in quads of 4 tokens: byte (u, c, j) is byte c of token
                                       4u + j's packed row (BS4: BS rounded up to 4; padding 0)
    v_scale[b, h]  bf16  [BS, D/32]    per token and group of 32 channels of y:
    v_zero[b, h]   bf16  [BS, D/32]      y[o, 32g + i] ≈ code · v_scale[o, g] + v_zero[o, g]

    a packed row: byte 16g + i (g < D/32, i < 16) holds code 32g + i in its low nibble and
    code 32g + 16 + i in its high one. So a 64-byte load of a quad is one group's 16 bytes of 4
    tokens: a 32-bit lane holds 4 tokens of channels 32g + i and 32g + 16 + i, and two masks give
    the 4 tokens' codes of 16 channels as bytes, one vpdpbusd each against the 4 tokens' weights
    (as int8's values). Keys: a 32-bit lane is 8 channels of one token, so one 16-lane load is
    16 tokens × 8 channels, and a mask and a shift give each token's channel pairs as 16-bit
    lanes for pmaddwd: 16 tokens' scores a vector with no horizontal sums (`_simd_int4`). Codes
    are 0..15, unsigned.

    tails.slot[l, b]  int32             −1 once block b of layer l is quantized, else the slot
    tails.k[s], .v[s] bf16 [Hkv, BS, D] of its tail: the tokens written so far, keys as given,
                                        values as y; the codes of such a block are stale

So a token costs Hkv · (D + D/8 + 4D/BS) + 4/BS bytes a layer (codes, value scales and zeros,
its share of the block's key scales, zeros and slot entry; `layout.token_bytes`; a BS not a
multiple of 4 adds its value padding), plus one tail
of 4 · Hkv · BS · D bytes per sequence and layer being filled (`layout.tail_bytes`).

Scales: values take the (scale, zero) of least squared error among [min, max] shrunk about
its centre by the CLIPS factors; keys take zero = min, scale = (max − min) / 15. Both are
rounded to bf16 first and the codes rounded against the rounded pair, so the rounding only
moves the grid (bf16, not f16: widening is a 16-bit shift, and its 8-bit mantissa is still
far finer than 16 levels).

Why keys differ from the issue's "scale (and zero) per group of 32 along the head dim":
after RoPE a key's few large channels carry a near-constant offset and the rest vary, so
one step per group of 32 channels is far too coarse for the small ones. Measured on SmolLM2
(teacher-forced argmax agreement with bf16 KV, `bench/kv_accuracy.py`; the target is 0.95):
keys in per-token groups of 32 reached 0.86 plain and ~0.90 rotated with the clip search;
per channel over a block as its tokens came (ranges grown and codes re-rounded) 0.93–0.95;
per channel over a complete block (KIVI) with the block being filled kept in bf16 (KIVI's
residual), this layout, 0.974 over the 312-token text (perplexity 23.25, bf16 KV 23.23),
0.97–0.985 over three rotation seeds. The rotation spreads the values' outlier channels
(0.936 → 0.958 in a simulation, values alone quantized).

A block is quantized when it is complete: until its last offset is written, its tokens live
in the bf16 tail, so the most recent tokens of a sequence are read at bf16 precision.
`write` states the rule; `Tails` holds the tails.
"""
from __future__ import annotations

import numpy as np
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


def quads(rows_: torch.Tensor) -> torch.Tensor:
    """A block's packed value rows [..., BS, D/2] → the VNNI value order [..., BS4/4, D/2, 4] (the
    module doc's; BS4 = BS rounded up to 4, the padding rows 0)."""
    *lead, BS, H = rows_.shape
    BS4 = -(-BS // 4) * 4
    if BS4 != BS:
        rows_ = torch.cat([rows_, rows_.new_zeros((*lead, BS4 - BS, H))], -2)
    return rows_.reshape(*lead, BS4 // 4, 4, H).transpose(-1, -2).contiguous()


def unquads(data: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of `quads`: [..., BS4/4, D/2, 4] → packed rows [..., BS, D/2]."""
    *lead, Q, H, _ = data.shape
    return data.transpose(-1, -2).reshape(*lead, 4 * Q, H)[..., :block_size, :]


def pack_keys(codes: torch.Tensor) -> torch.Tensor:
    """A block's key codes [..., BS, D] (0..15) → bytes [..., D/8, BS, 4] (the module doc's order)."""
    *lead, BS, D = codes.shape
    c = codes.to(torch.uint8).reshape(*lead, BS, D // 8, 2, 4)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(-3, -2).contiguous()


def unpack_keys(data: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_keys`: bytes [..., D/8, BS, 4] → codes [..., BS, D] (uint8)."""
    *lead, R, BS, _ = data.shape
    x = data.transpose(-3, -2)  # [..., BS, D/8, 4]
    return torch.stack([x & 0xF, x >> 4], dim=-2).reshape(*lead, BS, 8 * R)


def quantize_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated values y [..., D] → (bytes [..., D/2], scale, zero [..., D/32] bf16) per group of 32."""
    g = y.float().reshape(*y.shape[:-1], -1, GROUP)
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


def rows(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_rows` up to rounding: [..., D] float32, still rotated."""
    g = unpack(data).float().reshape(*data.shape[:-1], -1, GROUP)
    return (g * scale.float()[..., None] + zero.float()[..., None]).reshape(*data.shape[:-1], -1)


def block_rows(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """`rows` of whole blocks as the pool stores them: data [..., BS4/4, D/2, 4], scale, zero
    [..., BS, D/32] → [..., BS, D] float32, still rotated."""
    return rows(unquads(data, scale.shape[-2]), scale, zero)


def quantize_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values x [..., D] as a complete block stores them: rotated, rounded to bf16, per row."""
    return quantize_rows(rotation.rotate(x).to(torch.bfloat16))


def dequantize_values(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Values of complete blocks → [..., D] float32, rotated back."""
    return rotation.unrotate(rows(data, scale, zero))


def quantize_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys of whole blocks x [..., BS, D] (bf16 values) → (bytes [..., D/8, BS, 4], scale,
    zero [..., D] bf16): per channel, range [min, max] over the block's BS tokens."""
    x = x.float()
    lo, hi = x.amin(-2), x.amax(-2)
    scale = ((hi - lo) / 15).clamp_min(MIN_SCALE).to(torch.bfloat16)
    zero = lo.to(torch.bfloat16)
    codes = torch.round((x - zero.float()[..., None, :]) / scale.float()[..., None, :]).clamp(0, 15)
    return pack_keys(codes), scale, zero


def dequantize_keys(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Keys of whole blocks: bytes [..., D/8, BS, 4], scale, zero [..., D] → [..., BS, D] float32."""
    return unpack_keys(data).float() * scale.float()[..., None, :] + zero.float()[..., None, :]


class Tails:
    """bf16 copies of the blocks being filled: S slots shared by all layers (grown on demand,
    never shrunk), a slot table per layer and a stack of free slots."""

    def __init__(self, L: int, NB: int, H: int, BS: int, D: int):
        self.k = torch.zeros((0, H, BS, D), dtype=torch.bfloat16)  # [S, Hkv, BS, D]: keys as written
        self.v = torch.zeros((0, H, BS, D), dtype=torch.bfloat16)  # [S, Hkv, BS, D]: values @ R
        self.slot = torch.full((L, NB), -1, dtype=torch.int32)  # (layer, block)'s slot, -1: none
        self.free = np.zeros(0, np.int32)  # [S]: the free slots are free[:n_free[0]] (a stack)
        self.n_free = np.zeros(1, np.int64)
        self._views()

    def _views(self) -> None:
        """`arrays`: what the Numba kernels take (bf16 as uint16 bits), remade when S grows."""
        u16 = lambda t: t.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
        self.arrays = dict(k=u16(self.k), v=u16(self.v), slot=self.slot.numpy(), free=self.free, n_free=self.n_free)

    @property
    def nbytes(self) -> int:
        """The slots' bytes (the slot table is counted by the pool)."""
        return 2 * self.k.numel() * 2 + self.free.nbytes

    def reserve(self, n: int) -> None:
        """At least n free slots (doubling S as needed)."""
        if int(self.n_free[0]) >= n:
            return
        S = self.k.shape[0]
        S2 = max(2 * S, S + n - int(self.n_free[0]), 8)
        grow = lambda t: torch.cat([t, t.new_zeros((S2 - S, *t.shape[1:]))])  # noqa: E731
        self.k, self.v = grow(self.k), grow(self.v)
        free = np.zeros(S2, np.int32)
        nf = int(self.n_free[0])
        free[:nf] = self.free[:nf]
        free[nf:nf + S2 - S] = np.arange(S2 - 1, S - 1, -1, dtype=np.int32)  # new slots, low ids on top
        self.free, self.n_free[0] = free, nf + S2 - S
        self._views()

    def pop(self) -> int:
        self.n_free[0] -= 1
        return int(self.free[self.n_free[0]])

    def push(self, s: int) -> None:
        self.free[self.n_free[0]] = s
        self.n_free[0] += 1

    def release(self, blocks: list[int]) -> None:
        """Blocks given back to the pool's allocator: their tails (any layer) become free slots."""
        if not blocks:
            return
        slot = self.arrays["slot"]
        b = np.asarray(blocks, np.int64)
        held = slot[:, b]
        for s in held[held >= 0].tolist():
            self.push(s)
        slot[:, b] = -1


def slots_needed(tail_slot: np.ndarray, blocks: np.ndarray, offs: np.ndarray, BS: int) -> int:
    """Free slots a write to (blocks, offs) takes at its peak (`write` frees a completed block's
    slot before it opens the next block): one per block without a tail that stays incomplete,
    plus one if some block without a tail is completed."""
    ub, inv = np.unique(blocks, return_inverse=True)
    ends = np.zeros(len(ub), bool)
    ends[inv[offs == BS - 1]] = True
    new = tail_slot[ub] < 0
    return int((new & ~ends).sum()) + int((new & ends).any())


def write(pool, layer: int, blocks: torch.Tensor, offs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Torch twin of the Numba int4 append (same bits, same slots). Per block the call writes
    to, in order of block id, its tokens in call order:

    1. the block takes a tail slot if it has none (the free stack's top); if the call does not
       write its offset 0, the block held finished tokens: they are dequantized into the tail
       first (keys and rotated values, rounded to bf16);
    2. each token goes into the tail: key rounded to bf16, value rotated then rounded;
    3. if the call wrote the block's last offset, the whole tail is quantized (keys per
       channel over the BS rows, values per row and group) and the slot is pushed back.

    Tokens of a block must come in order: a block's rows are quantized as they stand when its
    last offset is written."""
    t = pool.tails
    L = layer
    BS = pool.block_size
    order = np.argsort(blocks.numpy(), kind="stable")
    t.reserve(slots_needed(t.slot[L].numpy(), blocks.numpy(), offs.numpy(), BS))
    for b in dict.fromkeys(blocks.numpy()[order].tolist()):
        sel = torch.from_numpy(order[blocks.numpy()[order] == b])
        os_ = offs[sel]
        s = int(t.slot[L, b])
        if s < 0:
            s = t.pop()
            t.slot[L, b] = s
            if not bool((os_ == 0).any()):
                t.k[s] = dequantize_keys(pool.k[L, b], pool.k_scale[L, b], pool.k_zero[L, b]).to(torch.bfloat16)
                t.v[s] = block_rows(pool.v[L, b], pool.v_scale[L, b], pool.v_zero[L, b]).to(torch.bfloat16)
        t.k[s][:, os_] = k[sel].float().transpose(0, 1).to(torch.bfloat16)
        t.v[s][:, os_] = rotation.rotate(v[sel].float()).transpose(0, 1).to(torch.bfloat16)
        if bool((os_ == BS - 1).any()):
            pool.k[L, b], pool.k_scale[L, b], pool.k_zero[L, b] = quantize_keys(t.k[s])
            data, pool.v_scale[L, b], pool.v_zero[L, b] = quantize_rows(t.v[s])
            pool.v[L, b] = quads(data)
            t.push(s)
            t.slot[L, b] = -1


def gather(pool, layer: int | slice, block_table: torch.Tensor,
           device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of whole blocks [nb, Hkv, BS, D] float32 (values rotated back), a block being
    filled read from its tail; layer a slice: [layers, nb, Hkv, BS, D]. On `device` (default the
    pool's): the codes, scales and tails go there as stored and are dequantized there."""
    L = layer
    up = lambda t: t.to(device or t.device)  # noqa: E731
    k = dequantize_keys(*(up(t[L, block_table]) for t in (pool.k, pool.k_scale, pool.k_zero)))
    y = block_rows(*(up(t[L, block_table]) for t in (pool.v, pool.v_scale, pool.v_zero)))
    slot = pool.tails.slot[L, block_table].long()
    tail = slot >= 0
    if bool(tail.any()):
        k[up(tail)] = up(pool.tails.k[slot[tail]]).float()
        y[up(tail)] = up(pool.tails.v[slot[tail]]).float()
    return k, rotation.unrotate(y)
