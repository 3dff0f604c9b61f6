"""The GPU KV block pool: the host pool's byte layout (`cpu_attention.layout`), resident on a device.

    bf16 / f32   k, v  [L, NB + 1, Hkv, BS, D]
    int8 / int4  the tensors `layout.part_shapes` names, [L, NB + 1, ...] each, plus the tails:
                 tail_k, tail_v  bf16 [L, T + 1, Hkv, BS, D]  blocks being filled, as written
                 tail_of_block   int32 [NB + 1]               a block's tail, −1: its codes hold it

Same bytes as `cpu_attention.layout.HostKVPool` of the same dtype, so a complete block moves
between the tiers as one copy per tensor. One extra block (id NB, `scratch_block`) is never
handed out: the static-shape decode step points its padding rows there, so they write and read
only memory no sequence owns.

Quantized blocks are written whole: a block being filled keeps its tokens in a bf16 tail (one
per sequence filling a device block, T of them, and a scratch tail the scratch block owns),
which is what the decode step writes into (one kernel, capturable: `write`). Once a block is
complete, `seal` quantizes it from its tail in one pass over every layer and gives the tail
back. The attention kernels read a block's tail wherever `tail_of_block` names one, so a
complete block reads the same before and after its seal up to the quantization.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field

import torch

from cpu_attention.layout import KVDtype, dequantize_blocks, part_shapes, quantize_blocks


@dataclass
class GpuKVPool:
    num_layers: int
    num_blocks: int  # blocks a caller may allocate: ids 0 .. num_blocks - 1
    num_kv_heads: int
    block_size: int
    head_dim: int
    device: torch.device = torch.device("cuda")
    dtype: torch.dtype = torch.bfloat16  # what attention computes in (and the tails' dtype)
    kv_dtype: KVDtype | None = None  # the stored format; None: `dtype` as it is (bf16 or f32)
    max_tails: int = 0  # quantized: blocks being filled at once (one a sequence)
    free_tails: list[int] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.kv_dtype is None:
            self.kv_dtype = KVDtype.F32 if self.dtype == torch.float32 else KVDtype.BF16
        L, NB, H, BS, D = self.num_layers, self.num_blocks + 1, self.num_kv_heads, self.block_size, self.head_dim
        self.k_scale = self.v_scale = self.k_zero = self.v_zero = None
        for name, (shape, dt) in part_shapes(self.kv_dtype, L, NB, H, BS, D).items():
            setattr(self, name, torch.zeros(shape, dtype=dt, device=self.device))
        self.tail_k = self.tail_v = self.tail_of_block = None
        if self.quantized:
            T = max(1, self.max_tails)
            self.tail_k = torch.zeros((L, T + 1, H, BS, D), dtype=self.dtype, device=self.device)
            self.tail_v = torch.zeros_like(self.tail_k)
            self.tail_of_block = torch.full((NB,), -1, dtype=torch.int32, device=self.device)
            self.tail_of_block[self.scratch_block] = T  # padding rows write into the scratch tail
            self.free_tails = list(range(T - 1, -1, -1))
            self._tails: dict[int, int] = {}  # block → its tail (host-side mirror of tail_of_block)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in (KVDtype.INT8, KVDtype.INT4)

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def parts(self) -> dict[str, torch.Tensor]:
        """The per-block tensors by name ([L, NB + 1, ...] each), as `HostKVPool.parts`."""
        names = ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        ts = list(self.parts().values())
        if self.quantized:
            ts += [self.tail_k, self.tail_v, self.tail_of_block]
        return sum(t.numel() * t.element_size() for t in ts)

    @property
    def block_nbytes(self) -> int:
        """Bytes one block takes over every layer (tails aside)."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.parts().values())

    # ------------------------------------------------------------------ tails (quantized pools)
    def open_tail(self, block: int) -> None:
        """Block `block` is about to take tokens while incomplete: give it a tail (no-op if it has one)."""
        if not self.quantized or block in self._tails:
            return
        if not self.free_tails:
            raise RuntimeError(f"all {self.max_tails} KV tails of the device tier are in use")
        t = self.free_tails.pop()
        self._tails[block] = t
        self.tail_of_block[block] = t

    def has_tail(self, block: int) -> bool:
        return self.quantized and block in self._tails

    def seal(self, blocks: list[int]) -> None:
        """These blocks are complete: quantize them from their tails (every layer), free the tails."""
        blocks = [b for b in blocks if b in self._tails]
        if not blocks:
            return
        tails = torch.tensor([self._tails[b] for b in blocks], device=self.device)
        ids = torch.tensor(blocks, device=self.device)
        parts = quantize_blocks(self.kv_dtype, self.tail_k[:, tails], self.tail_v[:, tails])  # [L, n, ...]
        for name, t in self.parts().items():
            t[:, ids] = parts[name]
        self.tail_of_block[ids] = -1
        for b in blocks:
            self.free_tails.append(self._tails.pop(b))

    def reopen(self, block: int) -> None:
        """A sealed block is partly filled again (the sequence was cut short): its tokens back into a tail."""
        if not self.quantized or block in self._tails:
            return
        self.open_tail(block)
        k, v = self.blocks(torch.tensor([block]))  # [L, 1, Hkv, BS, D]
        t = self._tails[block]
        self.tail_k[:, t], self.tail_v[:, t] = k[:, 0], v[:, 0]

    def drop_tails(self, blocks: list[int]) -> None:
        """These blocks were freed: their tails (if any) go back unsealed."""
        if not self.quantized:
            return
        gone = [b for b in blocks if b in self._tails]
        if gone:
            self.tail_of_block[torch.tensor(gone, device=self.device)] = -1
            for b in gone:
                self.free_tails.append(self._tails.pop(b))

    # ------------------------------------------------------------------ writes
    def write_target(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k tensor, v tensor, flat slots) that tokens at pool slots [T] are written to: the pool
        itself, or for a quantized pool the tails of their blocks (every written block has one:
        `open_tail`). No host sync: capturable; the same for every layer, so a step computes it once."""
        if not self.quantized:
            return self.k, self.v, slots
        BS = self.block_size
        return self.tail_k, self.tail_v, self.tail_of_block[slots // BS].long() * BS + slots % BS

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              target: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store k, v [T, Hkv, D] at flat slots [T] (block * BS + offset); quantized pools: into the
        blocks' tails (`target`: `write_target(slots)` if the caller has it). No host sync: capturable."""
        kp, vp, dst = target if target is not None else self.write_target(slots.to(self.device, torch.int64))
        (kv_write if torch.compiler.is_compiling() else store_kv)(kp, vp, layer, dst, k, v, self.block_size)

    def write_blocks(self, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int | None = None) -> None:
        """Whole blocks: k, v [n, Hkv, BS, D] (every layer: [L, n, Hkv, BS, D] with layer None)
        quantized straight into the codes."""
        ids = blocks.to(self.device, torch.int64)
        parts = quantize_blocks(self.kv_dtype, k, v)
        for name, t in self.parts().items():
            if layer is None:
                t[:, ids] = parts[name]
            else:
                t[layer, ids] = parts[name]

    # ------------------------------------------------------------------ reads
    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of whole blocks: block_tables [B, MB] → [B, Hkv, MB * BS, D] each (a copy; quantized
        pools: dequantized to float32, blocks being filled read from their tails)."""
        B, MB = block_tables.shape
        idx = block_tables.to(self.device, torch.int64)
        if self.quantized:
            flat = idx.reshape(-1)
            k, v = dequantize_blocks(self.kv_dtype, {n: t[layer, flat] for n, t in self.parts().items()})
            tail = self.tail_of_block[flat].long()
            has = (tail >= 0)[:, None, None, None]  # no host sync: capturable
            k = torch.where(has, self.tail_k[layer, tail.clamp(min=0)].float(), k)
            v = torch.where(has, self.tail_v[layer, tail.clamp(min=0)].float(), v)
            kv = (k.view(B, MB, *k.shape[1:]), v.view(B, MB, *v.shape[1:]))
        else:
            kv = (self.k[layer][idx], self.v[layer][idx])  # [B, MB, Hkv, BS, D]
        return tuple(x.transpose(1, 2).reshape(B, self.num_kv_heads, MB * self.block_size, self.head_dim) for x in kv)

    def blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of whole complete blocks in every layer [L, n, Hkv, BS, D] (float32 for quantized pools)."""
        ids = block_ids.to(self.device, torch.int64)
        if not self.quantized:
            return self.k[:, ids], self.v[:, ids]
        return dequantize_blocks(self.kv_dtype, {n: t[:, ids] for n, t in self.parts().items()})


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, block_size: int) -> None:
    """k, v [T, Hkv, D] into the pools [L, NB, Hkv, BS, D] at flat slots [T] (block · BS + offset)."""
    if k_pool.is_cuda and _fused_write(k_pool, k, v):  # one kernel instead of four
        from gpu_ops.fused import kv_write as fused_write

        return fused_write(k_pool, v_pool, layer, slots, k, v, block_size)
    blocks, offs = slots // block_size, slots % block_size
    k_pool[layer, blocks, :, offs] = k.to(k_pool.dtype)
    v_pool[layer, blocks, :, offs] = v.to(v_pool.dtype)


def _fused_write(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    D = pool.shape[-1]
    return (D & (D - 1) == 0 and pool.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1
            and _has_triton())


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


# The same as a custom op that declares its in-place writes, for torch.compile: there a plain indexed
# store into the pool is functionalized into a copy of the whole pool (measured: 429 ms a step at
# batch 32 × 2k context); declared mutation lets the compiler keep the store in place. Eager calls
# take `store_kv` itself: the op's dispatch cost ~30 µs of the host's time a call.
kv_write = torch.library.custom_op("hetero::kv_write", mutates_args=("k_pool", "v_pool"))(store_kv)


@kv_write.register_fake
def _(k_pool, v_pool, layer, slots, k, v, block_size) -> None:
    return None


def quant_shapes_ok(kv_dtype: KVDtype, head_dim: int, block_size: int) -> bool:
    """Shapes `gpu_ops.attention_quant` runs: powers of two, every dot ≥ 16 a side (int4 splits D
    in halves; a [D, D] rotation tile above 128 would not fit shared memory), BS 16 to 64. int4 from
    head dim 64: at 32 a decode run through the kernel on the GPU host strayed from the torch twin
    by more than 1e-2 in the logits (the kernel's own tests cover 64 and 128), so the twin runs there."""
    pow2 = lambda x: x & (x - 1) == 0  # noqa: E731
    lo = 64 if kv_dtype is KVDtype.INT4 else 16
    return (kv_dtype in (KVDtype.INT8, KVDtype.INT4) and pow2(head_dim) and lo <= head_dim <= 128
            and pow2(block_size) and 16 <= block_size <= 64)
