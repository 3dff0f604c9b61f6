"""The KV block pool in host memory: every layer's blocks in the format `layout.py` defines,
written through the Numba quantizing append (`append.py`), read back for checks and moves."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from cpu_attention import host_memory, int4
from cpu_attention.layout import HALF, INT4_GROUP, KVDtype, dequantize_blocks, part_shapes, quantize


@dataclass
class HostKVPool:
    """Paged K/V storage for all layers in host memory (see the module docstring)."""

    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: KVDtype = KVDtype.BF16
    # (shape, torch dtype) → zeroed tensor; None: `host_memory.zeros` (offload.pinned's locks the
    # memory for the GPU's copies)
    allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.dtype is KVDtype.INT4 and self.head_dim % INT4_GROUP:
            raise ValueError(f"int4 KV needs head_dim divisible by {INT4_GROUP}, got {self.head_dim}")
        if self.dtype is KVDtype.INT8 and self.head_dim % 4:
            raise ValueError(f"int8 KV needs head_dim divisible by 4, got {self.head_dim}")
        L, NB, H, BS, D = self.num_layers, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim
        self.k_scale = self.v_scale = self.k_zero = self.v_zero = None
        for name, (shape, dt) in part_shapes(self.dtype, L, NB, H, BS, D).items():
            setattr(self, name, (self.allocate or host_memory.zeros)(shape, dt))  # 2 MiB pages
        if self.dtype is KVDtype.INT4:
            self.tails = int4.Tails(L, NB, H, BS, D)

    @functools.cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """The tensors above as numpy views (no copy), 16-bit floats as their uint16 bits: what
        the Numba kernels take. Made once, as a torch index + view + .numpy() per layer costs
        microseconds on every kernel call; they view the tensors made in __post_init__."""
        out = {}
        for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
            t = getattr(self, name)
            if t is not None:
                out[name] = t.view(torch.int16).numpy().view(np.uint16) if t.dtype in HALF else t.numpy()
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales, zeros (int4: and the tail-slot table; not the tails
        themselves, which grow with the blocks being filled: `tails.nbytes`)."""
        ts = [self.k, self.v, self.k_scale, self.v_scale, self.k_zero, self.v_zero]
        if self.dtype is KVDtype.INT4:
            ts.append(self.tails.slot)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    @property
    def bytes_per_token(self) -> float:
        """Host bytes one token's K and V take over all layers (`token_bytes` × L)."""
        return self.nbytes / (self.num_blocks * self.block_size)

    def release(self, blocks: list[int]) -> None:
        """The cache gave these blocks back to its allocator: int4 frees their tails (a block
        freed while being filled would otherwise keep its slot until reused)."""
        if self.dtype is KVDtype.INT4:
            self.tails.release(blocks)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] (any float dtype) at flat slots [T], quantizing on the way in
        (int4: `int4.write`'s rule; a block's tokens must be written in order).

        bf16/int8/int4 go through the Numba append (`append.py`, same numbers as `quantize`).
        """
        if self.dtype is not KVDtype.F32:
            from cpu_attention.append import write_numba  # numba loads lazily

            write_numba(self, layer, slots, k, v)
            return
        blocks, offs = slots // self.block_size, slots % self.block_size
        for name, x in (("k", k), ("v", v)):
            data, scale, zero = quantize(x, self.dtype)
            getattr(self, name)[layer, blocks, :, offs] = data
            if scale is not None:
                getattr(self, f"{name}_scale")[layer, blocks, :, offs] = scale
            if zero is not None:
                getattr(self, f"{name}_zero")[layer, blocks, :, offs] = zero

    def gather(self, layer: int, block_table: torch.Tensor, n_tokens: int,
               device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of one sequence's first n_tokens: [Hkv, n_tokens, D] float32 (int4:
        values rotated back, blocks being filled read from their tails, so both are what was
        written up to quantization), on `device` (default the host): the blocks go there as
        stored and are dequantized there, so a GPU's read-back moves the stored bytes, not floats."""
        if self.dtype is KVDtype.INT4:
            kv = int4.gather(self, layer, block_table, device)  # [nb, Hkv, BS, D] each
        else:
            parts = {n: t[layer, block_table].to(device or t.device) for n, t in self.parts().items()}
            kv = dequantize_blocks(self.dtype, parts)  # [nb, Hkv, BS, D] each
        return tuple(x.transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :n_tokens] for x in kv)

    def blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of whole blocks in every layer, [L, n, Hkv, BS, D]: what moving them to another
        tier copies. bf16/f32 as stored; int8/int4 dequantized to float32 (int4: values rotated
        back, a block being filled read from its tail)."""
        if self.dtype in (KVDtype.BF16, KVDtype.F32):
            return self.k[:, block_ids], self.v[:, block_ids]
        if self.dtype is KVDtype.INT4:
            return int4.gather(self, slice(None), block_ids)
        return dequantize_blocks(self.dtype, {n: t[:, block_ids] for n, t in self.parts().items()})

    def parts(self) -> dict[str, torch.Tensor]:
        """The per-block tensors by name ([L, NB, ...] each: k, v and whichever scales and zeros
        the dtype has), what copying a block means (int4's tails aside)."""
        names = ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}
