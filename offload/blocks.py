"""Block allocation and per-sequence block tables for one KV tier.

A tier is a pool of fixed-size blocks; a sequence owns an ordered list of blocks on each
tier it uses. Pure bookkeeping: no tensors move here.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """The tier has fewer free blocks than asked for."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class TierTable:
    """One sequence's tokens on one tier; every block is full but the last."""

    block_size: int
    num_tokens: int = 0
    blocks: list[int] = field(default_factory=list)

    def blocks_needed(self, extra_tokens: int) -> int:
        cap = len(self.blocks) * self.block_size
        need = self.num_tokens + extra_tokens - cap
        return max(0, -(-need // self.block_size))

    def add_full_blocks(self, blocks: list[int]) -> None:
        """Take whole blocks moved from another tier; the partly filled tail block stays last."""
        if self.num_tokens % self.block_size:
            self.blocks[-1:-1] = blocks
        else:
            self.blocks += blocks
        self.num_tokens += len(blocks) * self.block_size

    def take_full_blocks(self, n: int) -> list[int]:
        """Give up to n whole blocks (never the partly filled tail)."""
        n = min(n, self.num_tokens // self.block_size)
        taken, self.blocks[:n] = self.blocks[:n], []
        self.num_tokens -= n * self.block_size
        return taken

    def slots(self, first: int, count: int) -> list[int]:
        """Flat slots of tier-relative token indices [first, first + count)."""
        bs = self.block_size
        return [self.blocks[t // bs] * bs + t % bs for t in range(first, first + count)]
