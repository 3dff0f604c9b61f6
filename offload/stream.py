"""Host-tier KV the device attends over: the first blocks of each sequence's host tier, copied
up over PCIe each step, a layer ahead, while the CPU attends over the rest.

In a decode step with one sub-batch nothing else overlaps the CPU's attention (the next layer
needs its output; with two, only the other sub-batch's device work does), so the host tier's read
rate is the CPU kernel's alone, ~40–70 GB/s on the GPU host; PCIe adds ~55 GB/s of its own,
limited together by DRAM (~85–115 GB/s). The plan's `stream_tokens` says how many of each
sequence's host-tier first tokens take the PCIe road; they stay stored on the host.

The blocks go up as they are stored (bf16, int8 or int4: one block format for both tiers,
`cpu_attention.layout.part_shapes`) into a two-layer device pool of the host's format, row r's
blocks at r · max_blocks onwards (the second of two sub-batches' rows from row `half` on: each
sub-batch's captured attention reads fixed rows), and the device's paged attention reads those
bytes directly (`gpu_ops.attention`: int8 and int4 dequantized in registers), so an int4 block
crosses PCIe and is read at its own size.

Per layer i, two staging slots (i % 2) on the device:
    copy stream:    wait slot free → the layer's blocks up (a run of consecutive blocks per
                    tensor and row: all of them read by one kernel from the page-locked pool,
                    `gpu_ops.host_read.gather_pinned`; else a copy each, in one driver call where
                    the driver has batched copies) → event `copied[slot]`
    compute stream: wait `copied[slot]` → paged attention over the slot → (o, lse) → event `free[slot]`
The kernel rather than the copies: a layer's 64 runs of blocks at 16 rows, in one batched driver
call, cost the main thread ~175 µs a layer to issue, the kernel one launch; it moved 50 GB/s
where the batched copies moved 54 (47.6 against 42.5 beside the CPU reading DRAM; H200 host).
Through Triton's launcher that one launch still costs the main thread 35 µs, so each layer's is
captured once as a CUDA graph over a table of fixed width (columns a step does not use move 0
words) and launched through the driver in 3 µs (`bench.stream_copies`); a step whose pieces
outgrow the table captures them again, wider. The kernel keeps to a few SMs (`gather_pinned`):
the compute stream's kernels have the rest while a layer's blocks come up.
Layer i + 2's copy is queued right after layer i's attention, so each copy has a whole layer
of time to land. On a CPU stand-in device the same code runs without streams. Streamed blocks
are complete, so an int4 block is always in its codes, never in a bf16 tail (`begin` checks the
last one of each row, the only one that could be being filled).
"""
from __future__ import annotations

import torch

from cpu_attention import HostKVPool, KVDtype, rotation
from gpu_ops import attention as gpu_attention
from gpu_ops.decode_step import collector_paused
from gpu_ops.host_read import WORD, HostPointer, gather_pinned
from gpu_ops.kv_pool import GpuKVPool
from offload.driver import RAW_GRAPHS, driver, event_handle, graph_handle

# Copies go up in pieces of at most this. Small pieces cost the main thread ~20 µs of launch each
# (2 MB pieces: 244 µs a layer at 8k), and a small upload waits ~40 µs behind
# a 24 MB copy whole or in 12 pieces alike: so pieces are large.
PIECE_BYTES = 64 * 2**20


def runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive block ids as (first id, position in the list, count): one copy each."""
    out: list[tuple[int, int, int]] = []
    for pos, b in enumerate(blocks):
        if out and out[-1][0] + out[-1][2] == b:
            first, at, n = out[-1]
            out[-1] = (first, at, n + 1)
        else:
            out.append((b, pos, 1))
    return out


def _blocks_contiguous(parts: dict[str, torch.Tensor], raw: list[dict[str, torch.Tensor]]) -> bool:
    """Whether every host tensor [L, NB, ...] and staging tensor [max_blocks, ...] is dense, blocks
    of the same bytes on both sides, the host page-locked: what `_driver_copy`'s pointer arithmetic takes."""
    drv = driver()
    for n, t in parts.items():
        if not (t.is_contiguous() and drv is not None and drv.page_locked(t.data_ptr())):
            return False
        for r in raw:
            d = r[n]
            if not d.is_contiguous() or d.dtype != t.dtype or d[0].numel() != t[0, 0].numel():
                return False
    return True


class KVStreamer:
    def __init__(self, host: HostKVPool, max_tokens: int, device: torch.device, max_rows: int = 1):
        """Staging for up to max_tokens streamed tokens of each of up to max_rows sequences, on
        `device`, in the host's format."""
        self.host, self.device, self.max_rows = host, device, max_rows
        self.max_blocks = max(1, max_tokens // host.block_size)  # a row's
        self.half = -(-max_rows // 2)  # the second of two sub-batches' first row
        self.cuda = device.type == "cuda"
        n = max_rows * self.max_blocks
        # the two slots are the two "layers" of a pool the paged-attention kernels already read
        self.pool = GpuKVPool(2, n, host.num_kv_heads, host.block_size, host.head_dim,
                              device=device, dtype=torch.float32 if host.dtype is KVDtype.F32 else torch.bfloat16,
                              kv_dtype=host.dtype)
        self.raw = [{n_: t[s, :n] for n_, t in self.pool.parts().items()} for s in range(2)]
        if any(host.dtype.rotated):  # the rotation's tensors on the device before a graph captures `attend`
            rotation.on_device(host.head_dim, device)
        self.table = torch.arange(n, dtype=torch.int32, device=device).view(max_rows, self.max_blocks)
        # streamed tokens of each row this step (static: graphs read it)
        self.lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.free = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        # their driver handles (recorded once here, on an idle stream: complete, so a first wait passes)
        self.copied_h = [event_handle(e, self.stream) for e in self.copied] if self.cuda else None
        self.free_h = [event_handle(e, self.stream) for e in self.free] if self.cuda else None
        self.blocks: list[int] = []
        self.bytes_up = 0
        self.timer = None  # a GpuSpans the copies are timed with (the runner's transfer timer)
        # the driver's copies: per tensor (name, host address, bytes a layer, bytes a block)
        parts = {n: getattr(host, n) for n in self.raw[0]}
        self._copy_plan = [(n, t.data_ptr(), t.stride(0) * t.element_size(), t[0, 0].numel() * t.element_size())
                           for n, t in parts.items()]
        self._drv = driver() if self.cuda and _blocks_contiguous(parts, self.raw) else None
        self._gather = self._gather_plan() if self._drv is not None else None
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # the kernel's pieces: pinned, device
        self._pieces = self._longest = self._layer_bytes = 0
        # per layer, the kernel captured over the whole table (driver handles; where torch hands them out)
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._launch: list[int] = []

    def _gather_plan(self) -> tuple[int, int, list[tuple[int, ...]]] | None:
        """`gather_pinned`'s bases (the lowest host and staging addresses) and, per tensor, (host
        layer 0, a layer, a block, staging slot 0, a slot) in words from them; None where one is
        not whole words, or the device reaches the host pool at other addresses."""
        if any(self._drv.device_address(hp) != hp for _, hp, _, _ in self._copy_plan):
            return None
        staged = self.pool.parts()  # [2 slots, blocks, ...]
        dst = [(staged[n].data_ptr(), staged[n].stride(0) * staged[n].element_size()) for n, *_ in self._copy_plan]
        src_base, dst_base = min(c[1] for c in self._copy_plan), min(d for d, _ in dst)
        per = [(hp - src_base, layer, block, dp - dst_base, slot)
               for (_, hp, layer, block), (dp, slot) in zip(self._copy_plan, dst)]
        if any(v % WORD for vals in per for v in vals):
            return None
        return src_base, dst_base, [tuple(v // WORD for v in vals) for vals in per]

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def begin(self, rows: list[list[int]]) -> None:
        """This step streams these host blocks, a list a row (a sequence's first ones, all full)."""
        if len(rows) > self.max_rows or max(map(len, rows), default=0) > self.max_blocks:
            raise ValueError(f"{len(rows)} rows of up to {max(map(len, rows))} blocks to stream, "
                             f"staging holds {self.max_rows} of {self.max_blocks}")
        last = [blocks[-1] for blocks in rows if blocks]
        if last and self.host.dtype is KVDtype.INT4:  # one numpy read for all rows (a torch op a row: ~10 µs each)
            filling = (self.host.tails.slot.numpy()[:, last] >= 0).any(axis=0)
            if filling.any():
                raise ValueError(f"host block {last[int(filling.argmax())]} is still being filled (int4 tail): "
                                 "stream complete blocks only")
        self.blocks = [b for blocks in rows for b in blocks]
        self._runs = [(first, r * self.max_blocks + at, n) for r, blocks in enumerate(rows)
                      for first, at, n in runs(blocks)]
        self.bytes_up = 0
        if self._gather is not None:
            self._gather_table()
        lens = [len(blocks) * self.host.block_size for blocks in rows]
        if len(rows) == 1:
            self.lens.fill_(lens[0])  # one row: no copy
        else:
            self.lens[: len(rows)].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)

    def _gather_table(self) -> None:
        """This step's pieces for `gather_pinned`, a run a tensor, up on the copy stream (whose
        kernels of the step before, the table's last readers, it follows)."""
        cols = [(s0 + first * block, layer, d0 + at * block, slot, n * block)
                for s0, layer, block, d0, slot in self._gather[2] for first, at, n in self._runs]
        P = len(cols)
        if self._table is None or self._table[0].shape[1] < P:
            first = len(self._gather[2]) * self.max_rows  # one run of blocks a row and tensor
            width = max(P, first if self._table is None else 2 * self._table[0].shape[1])
            self._table = (torch.zeros(5, width, dtype=torch.int64, pin_memory=True),
                           torch.zeros(5, width, dtype=torch.int64, device=self.device))
            self._graphs, self._launch = [], []
        host, dev = self._table
        host[:, :P] = torch.tensor(cols, dtype=torch.int64).T
        host[4, P:] = 0  # columns this step does not use move nothing
        with torch.cuda.stream(self.stream):
            dev.copy_(host, non_blocking=True)
        self._pieces, self._longest = P, max((c[4] for c in cols), default=0)
        self._layer_bytes = sum(c[4] for c in cols) * WORD
        if RAW_GRAPHS and not self._graphs and P:
            self._capture()

    def _gather_layer(self, layer: int, pieces: int, longest: int) -> None:
        with torch.cuda.stream(self.stream):
            gather_pinned(HostPointer.words(self._gather[0]), HostPointer.words(self._gather[1]),
                          self._table[1], layer, layer % 2, pieces, longest)

    def _capture(self) -> None:
        """Each layer's gather as a graph over the whole table: as many pieces as it has columns, each
        as long as a row's whole staging (what no step outgrows)."""
        width = self._table[1].shape[1]
        longest = self.max_blocks * max(block for _, _, block, _, _ in self._gather[2])
        torch.cuda.synchronize(self.device)  # nothing reads slot 0 now: the warm-up's copy there is harmless
        self._gather_layer(0, width, longest)  # compiled outside the capture
        for layer in range(self.host.num_layers):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=self.stream), collector_paused():
                self._gather_layer(layer, width, longest)
            self._graphs.append(g)
            self._launch.append(graph_handle(g))

    def row0(self, slot: int) -> int:
        """The staging row sub-batch `slot`'s rows start from: 0, or `half` for the second of two (a
        fixed row: its captured attention reads from there)."""
        return (0, self.half)[slot]

    def first_rows(self, sizes: list[int]) -> list[int] | None:
        """Each sub-batch's first staging row (`row0`) for sub-batches of `sizes` rows (one or two),
        or None where they do not fit before the next one's or the staging's end."""
        starts = [self.row0(k) for k in range(min(len(sizes), 2))]
        ends = starts[1:] + [self.max_rows]
        return starts if len(sizes) == len(starts) and all(a + n <= e for a, n, e in zip(starts, sizes, ends)) else None

    def take(self, parts: list[tuple[list[list[int]], tuple] | None], first: list[int]) -> list[tuple | None] | None:
        """Stream each row's first full host blocks (all but the last, which takes this step's token;
        capped by the plan) of the sub-batches `parts` (each its rows' host blocks and its host
        tables, or None: no host tier), row r of sub-batch k into staging row first[k] + r → each
        sub-batch's CPU share of its host tables (each row shifted past its streamed blocks; None
        where it has no host tier), or None where no row has a block to stream."""
        rows: list[list[int]] = []
        cuts: list[list[int] | None] = []
        for part, r0 in zip(parts, first):
            if part is None:
                cuts.append(None)
                continue
            n = [min(self.max_blocks, len(b) - 1) if len(b) > 1 else 0 for b in part[0]]
            rows += [[] for _ in range(r0 + len(n) - len(rows))]
            rows[r0:r0 + len(n)] = [b[:k] for b, k in zip(part[0], n)]
            cuts.append(n)
        if not any(k for n in cuts if n for k in n):
            return None
        self.begin(rows + [[] for _ in range(self.max_rows - len(rows))])  # every row's length: sets read theirs
        for layer in range(min(2, self.host.num_layers)):
            self.prefetch(layer)
        return [None if n is None else self._shifted(part[1], n) for part, n in zip(parts, cuts)]

    def _shifted(self, tables: tuple[torch.Tensor, torch.Tensor], n: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tables with row r's first n[r] blocks taken off (they are streamed)."""
        bt, lens = tables
        if len(n) == 1:
            bt = bt[:, n[0]:]
        else:
            rows = bt.numpy()
            out = rows.copy()
            for r, k in enumerate(n):
                out[r, : out.shape[1] - k] = rows[r, k:]
            bt = torch.from_numpy(out)
        return bt, lens - torch.tensor(n, dtype=lens.dtype) * self.host.block_size

    def idle(self) -> None:
        """A step that streams nothing: the (captured) attention over the slots then sees no token."""
        self.blocks = []
        self.lens.zero_()

    def prefetch(self, layer: int) -> None:
        """Queue layer's blocks up into slot layer % 2 (after that slot's last reader is done)."""
        slot = layer % 2
        raw = self.raw[slot]
        if not self.cuda:
            self._copy(layer, raw)
            return
        st, drv = self.stream, self._drv
        if drv is None:
            st.wait_event(self.free[slot])
            span = self.timer.begin(st) if self.timer is not None else None
            with torch.cuda.stream(st):
                self._copy(layer, raw)
            if span is not None:
                self.timer.end(span, st)
            self.copied[slot].record(st)
            return
        h = st.cuda_stream
        drv.wait(h, self.free_h[slot])  # the slot's last reader is done
        span = self.timer.begin(h) if self.timer is not None else None
        if self._gather is not None:
            if self._launch:
                drv.launch(self._launch[layer], h)
            elif self._pieces:
                self._gather_layer(layer, self._pieces, self._longest)
            self.bytes_up += self._layer_bytes
        else:
            self._driver_copy(layer, slot)
        if span is not None:
            self.timer.end(span, h)
        drv.record(self.copied_h[slot], h)

    def _copy(self, layer: int, raw: dict[str, torch.Tensor]) -> None:
        for name, dst in raw.items():
            src = getattr(self.host, name)[layer]
            per = max(1, PIECE_BYTES // (src[0].numel() * src.element_size()))  # blocks a piece
            for first, at, n in self._runs:
                for j in range(0, n, per):
                    m = min(per, n - j)
                    dst[at + j:at + j + m].copy_(src[first + j:first + j + m], non_blocking=True)
                self.bytes_up += src[first:first + n].numel() * src.element_size()

    def _driver_copy(self, layer: int, slot: int) -> None:
        """`_copy` through the driver: pointer arithmetic, on the streamer's stream, in the same
        pieces as `_copy`: one batched call for them all where the driver has it, else one
        cuMemcpyHtoDAsync a run and piece (~4 µs of the main thread each, against ~25 for a torch
        copy_; a batch of 16 sequences has a run a row and tensor)."""
        copies = []
        for name, src_base, layer_bytes, block in self._copy_plan:
            dst = self.raw[slot][name].data_ptr()
            src = src_base + layer * layer_bytes
            per = max(1, PIECE_BYTES // block)
            for first, at, n in self._runs:
                for j in range(0, n, per):
                    m = min(per, n - j)
                    copies.append((dst + (at + j) * block, src + (first + j) * block, m * block))
                self.bytes_up += n * block
        self._drv.memcpy_up_all(copies, self.stream.cuda_stream)

    def attend(self, layer: int, q: torch.Tensor, scale: float, wait: bool = True, row0: int = 0,
               release: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The device's attention over the streamed blocks of layer for q's rows, staging rows row0
        on (`first_rows`) → (o [B, Hq, D] f32, lse [B, Hq]).

        Static shapes (the whole slot, `lens` masks it), so a CUDA graph can hold it; wait=False
        there, and the caller waits for `copied[slot]` before the replay and records `free[slot]`
        after the step's last reader of the slot (release=False: a later sub-batch reads it too)."""
        slot = layer % 2
        if wait and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        B = q.shape[0]
        out = gpu_attention.decode_attention(self.pool, slot, q, self.table[row0:row0 + B], self.lens[row0:row0 + B],
                                             scale)
        if wait and release:
            self.release(layer)
        return out

    def ready(self, layer: int, stream: int | None = None) -> None:
        """Make the current stream (or the stream with driver handle `stream`) wait for layer's
        blocks (before a captured attend's replay)."""
        if stream is not None:
            driver().wait(stream, self.copied_h[layer % 2])
        elif self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[layer % 2])

    def release(self, layer: int, stream: int | None = None) -> None:
        """Layer's slot may be overwritten once the current stream's (or `stream`'s) work so far is done."""
        if stream is not None:
            driver().record(self.free_h[layer % 2], stream)
        elif self.cuda:
            self.free[layer % 2].record(torch.cuda.current_stream(self.device))
