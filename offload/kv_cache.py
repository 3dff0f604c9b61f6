"""The paged KV cache the engine attends over: block tables per sequence over a host pool.

Each sequence owns a `TierTable` on the host tier; new tokens' K/V are appended to its tail
blocks (quantized on the way in when the tier is int8/int4) and attention runs in the
`cpu_attention` kernels over the block table, returning output and log-sum-exp.
"""
from __future__ import annotations

import torch

import cpu_attention
from cpu_attention import HostKVPool, KVDtype
from hetero.config import ModelConfig
from hetero.errors import UserError
from offload.blocks import BlockAllocator, OutOfBlocks, TierTable


class PagedKVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_tokens: int,
        kv_dtype: KVDtype = KVDtype.BF16,
        block_size: int = 32,
        threads: int | None = None,
    ):
        self.cfg, self.block_size, self.threads = cfg, block_size, threads
        num_blocks = -(-num_tokens // block_size)
        self.pool = HostKVPool(cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim, kv_dtype)
        self.alloc = BlockAllocator(num_blocks)
        self.tables: dict[int, TierTable] = {}
        self.scale = cfg.head_dim ** -0.5
        self._kw = {} if threads is None else {"threads": threads}  # TODO drop once kernels take threads

    @property
    def capacity_tokens(self) -> int:
        return self.alloc.num_blocks * self.block_size

    def num_tokens(self, seq: int) -> int:
        t = self.tables.get(seq)
        return 0 if t is None else t.num_tokens

    def reserve(self, seq: int, n: int) -> torch.Tensor:
        """Make room for n more tokens of `seq`; returns their flat slots [n] (int64)."""
        t = self.tables.setdefault(seq, TierTable(self.block_size))
        try:
            t.blocks += self.alloc.allocate(t.blocks_needed(n))
        except OutOfBlocks as e:
            raise UserError(
                f"the KV cache is full ({self.capacity_tokens} tokens): {e}; raise --ctx-size or "
                "--cpu-mem, or use --kv-dtype int8"
            ) from None
        slots = torch.tensor(t.slots(t.num_tokens, n), dtype=torch.int64)
        t.num_tokens += n
        return slots

    def truncate(self, seq: int, n: int) -> None:
        """Keep the first n tokens of `seq` (a chat turn that diverges from the cached one)."""
        t = self.tables[seq]
        keep = -(-n // self.block_size)
        self.alloc.free(t.blocks[keep:])
        del t.blocks[keep:]
        t.num_tokens = n

    def free(self, seq: int) -> None:
        t = self.tables.pop(seq, None)
        if t is not None:
            self.alloc.free(t.blocks)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.write(layer, slots, k, v)

    def _table(self, seqs: list[int]) -> torch.Tensor:
        width = max(len(self.tables[s].blocks) for s in seqs)
        bt = torch.zeros(len(seqs), max(width, 1), dtype=torch.int32)
        for i, s in enumerate(seqs):
            b = self.tables[s].blocks
            bt[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        return bt

    def decode(self, layer: int, q: torch.Tensor, seqs: list[int]) -> torch.Tensor:
        """q [B, Hq, D], one new token per sequence (already written) → out [B, Hq, D]."""
        lens = torch.tensor([self.tables[s].num_tokens for s in seqs], dtype=torch.int32)
        out, _ = cpu_attention.decode_attention(
            self.pool, layer, q.float(), self._table(seqs), lens, self.scale, **self._kw
        )
        return out

    def prefill(self, layer: int, q: torch.Tensor, seq: int, q_pos0: int) -> torch.Tensor:
        """q [T, Hq, D] at positions q_pos0.. (their K/V already written) → out [T, Hq, D]."""
        t = self.tables[seq]
        out, _ = cpu_attention.prefill_attention(
            self.pool, layer, q.float(), self._table([seq])[0], t.num_tokens, q_pos0, self.scale,
            **self._kw,
        )
        return out
