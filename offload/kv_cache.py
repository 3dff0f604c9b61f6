"""The two-tier paged KV cache: a device block pool and a host block pool, per-sequence tables.

A sequence's tokens live on the device tier up to its planned share (`gpu_tokens`), the
rest on the host tier (bf16, int8 or int4, quantized on the way in). Attention is order-free
over the tokens it is given, so each tier holds a *set* of blocks: only a tier's last block
may be partly filled, and a block can move between tiers whole (swap out / swap in) without
renumbering anything. The device tier may be a CPU stand-in (same layout, on the host) so
every path but the CUDA streams runs in CI.

Swapping: when a sequence needs device blocks and the device tier is full, full blocks of other
sequences move to the host (`swap_out`, counted per sequence in `SeqKV.swapped`). Between steps,
when the device tier has free blocks again (a sequence finished), `swap_in_free_room` moves
swapped-out blocks back; blocks the plan put on the host stay there. Blocks go up from pinned
staging on a copy stream, and the compute stream waits for them there, not the host.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from cpu_attention import HostKVPool, KVDtype
from cpu_attention.layout import quantize_blocks
from gpu_ops.kv_pool import GpuKVPool
from hetero.config import ModelConfig
from hetero.errors import UserError
from offload import pinned
from offload.blocks import BlockAllocator, OutOfBlocks, TierTable
from offload.stream import runs

log = logging.getLogger(__name__)


@dataclass
class SeqKV:
    gpu: TierTable
    host: TierTable
    gpu_limit: int  # tokens this sequence may keep on the device tier
    ordered: bool = True  # device tier holds positions [0, g), host the rest: no swap happened
    swapped: int = 0  # of its host blocks, how many the device tier held before a swap out
    recent: tuple[int, int] = (0, 0)  # (device, host) tokens of its latest reservation

    @property
    def num_tokens(self) -> int:
        return self.gpu.num_tokens + self.host.num_tokens


@dataclass
class Slots:
    """Where n new tokens go: rows of the new-token batch and their flat slots on each tier."""

    gpu_rows: list[int] = field(default_factory=list)
    gpu_slots: list[int] = field(default_factory=list)
    host_rows: list[int] = field(default_factory=list)
    host_slots: list[int] = field(default_factory=list)
    # a quantized device tier: blocks this write fills whole (quantized straight from rows
    # row0 .. row0 + BS - 1) rather than through their tails; their rows are not in gpu_rows
    whole_rows: list[int] = field(default_factory=list)
    whole_blocks: list[int] = field(default_factory=list)
    # a row of a run of one sequence's rows (offload/rows.py): the run's tokens after it on each
    # tier, hidden from its attention
    later_gpu: int = 0
    later_host: int = 0
    # the lists as tensors, made once (a prefill writes the same slots in every layer): `tensor`
    _tensors: dict = field(default_factory=dict, repr=False, compare=False)

    def tensor(self, name: str, device: torch.device | str = "cpu", rows: int | None = None) -> torch.Tensor | None:
        """The int64 list `name` on device, made on the first call; with rows given, None where the
        list is 0 .. rows − 1 (every row of the batch in order: no gather needed)."""
        key = (name, str(device), rows)
        if key not in self._tensors:
            v = getattr(self, name)
            whole = rows is not None and len(v) == rows and v == list(range(rows))
            self._tensors[key] = None if whole else torch.tensor(v, dtype=torch.int64, device=device)
        return self._tensors[key]

    def extend(self, other: "Slots", offset: int) -> None:
        self._tensors.clear()
        self.gpu_rows += [r + offset for r in other.gpu_rows]
        self.gpu_slots += other.gpu_slots
        self.whole_rows += [r + offset for r in other.whole_rows]
        self.whole_blocks += other.whole_blocks
        self.host_rows += [r + offset for r in other.host_rows]
        self.host_slots += other.host_slots


class TieredKVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        host_tokens: int,
        gpu_tokens: int = 0,
        host_dtype: KVDtype = KVDtype.BF16,
        gpu_tokens_per_seq: int | None = None,
        device: torch.device = torch.device("cpu"),
        block_size: int = 32,
        pin: bool = False,
        gpu_dtype: KVDtype | None = None,
        max_seqs: int = 1,
    ):
        """host_tokens / gpu_tokens: pool capacities; gpu_tokens_per_seq: each sequence's device share;
        gpu_dtype: the device tier's format (None: bf16, f32 with an f32 host tier); max_seqs: the
        sequences held at once (a quantized device tier keeps a bf16 tail for each one's block
        being filled)."""
        self.cfg, self.block_size, self.device = cfg, block_size, device
        nb = lambda n: -(-n // block_size)  # noqa: E731
        self.host = HostKVPool(cfg.num_layers, nb(host_tokens), cfg.num_kv_heads, block_size, cfg.head_dim,
                               host_dtype, allocate=pinned.zeros if pin else None)
        self.host_alloc = BlockAllocator(self.host.num_blocks)
        self.gpu: GpuKVPool | None = None
        self.gpu_alloc = BlockAllocator(0)
        if gpu_tokens > 0:
            gpu_dtype = gpu_dtype or (KVDtype.F32 if host_dtype is KVDtype.F32 else KVDtype.BF16)
            dt = torch.float32 if gpu_dtype is KVDtype.F32 else torch.bfloat16
            self.gpu = GpuKVPool(cfg.num_layers, nb(gpu_tokens), cfg.num_kv_heads, block_size, cfg.head_dim,
                                 device=device, dtype=dt, kv_dtype=gpu_dtype, max_tails=max_seqs + 1)
            self.gpu_alloc = BlockAllocator(self.gpu.num_blocks)
        self._to_seal: set[int] = set()  # device blocks a step's writes complete in their tails
        self.gpu_tokens_per_seq = gpu_tokens if gpu_tokens_per_seq is None else gpu_tokens_per_seq
        self.seqs: dict[int, SeqKV] = {}
        self.scale = cfg.head_dim ** -0.5
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self.cuda = self.gpu is not None and self.gpu.k.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.gpu.k.device) if self.cuda else None

    # ------------------------------------------------------------------ bookkeeping
    @property
    def capacity_tokens(self) -> int:
        return (self.host_alloc.num_blocks + self.gpu_alloc.num_blocks) * self.block_size

    def num_tokens(self, seq: int) -> int:
        s = self.seqs.get(seq)
        return 0 if s is None else s.num_tokens

    def tier_tokens(self) -> tuple[int, int]:
        """(device-tier tokens, host-tier tokens) over all sequences."""
        return (sum(s.gpu.num_tokens for s in self.seqs.values()), sum(s.host.num_tokens for s in self.seqs.values()))

    def _seq(self, seq: int) -> SeqKV:
        if seq not in self.seqs:
            limit = self.gpu_tokens_per_seq if self.gpu is not None else 0
            self.seqs[seq] = SeqKV(TierTable(self.block_size), TierTable(self.block_size), limit)
        return self.seqs[seq]

    def reserve(self, seq: int, n: int, keep: frozenset[int] = frozenset()) -> Slots:
        """Room for n more tokens of `seq`: the device tier first (up to its share), then the host.
        A step's reservations come before its writes, and `seal_complete` after them. keep: other
        sequences whose blocks must not be swapped out for this room (a run of drafted rows: its
        rollback needs the blocks where its reservation put them)."""
        s = self._seq(seq)
        to_gpu = max(0, min(n, s.gpu_limit - s.gpu.num_tokens))
        out = Slots()
        if to_gpu:
            need = s.gpu.blocks_needed(to_gpu)
            if need > self.gpu_alloc.num_free:
                self._make_gpu_room(need - self.gpu_alloc.num_free, keep=keep | {seq})
            if need <= self.gpu_alloc.num_free:
                s.gpu.blocks += self.gpu_alloc.allocate(need)
                if self.gpu.quantized:
                    self._route_quantized(s.gpu, to_gpu, out)
                else:
                    out.gpu_rows, out.gpu_slots = list(range(to_gpu)), s.gpu.slots(s.gpu.num_tokens, to_gpu)
                s.gpu.num_tokens += to_gpu
            else:  # the device tier is full of the current sequence's own blocks: the rest goes to the host
                s.gpu_limit = s.gpu.num_tokens
                to_gpu = 0
        rest = n - to_gpu
        if rest:
            try:
                s.host.blocks += self.host_alloc.allocate(s.host.blocks_needed(rest))
            except OutOfBlocks as e:
                raise UserError(
                    f"the KV cache is full ({self.capacity_tokens} tokens over both tiers): {e}; raise "
                    "--cpu-mem or --ctx-size, lower --parallel, or use --kv-dtype int8/int4"
                ) from None
            out.host_rows = list(range(to_gpu, n))
            out.host_slots = s.host.slots(s.host.num_tokens, rest)
            s.host.num_tokens += rest
        s.recent = (to_gpu, rest)
        return out

    def _route_quantized(self, t: TierTable, n: int, out: Slots) -> None:
        """Where n new tokens of a quantized device tier go: blocks they fill whole are quantized
        straight from the rows; the others take them in their tails (opened now), and those the
        tokens complete are sealed before the next reservation."""
        BS, g0 = self.block_size, t.num_tokens
        for j in range(g0 // BS, (g0 + n - 1) // BS + 1):
            a, b, blk = max(g0, j * BS), min(g0 + n, (j + 1) * BS), t.blocks[j]
            if a == j * BS and b == a + BS and not self.gpu.has_tail(blk):
                out.whole_rows.append(a - g0)
                out.whole_blocks.append(blk)
                continue
            self.gpu.open_tail(blk)
            out.gpu_rows += list(range(a - g0, b - g0))
            out.gpu_slots += [blk * BS + o % BS for o in range(a, b)]
            if b == (j + 1) * BS:
                self._to_seal.add(blk)

    def seal_complete(self) -> None:
        """Quantize the device blocks the last step's writes completed (stream-ordered after those
        writes; before the next step's reservations)."""
        if self._to_seal:
            self.gpu.seal(sorted(self._to_seal))
            self._to_seal.clear()

    def truncate(self, seq: int, n: int) -> None:
        """Keep the first n tokens of `seq`. Tokens are dropped from the host tier first, then the device's.

        Only valid while the tiers hold the positions in order (`SeqKV.ordered`): after a swap the
        caller recomputes instead.
        """
        s = self.seqs[seq]
        assert s.ordered or n == s.num_tokens, "truncating a swapped sequence"
        drop = s.num_tokens - n
        self.seal_complete()
        for tier, alloc in ((s.host, self.host_alloc), (s.gpu, self.gpu_alloc)):
            d = min(drop, tier.num_tokens)
            tier.num_tokens -= d
            keep = -(-tier.num_tokens // self.block_size)
            alloc.free(tier.blocks[keep:])
            if tier is s.host:
                self.host.release(tier.blocks[keep:])
            else:
                self._drop_tails(tier.blocks[keep:])
                if d and tier.num_tokens % self.block_size:  # a sealed block is partly filled again
                    self.gpu.reopen(tier.blocks[keep - 1])
            del tier.blocks[keep:]
            drop -= d

    def free(self, seq: int) -> None:
        s = self.seqs.pop(seq, None)
        if s is not None:
            self._drop_tails(s.gpu.blocks)
            self.gpu_alloc.free(s.gpu.blocks)
            self.host_alloc.free(s.host.blocks)
            self.host.release(s.host.blocks)

    def rename(self, old: int, new: int) -> None:
        self.seqs[new] = self.seqs.pop(old)

    def _drop_tails(self, blocks: list[int]) -> None:
        if self.gpu is not None and self.gpu.quantized:
            self._to_seal.difference_update(blocks)
            self.gpu.drop_tails(blocks)

    # ------------------------------------------------------------------ writes
    def write(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, Hkv, D] of the new tokens (on the compute device) into their tiers."""
        if slots.gpu_rows:
            r = slots.tensor("gpu_rows", k.device, rows=k.shape[0])
            self.gpu.write(layer, slots.tensor("gpu_slots", self.gpu.k.device), *((k, v) if r is None else (k[r], v[r])))
        if slots.whole_rows:  # [n, BS] rows of whole blocks → [n, Hkv, BS, D]
            r = slots.tensor("whole_rows", k.device)[:, None] + torch.arange(self.block_size, device=k.device)
            kb, vb = (x[r].transpose(1, 2).to(self.gpu.k.device) for x in (k, v))
            self.gpu.write_blocks(slots.tensor("whole_blocks"), kb, vb, layer=layer)
        if slots.host_rows:
            r = slots.tensor("host_rows", k.device)
            self.host.write(layer, slots.tensor("host_slots"), k[r].cpu(), v[r].cpu())

    # ------------------------------------------------------------------ attention inputs
    def tables(self, seqs: list[int], tier: str, slots: list[Slots] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables [B, max_blocks] int32 and token counts [B] int32 of one tier (host memory), a
        row each; slots: the rows' reservations, whose tokens after a row in its run it does not see."""
        ts = [getattr(self.seqs[s], tier) for s in seqs]
        width = max(1, max(len(t.blocks) for t in ts))
        bt = np.zeros((len(ts), width), dtype=np.int32)  # numpy: a torch row assignment costs ~8 µs more
        for i, t in enumerate(ts):
            bt[i, : len(t.blocks)] = t.blocks
        hidden = [0] * len(ts) if slots is None else [getattr(sl, "later_" + tier) for sl in slots]
        return torch.from_numpy(bt), torch.tensor([t.num_tokens - h for t, h in zip(ts, hidden)], dtype=torch.int32)

    # ------------------------------------------------------------------ swapping
    def _make_gpu_room(self, blocks: int, keep: frozenset[int]) -> None:
        """Swap out full device blocks of other sequences (largest first) until `blocks` are free."""
        victims = sorted((s for s in self.seqs if s not in keep), key=lambda s: -len(self.seqs[s].gpu.blocks))
        for v in victims:
            if blocks <= 0:
                return
            blocks -= self.swap_out(v, blocks)

    def swap_out(self, seq: int, max_blocks: int) -> int:
        """Move up to max_blocks full device blocks of `seq` to the host tier; returns how many moved."""
        s = self.seqs[seq]
        n = min(max_blocks, self.host_alloc.num_free)
        full = s.gpu.num_tokens // self.block_size
        if full and s.gpu.blocks[full - 1] in self._to_seal:  # completed this step, not written yet
            n = min(n, full - 1)
        move = s.gpu.take_full_blocks(n)
        if not move:
            return 0
        dst = self.host_alloc.allocate(len(move))
        src = torch.tensor(move, device=self.gpu.k.device)
        if self.gpu.kv_dtype is self.host.dtype:  # one format on both tiers: the blocks' bytes, copied
            at = torch.tensor(dst)
            for name, t in self.gpu.parts().items():
                getattr(self.host, name)[:, at] = t[:, src].cpu()
        else:
            slots = _block_slots(dst, self.block_size, torch.device("cpu"))
            k, v = self.gpu.blocks(src)  # [L, n, Hkv, BS, D]
            for layer in range(self.cfg.num_layers):
                self.host.write(layer, slots, _flat(k[layer]).cpu(), _flat(v[layer]).cpu())
        s.host.add_full_blocks(dst)
        s.ordered = False
        s.gpu_limit = s.gpu.num_tokens
        s.swapped += len(move)
        self.gpu_alloc.free(move)
        self.swapped_out_blocks += len(move)
        return len(move)

    def swap_in(self, seq: int, max_blocks: int) -> int:
        """Move up to max_blocks full host blocks of `seq` to the device tier (`_copy_up`).

        On CUDA the blocks go up from pinned staging on the copy stream, and the compute stream
        waits for that copy before its next work (the host does not wait)."""
        if self.gpu is None:
            return 0
        s = self.seqs[seq]
        move = s.host.take_full_blocks(min(max_blocks, self.gpu_alloc.num_free))
        if not move:
            return 0
        dst = self.gpu_alloc.allocate(len(move))
        self._copy_up(move, dst)
        s.gpu.add_full_blocks(dst)
        s.ordered = False
        s.gpu_limit = max(s.gpu_limit, s.gpu.num_tokens)
        s.swapped = max(0, s.swapped - len(move))
        self.host_alloc.free(move)  # its bytes were copied into staging (or the device) already
        self.host.release(move)
        self.swapped_in_blocks += len(move)
        return len(move)

    def swap_in_free_room(self, keep_free: int = 0) -> int:
        """Between steps: move swapped-out blocks back to the device tier while it has more than
        `keep_free` free blocks (what the step about to run needs there), the sequences with the
        most swapped-out blocks first. Returns the blocks moved."""
        moved = 0
        for seq in sorted((q for q in self.seqs if self.seqs[q].swapped), key=lambda q: -self.seqs[q].swapped):
            room = self.gpu_alloc.num_free - keep_free
            if room <= 0:
                break
            moved += self.swap_in(seq, min(room, self.seqs[seq].swapped))
        return moved

    def gpu_blocks_needed(self, runs: list[tuple[int, int]]) -> int:
        """Device-tier blocks `reserve(seq, n)` will allocate for each (seq, n) of runs (without swapping)."""
        need = 0
        for q, n in runs:
            s = self.seqs.get(q)
            if s is not None:
                need += s.gpu.blocks_needed(max(0, min(n, s.gpu_limit - s.gpu.num_tokens)))
        return need

    def _copy_up(self, src: list[int], dst: list[int]) -> None:
        """Whole host blocks src → device blocks dst, every layer: their bytes when both tiers share a
        format, else dequantized and stored in the device tier's."""
        g, h = self.gpu, self.host
        if g.kv_dtype is h.dtype:
            staged = {n: t[:, src] for n, t in h.parts().items()}  # [L, n, ...] each
        else:
            staged = quantize_blocks(g.kv_dtype, *h.blocks(torch.tensor(src)))
        dev_parts = g.parts()
        if not self.cuda:  # the stand-in: a plain copy
            for name, x in staged.items():
                dev_parts[name][:, dst] = x
            return
        staged = {n: x.pin_memory() for n, x in staged.items()}  # the copies up are true async DMAs
        compute = torch.cuda.current_stream(g.k.device)
        self.copy_stream.wait_stream(compute)  # the blocks' last readers (a freed sequence's) are done
        with torch.cuda.stream(self.copy_stream):
            for first, at, n in runs(dst):
                for name, x in staged.items():
                    for layer in range(self.cfg.num_layers):
                        dev_parts[name][layer, first:first + n].copy_(x[layer, at:at + n], non_blocking=True)
        compute.wait_stream(self.copy_stream)  # before any attention reads them


def _block_slots(blocks: list[int], bs: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([b * bs + o for b in blocks for o in range(bs)], device=device)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[n, Hkv, BS, D] blocks → [n*BS, Hkv, D] tokens."""
    n, h, bs, d = x.shape
    return x.transpose(1, 2).reshape(n * bs, h, d)
