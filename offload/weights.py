"""Weights the plan streams: kept on the host, copied to the device a layer ahead of their use.

Each streamed layer (its streamed groups together: attention, MLP or experts, norms; the head
— final norm and lm_head — counts as layer L) lives in one pinned host buffer, its tensors
packed at 256-byte aligned offsets in their on-device format (NF4 packed codes and absmax, or
bf16). The device holds two staging slots, each as large as the largest streamed layer; the
k-th streamed layer always uses slot k % 2, and the model's linears for it are views into that
slot. So their addresses never change, and a CUDA graph captured over a layer reads whatever
the slot holds when it is replayed: the copy happens outside the graph, and the compute stream
waits for it first (offload/graphs.py needs no change for streamed weights).

The schedule is the pair the runner calls around each layer's use:

    ready(i):    (copy layer i up now if it is not there yet) → compute stream waits for
                 copied[slot] → queue the next streamed layer's copy if its slot is done with
    … the layer's GPU work (one or two sub-batches, graphs or eager) …
    release(i):  record free[slot] on the compute stream → queue the copy of the streamed layer
                 that comes after the next one into this slot (after free[slot], on the copy stream)

A layer's copy therefore runs on the dedicated copy stream while the layer before it computes.
Two sub-batches keep two layers live at once (sub-batch A starts layer i while B still has to
finish layer i-1): exactly the two slots, since consecutive streamed layers alternate slots. The
state of each slot (which layer it holds, whether that layer's use is over) makes the order
explicit: a copy never overwrites a slot whose layer is pending or in use; `ready` copies
itself whatever was not prefetched (the first step, a pass cut short by an error). With one or
two streamed layers both stay in their slots and nothing is copied after the first step.

On a CPU stand-in device the same code runs, the slots being host tensors and the copies
immediate: a schedule that overwrote a slot too early gives wrong tokens in CI.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

ALIGN = 256  # bytes: every staged tensor starts at a multiple (vectorized kernel loads, dtype views)


class Slot(enum.Enum):
    EMPTY = "empty"
    PENDING = "pending"  # holds (or is being copied) a layer not used yet
    IN_USE = "in use"
    DONE = "done"  # its layer's use is over: may be overwritten


@dataclass
class TensorRef:
    """One attribute holding a weight tensor: `setattr(owner, name, view)` rebinds it."""

    owner: object
    name: str

    def get(self) -> torch.Tensor:
        return getattr(self.owner, self.name)

    def set(self, t: torch.Tensor) -> None:
        setattr(self.owner, self.name, t)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class WeightStreamer:
    def __init__(self, layers: dict[int, list[TensorRef]], device: torch.device):
        """layers: per streamed layer (L for the head), the tensors it streams (now on the host).
        Their attributes are rebound to views of the layer's slot."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.order = sorted(layers)  # keys in the order a forward pass uses them
        self.slot_of = {key: k % 2 for k, key in enumerate(self.order)}
        self.next = {key: self.order[(k + 1) % len(self.order)] for k, key in enumerate(self.order)}
        sizes = {key: sum(_aligned(r.get().numel() * r.get().element_size()) for r in refs)
                 for key, refs in layers.items()}
        self.slot_bytes = max(sizes.values())
        nslots = min(2, len(self.order))
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(nslots)]
        self.host: dict[int, torch.Tensor] = {}  # per layer, its tensors packed as in the slot
        for key, refs in layers.items():
            buf = torch.empty(sizes[key], dtype=torch.uint8, pin_memory=self.cuda)
            slot, off = self.slots[self.slot_of[key]], 0
            for r in refs:
                t = r.get()
                n = t.numel() * t.element_size()
                _view(buf, off, t).copy_(t)
                r.set(_view(slot, off, t))  # the model now reads the slot
                off += _aligned(n)
            self.host[key] = buf
        self.held: list[int | None] = [None] * nslots
        self.state = [Slot.EMPTY] * nslots
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied = [torch.cuda.Event() for _ in range(nslots)] if self.cuda else None
        self.free = [torch.cuda.Event() for _ in range(nslots)] if self.cuda else None
        self.bytes_up = 0  # host → device, since construction
        self.timer = None  # a GpuSpans the copies are timed with (the runner's transfer timer)
        log.info("streaming %d layers' weights (%.1f MiB on the host); device staging 2 × %.1f MiB",
                 len(self.order), sum(sizes.values()) / 2**20, self.slot_bytes / 2**20)

    @property
    def nbytes(self) -> int:
        """Device bytes of the staging slots."""
        return sum(s.numel() for s in self.slots)

    def streams(self, key: int) -> bool:
        return key in self.slot_of

    # ------------------------------------------------------------------ the schedule
    def ready(self, key: int) -> None:
        """Before the first use of layer `key`'s weights in a pass: the compute stream waits for them."""
        if key not in self.slot_of:
            return
        s = self.slot_of[key]
        self._load(key)
        if self.held[s] != key:
            raise RuntimeError(f"weight staging: layer {key}'s slot still holds layer {self.held[s]} "
                               f"({self.state[s].value}); more than two streamed layers are live at once")
        self.state[s] = Slot.IN_USE
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[s])
        self._load(self.next[key])  # first pass: nothing was prefetched yet

    def release(self, key: int) -> None:
        """After the last use of layer `key`'s weights in a pass (its GPU work is queued)."""
        if key not in self.slot_of:
            return
        s = self.slot_of[key]
        if self.cuda:
            self.free[s].record(torch.cuda.current_stream(self.device))
        self.state[s] = Slot.DONE
        after = self.next[key]
        self._load(after)  # normally there already
        self._load(self.next[after])  # into the slot just released

    def reset(self) -> None:
        """At the start of a pass: whatever the last pass left (normally the first layers' prefetches;
        after an error between ready and release, a layer in use or a later layer's copy) may be
        overwritten. A slot that holds the layer asked for is still used as it is."""
        for s, st in enumerate(self.state):
            if st is Slot.IN_USE and self.cuda:
                self.free[s].record(torch.cuda.current_stream(self.device))
            if st is not Slot.EMPTY:
                self.state[s] = Slot.DONE

    def _load(self, key: int) -> None:
        """Queue layer `key`'s copy into its slot, unless it is there or the slot's layer is not done."""
        s = self.slot_of[key]
        if self.held[s] == key or self.state[s] in (Slot.PENDING, Slot.IN_USE):
            return
        src, dst = self.host[key], self.slots[s]
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.free[s])  # the slot's last reader is done (never recorded: no wait)
                span = self.timer.begin(self.stream) if self.timer is not None else None
                dst[: src.numel()].copy_(src, non_blocking=True)
                if span is not None:
                    self.timer.end(span, self.stream)
                self.copied[s].record(self.stream)
        else:
            dst[: src.numel()].copy_(src)
        self.held[s], self.state[s] = key, Slot.PENDING
        self.bytes_up += src.numel()


def _view(buf: torch.Tensor, off: int, like: torch.Tensor) -> torch.Tensor:
    """`like`-shaped, `like`-typed view of buf's bytes [off, off + like's bytes)."""
    n = like.numel() * like.element_size()
    return buf[off: off + n].view(like.dtype).view(like.shape)
