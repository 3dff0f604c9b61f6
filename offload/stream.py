"""Host-tier KV the device attends over: the first blocks of a sequence's host tier, copied up
over PCIe each step, a layer ahead, while the CPU attends over the rest.

At batch 1 nothing else overlaps the CPU's attention (the next layer needs its output), so
the host tier's read rate is the CPU kernel's alone, ~55 GB/s on the GPU host; PCIe adds ~55
GB/s of its own, limited together by DRAM (~85–100 GB/s). The plan's `stream_tokens` says how
many of the host tier's first tokens take the PCIe road; they stay stored on the host.

The blocks go up as they are stored (bf16, int8 or int4: one block format for both tiers,
`cpu_attention.layout.part_shapes`) into a two-layer device pool of the host's format, and the
device's paged attention reads those bytes directly (`gpu_ops.attention`: int8 and int4
dequantized in registers), so an int4 block crosses PCIe and is read at its own size.

Per layer i, two staging slots (i % 2) on the device:
    copy stream:    wait slot free → copy the layer's blocks up (one copy per run of
                    consecutive blocks per tensor) → event `copied[slot]`
    compute stream: wait `copied[slot]` → paged attention over the slot → (o, lse) → event `free[slot]`
Layer i + 2's copy is queued right after layer i's attention, so each copy has a whole layer
of time to land. On a CPU stand-in device the same code runs without streams. Streamed blocks
are complete, so an int4 block is always in its codes, never in a bf16 tail (`begin` checks the
last one, the only one that could be being filled).
"""
from __future__ import annotations

import torch

from cpu_attention import HostKVPool, KVDtype, rotation
from gpu_ops import attention as gpu_attention
from gpu_ops.kv_pool import GpuKVPool
from offload.driver import driver, event_handle

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
    of the same bytes on both sides, the host pinned: what `_driver_copy`'s pointer arithmetic takes."""
    for n, t in parts.items():
        if not (t.is_contiguous() and t.is_pinned()):
            return False
        for r in raw:
            d = r[n]
            if not d.is_contiguous() or d.dtype != t.dtype or d[0].numel() != t[0, 0].numel():
                return False
    return True


class KVStreamer:
    def __init__(self, host: HostKVPool, max_tokens: int, device: torch.device):
        """Staging for up to max_tokens streamed tokens of one sequence, on `device`, in the host's format."""
        self.host, self.device = host, device
        self.max_blocks = max(1, max_tokens // host.block_size)
        self.cuda = device.type == "cuda"
        # the two slots are the two "layers" of a pool the paged-attention kernels already read
        self.pool = GpuKVPool(2, self.max_blocks, host.num_kv_heads, host.block_size, host.head_dim,
                              device=device, dtype=torch.float32 if host.dtype is KVDtype.F32 else torch.bfloat16,
                              kv_dtype=host.dtype)
        self.raw = [{n: t[s, : self.max_blocks] for n, t in self.pool.parts().items()} for s in range(2)]
        if any(host.dtype.rotated):  # the rotation's tensors on the device before a graph captures `attend`
            rotation.on_device(host.head_dim, device)
        self.table = torch.arange(self.max_blocks, dtype=torch.int32, device=device)[None]
        self.lens = torch.zeros(1, dtype=torch.int32, device=device)  # streamed tokens this step (static: graphs read it)
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

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def begin(self, blocks: list[int]) -> None:
        """This step streams these host blocks (a sequence's first ones, all full)."""
        if len(blocks) > self.max_blocks:
            raise ValueError(f"{len(blocks)} blocks to stream, staging holds {self.max_blocks}")
        if blocks and self.host.dtype is KVDtype.INT4 and bool((self.host.tails.slot[:, blocks[-1]] >= 0).any()):
            raise ValueError(f"host block {blocks[-1]} is still being filled (int4 tail): stream complete blocks only")
        self.blocks, self._runs, self.bytes_up = blocks, runs(blocks), 0
        self.lens.fill_(len(blocks) * self.host.block_size)

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
        """`_copy` through the driver: pointer arithmetic and one cuMemcpyHtoDAsync a run and
        piece (~4 µs of the main thread each, against ~25 for a torch copy_),
        on the streamer's stream, in the same pieces and order as `_copy`."""
        handle = self.stream.cuda_stream
        for name, src_base, layer_bytes, block in self._copy_plan:
            dst = self.raw[slot][name].data_ptr()
            src = src_base + layer * layer_bytes
            per = max(1, PIECE_BYTES // block)
            for first, at, n in self._runs:
                for j in range(0, n, per):
                    m = min(per, n - j)
                    self._drv.memcpy_up(dst + (at + j) * block, src + (first + j) * block, m * block, handle)
                self.bytes_up += n * block

    def attend(self, layer: int, q: torch.Tensor, scale: float, wait: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The device's attention over the streamed blocks of layer → (o [1, Hq, D] f32, lse [1, Hq]).

        Static shapes (the whole slot, `lens` masks it), so a CUDA graph can hold it; wait=False
        there, and the caller waits for `copied[slot]` before the replay and records `free[slot]` after."""
        slot = layer % 2
        if wait and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        out = gpu_attention.decode_attention(self.pool, slot, q, self.table, self.lens, scale)
        if wait:
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
