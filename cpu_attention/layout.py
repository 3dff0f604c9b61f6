"""The KV block format of both tiers: the tensors of a bf16, int8 or int4 pool, and quantizing
into them (the host pool itself: `pool.py`; the device pool: `gpu_ops.kv_pool`).

Layout (one pool holds every layer; a block id means the same tokens in every layer, so a
sequence has one block table):

    dtype  tensor            torch dtype  shape                        meaning
    f32    k, v              float32      [L, NB, Hkv, BS, D]          exact, for checks against float32 references
    bf16   k, v              bfloat16     [L, NB, Hkv, BS, D]          bf16 bits; kernels read them as uint16
    int8   k                 int8         [L, NB, Hkv, D/4, BS, 4]     round(y / scale) of y = x @ R (`rotation.py`),
                                                                        channel 4c+j of token t at [c, t, j]
           v                 int8         [L, NB, Hkv, BS4/4, D, 4]    the same codes of values, token 4u+j's
                                                                        channel d at [u, d, j] (BS4: BS rounded up to 4)
           k_scale, v_scale  float32      [L, NB, Hkv, BS]             max|y| / 127 per token and head
    int4   k                 uint8        [L, NB, Hkv, D/8, BS, 4]     key codes, two a byte (`int4.py`: the VNNI
                                                                        order, 8 channels of a token a 32-bit lane)
           k_scale, k_zero   bfloat16     [L, NB, Hkv, D]              per block and channel: k ≈ code · scale + zero
           v                 uint8        [L, NB, Hkv, BS4/4, D/2, 4]  codes of y = v @ R (`rotation.py`), quads of 4
                                                                        tokens' packed rows, byte by byte (`int4.py`)
           v_scale, v_zero   bfloat16     [L, NB, Hkv, BS, D // 32]    per token and group of 32: y ≈ code · scale + zero
           tails.slot        int32        [L, NB]                      the block's tail slot; −1: the block is quantized
           tails.k, tails.v  bfloat16     [S, Hkv, BS, D]              blocks being filled, unquantized (keys, y); S grows

L layers, NB blocks, Hkv kv heads, BS tokens a block, D head dim. Token t of a sequence lives
in block `block_table[t // BS]` at offset `t % BS`; its flat slot is `block * BS + offset`.
Within a block one head's BS × D values are contiguous, so a decode kernel walking one
(sequence, kv head) streams contiguous runs of BS × D elements.

int8's byte order is the one x86's vpdpbusd wants (`_simd_vnni.py`): four bytes a 32-bit lane,
a key's four channels or a channel's four tokens, so one instruction adds four products to
each of 16 tokens' scores or 16 channels' outputs, with no horizontal sums and no shuffles.
D % 4 == 0; `int8_rows` gives the codes back in token order [..., BS, D]. int4 keys use the
same idea (`int4.py`): a 32-bit lane holds 8 channels of one token, so a vector of lanes is
16 tokens' channels and the scores need no horizontal sums; `int4.unpack_keys` gives them back.
int4 values come in quads of 4 tokens like int8's (a 32-bit lane: 4 tokens of two channels);
`int4.unquads` gives the rows back.

Bytes of one token's K and V in one layer (`token_bytes`, what the planner counts): f32
8·Hkv·D, bf16 4·Hkv·D, int8 2·Hkv·(D + 4), int4 Hkv·(D + D/8 + 4·D/BS) + 4/BS (codes, value
scales and zeros, the block's key scales and zeros and its tail-slot entry spread over its BS
tokens; Hkv 8, D 128, BS 16: 1408.25 bytes, 2/3 of int8's 2112), plus for int4 one tail per
sequence being filled and layer, 4·Hkv·BS·D bytes (`tail_bytes`). For int8 and int4, BS a
multiple of 4; else V's padding tokens too.

int8 keys and values are stored rotated by the fixed orthonormal R (`rotation.py`), the
issue's format (a scale per token and head) otherwise unchanged. A RoPE'd key has a few
channels several times larger than the rest, and max|x| / 127 spends the 255 levels on them:
rotated, a token's channels are near gaussian (max/rms 4.6 → 2.5 on SmolLM2's keys) and the
rounding error falls by half for keys (1.05% → 0.56% rms of the key), by a fifth for values;
end to end, KL of int8 KV's next-token distribution from bf16 KV's 5.5e-4 → 1.5e-4
(bench/RESULTS.md). q · k = (q R) · (k R) and Σ p (v R) = (Σ p v) R, so readers rotate q once
per step and the output back once per (sequence, head): the decode kernel itself is the same.

int4 (`int4.py` gives the exact bytes, says why, and states the append rule): values per
token in groups of 32 along the head dim, as the issue prescribes, after a fixed orthonormal
rotation R that spreads outlier channels; keys per channel over each block's tokens (KIVI),
because per-token groups of 32 lose too much on real keys; a block is quantized once
complete, until then its tokens stay in a bf16 tail. The rotation is internal to the pool:
`write` rotates values, `gather` rotates them back, the decode kernel rotates its output
back. Blocks freed by the cache must be `release`d, so their tails go back to the free slots.

Which parts a dtype stores rotated: `KVDtype.rotated` (int8 keys and values, int4 values).
The rotation is internal to the pool: `write` rotates, `gather`/`blocks` rotate back; a
reader of the stored codes (the decode kernel, the streamer) rotates q and its output instead.

Memory: every pool tensor of 2 MiB or more is mapped in 2 MiB pages where the OS gives them
(`host_memory.zeros`, pinned too): a block table points anywhere in the pool, and in 4 KiB pages
most of int4's six short runs a block and head were TLB misses (int4 1.09–1.13× from DRAM in
2 MiB pages, int8 up to 1.05×, on the GPU host).

`quantize`/`dequantize` are the per-token formats (bf16, int8, int4 values), int8's and
int4's including the rotation; int4 blocks go through `int4.write` / `int4.gather`, and
whole complete blocks of any dtype through `dequantize_blocks` (the streamer does that on
the GPU).
"""
from __future__ import annotations

import enum

import torch

from cpu_attention import int4, rotation
from cpu_attention.int4 import GROUP as INT4_GROUP

HALF = (torch.bfloat16, torch.float16)  # stored as bits; the kernels read them as uint16


class KVDtype(str, enum.Enum):
    F32 = "f32"  # exact: for checking against a float32 reference, not for speed
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def rotated(self) -> tuple[bool, bool]:
        """(keys, values): whether the pool stores them as x @ R (`rotation.py`, module doc)."""
        return {KVDtype.INT8: (True, True), KVDtype.INT4: (False, True)}.get(self, (False, False))

    @property
    def bytes_per_value(self) -> float:
        """Bytes of one stored K or V code, without scales, zeros or tails (`token_bytes` has them)."""
        return {KVDtype.F32: 4.0, KVDtype.BF16: 2.0, KVDtype.INT8: 1.0, KVDtype.INT4: 0.5}[self]


def token_bytes(dtype: KVDtype, num_kv_heads: int, head_dim: int, block_size: int) -> float:
    """Host bytes of one token's K and V in one layer of a pool (the module doc's formulas;
    `HostKVPool.bytes_per_token` / L exactly), int4's tails not included (`tail_bytes`)."""
    H, D, BS = num_kv_heads, head_dim, block_size
    if dtype is KVDtype.INT8:
        return H * (D + D * (-(-BS // 4) * 4) / BS + 8)
    if dtype is KVDtype.INT4:
        return H * (D / 2 + D / 2 * (-(-BS // 4) * 4) / BS + D / 8 + 4 * D / BS) + 4 / BS
    return 2 * H * D * dtype.bytes_per_value


def tail_bytes(dtype: KVDtype, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Host bytes an int4 pool adds per sequence and layer while a block is being filled: one
    bf16 tail of K and V (0 for the other dtypes)."""
    return 4 * num_kv_heads * block_size * head_dim if dtype is KVDtype.INT4 else 0


def part_shapes(dtype: KVDtype, L: int, NB: int, H: int, BS: int, D: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors a pool of `dtype` holds, by name: (shape, torch dtype), the module doc's table
    (int4's tails aside). The host pool and the device pool (`gpu_ops.kv_pool`) both allocate
    exactly these, so a block moves between them as a byte copy of each tensor's [L, block] rows."""
    BS4 = -(-BS // 4)
    if dtype in (KVDtype.F32, KVDtype.BF16):
        dt = torch.float32 if dtype is KVDtype.F32 else torch.bfloat16
        return {"k": ((L, NB, H, BS, D), dt), "v": ((L, NB, H, BS, D), dt)}
    if dtype is KVDtype.INT8:
        return {"k": ((L, NB, H, D // 4, BS, 4), torch.int8), "v": ((L, NB, H, BS4, D, 4), torch.int8),
                "k_scale": ((L, NB, H, BS), torch.float32), "v_scale": ((L, NB, H, BS), torch.float32)}
    G = D // INT4_GROUP
    return {"k": ((L, NB, H, D // 8, BS, 4), torch.uint8), "v": ((L, NB, H, BS4, D // 2, 4), torch.uint8),
            "k_scale": ((L, NB, H, D), torch.bfloat16), "k_zero": ((L, NB, H, D), torch.bfloat16),
            "v_scale": ((L, NB, H, BS, G), torch.bfloat16), "v_zero": ((L, NB, H, BS, G), torch.bfloat16)}


def quantize(x: torch.Tensor, dtype: KVDtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [..., D] → (data, scale, zero) in the pool's per-token layout for `dtype` (int8: x @ R;
    int4: values, as a complete block holds them)."""
    if dtype is KVDtype.F32:
        return x.float(), None, None
    if dtype is KVDtype.BF16:
        return x.to(torch.bfloat16), None, None
    x = x.float()
    if dtype is KVDtype.INT8:
        return quantize_int8(rotation.rotate(x))
    return int4.quantize_values(x)


def dequantize(
    data: torch.Tensor, dtype: KVDtype, scale: torch.Tensor | None, zero: torch.Tensor | None
) -> torch.Tensor:
    """Inverse of `quantize`, to float32 (rotated back)."""
    if dtype in (KVDtype.F32, KVDtype.BF16):
        return data.float()
    if dtype is KVDtype.INT8:
        return rotation.unrotate(data.float() * scale[..., None])
    return int4.dequantize_values(data, scale, zero)


def quantize_int8(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """y [..., D] float32 (already rotated) → (codes int8 [..., D], scale [...], None): round(y /
    scale), scale = max|y| / 127 per row."""
    scale = y.abs().amax(-1).clamp_min(1e-8) / 127.0
    return torch.round(y / scale[..., None]).clamp(-127, 127).to(torch.int8), scale, None


def dequantize_blocks(dtype: KVDtype, parts: dict[str, torch.Tensor],
                      rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks as a pool stores them (`HostKVPool.parts` indexed by layer and block ids:
    [nb, Hkv, ...] each, on any device) → K, V [nb, Hkv, BS, D] float32. int4: complete
    blocks only (their codes; a block being filled is in its tail, see `int4.gather`).
    rotated=True leaves what `dtype.rotated` names as stored, x @ R: attention over it takes
    q @ R (rotated keys) and gives out @ R (rotated values), which `rotation.unrotate` turns
    back for D log D per query row instead of per token."""
    if dtype is KVDtype.INT4:
        k = int4.dequantize_keys(parts["k"], parts["k_scale"], parts["k_zero"])
        y = int4.block_rows(parts["v"], parts["v_scale"], parts["v_zero"])
        return k, (y if rotated else rotation.unrotate(y))
    if dtype is KVDtype.INT8:
        codes = int8_rows(parts["k"], parts["v"], parts["k_scale"].shape[-1])
        k, v = (c.float() * parts[f"{n}_scale"][..., None] for c, n in zip(codes, ("k", "v")))
        return (k, v) if rotated else (rotation.unrotate(k), rotation.unrotate(v))
    return tuple(dequantize(parts[n], dtype, parts.get(f"{n}_scale"), parts.get(f"{n}_zero")) for n in ("k", "v"))


def quantize_blocks(dtype: KVDtype, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """Whole blocks K, V [..., BS, D] (any float dtype, any device) → the pool's tensors for them
    by name, [..., <part shape>] each: the inverse of `dequantize_blocks`, the bytes a host pool's
    append writes for the same tokens (int4: keys and rotated values rounded to bf16 first, as
    its tails hold them)."""
    if dtype in (KVDtype.BF16, KVDtype.F32):
        dt = torch.float32 if dtype is KVDtype.F32 else torch.bfloat16
        return {"k": k.to(dt), "v": v.to(dt)}
    *lead, BS, D = k.shape
    if dtype is KVDtype.INT4:
        kc, k_scale, k_zero = int4.quantize_keys(k.to(torch.bfloat16))
        vc, v_scale, v_zero = int4.quantize_values(v)
        return {"k": kc, "v": int4.quads(vc), "k_scale": k_scale, "k_zero": k_zero, "v_scale": v_scale,
                "v_zero": v_zero}
    out = {}
    for name, x in (("k", k), ("v", v)):
        codes, scale, _ = quantize_int8(rotation.rotate(x))  # [..., BS, D]
        if name == "k":  # [..., D/4, BS, 4]
            out[name] = codes.reshape(*lead, BS, D // 4, 4).transpose(-3, -2).contiguous()
        else:  # [..., BS4/4, D, 4], the padding tokens 0
            BS4 = -(-BS // 4) * 4
            if BS4 != BS:
                codes = torch.cat([codes, codes.new_zeros((*lead, BS4 - BS, D))], -2)
            out[name] = codes.reshape(*lead, BS4 // 4, 4, D).transpose(-1, -2).contiguous()
        out[f"{name}_scale"] = scale
    return out


def int8_rows(k: torch.Tensor, v: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 pool's codes in token order: k [..., D/4, BS, 4] and v [..., BS4/4, D, 4] (the
    module doc's VNNI order, any leading dims, any device) → K, V [..., BS, D] int8 (copies)."""
    lead, D = k.shape[:-3], 4 * k.shape[-3]
    keys = k.transpose(-3, -2).reshape(*lead, block_size, D)
    values = v.transpose(-2, -1).reshape(*lead, -1, D)[..., :block_size, :]
    return keys, values
