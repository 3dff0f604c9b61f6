"""The layer loop of a split decode step with one sub-batch, with the host doing only what the step needs.

At batch 1 each layer is a chain: the device's pre segment (projections, RoPE, q/k/v down) →
the CPU's attention over the host tier → the device's post segment (merge, O projection, MLP).
Nothing overlaps the CPU's share but the device's own attention share and the streamed copies,
so every microsecond of Python between the segments lengthens the step. Measured on the GPU
host: of ~560 µs a layer at 8k tokens, ~270 µs were the
main thread's Python around the kernel and the graph launches. This loop makes, per layer:

    launch pre(i)                                   (a graph: q, k, v into pinned `down`)
    record `ready`
    [wait for the streamed blocks, launch attn(i), free the slot, queue layer i+2's copies]
    wait for `ready`                                (q, k, v are on the host)
    append k, v to the host tier; the attention kernel → (o, lse) into pinned `up`
    launch post(i)                                  (a graph: (o, lse) up, merge, the rest)

through the CUDA driver (offload/driver.py) and Numba calls on numpy views made once: no torch
call inside the loop. The general loop (`Runner.start_layer` / `finish_layer`) does the same work through
torch; both write the same buffers, so their tokens are the same.

That Python alone was not what held the step: with it gone, an 8k step took as long until the
post segment stopped waiting for the copy engine (gpu_ops/host_read.py); with both, a layer of
8k int8 takes ~425 µs.

Two sub-batches A and B (NEO's schedule, still in this one thread): the device's work for one is
queued before the CPU attends for the other, so the device computes A's post segment and next
pre segment while the CPU attends for B, and the other way round:

    pre(A, 0), pre(B, 0)
    for each layer i:   CPU(A, i) → post(A, i), pre(A, i+1)    (the device meanwhile: B's segments)
                        CPU(B, i) → post(B, i), pre(B, i+1)    (the device meanwhile: A's)

Each sub-batch has its own captured set and buffers. A sub-batch's `up` buffer is written for
layer i+1 only after its `ready` for i+1 fired, which its post(i) precedes on the stream; its
`down` is written by pre(i+1), queued after the CPU has read it for layer i. With streamed host
KV each sub-batch waits for a layer's blocks before its attention, and the last to read them
frees the slot and queues layer i+2's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from offload.driver import RAW_GRAPHS, driver, event_handle, graph_handle
from offload.graphs import Captured
from offload.timers import StepTimes, now

if TYPE_CHECKING:
    from offload.runner import Part, Runner


class InlineLayers:
    """The driver handles and numpy views of one captured set (one batch size), made on first use."""

    def __init__(self, cap: Captured, stream: torch.cuda.Stream):
        self.pre = [graph_handle(g) for g in cap.pre]
        self.attn = [graph_handle(g) for g in cap.attn]
        self.post = [graph_handle(g) for g in cap.post]
        self.ready_event = torch.cuda.Event()  # q, k, v down: the host may read them
        self.ready = event_handle(self.ready_event, stream)
        self.q, self.k, self.v = (cap.down[n].numpy() for n in ("q", "k", "v"))
        self.o, self.lse = cap.up["o"].numpy(), cap.up["lse"].numpy()
        self.qs = np.empty_like(self.q)  # q times the softmax scale
        from cpu_attention.append import write_arrays  # Numba: imported with the first captured set

        self.write = write_arrays

    @staticmethod
    def usable(runner: Runner, parts: list[Part]) -> bool:
        """One or two captured sub-batches (none where the CPU computes weights), no weights moving,
        a CUDA driver to call; their CPU share then runs in this thread."""
        return (len(parts) in (1, 2) and all(p.cap is not None for p in parts) and runner.weights is None
                and RAW_GRAPHS and driver() is not None)

    def front(self, runner: Runner, p: Part, i: int, h: int) -> None:
        """Queue layer i's pre segment, the `ready` record the CPU waits for, and the device's attention."""
        drv, streamer = driver(), runner.streamer
        span = runner.spans.begin(h)
        drv.launch(self.pre[i], h)
        if p.work is not None:
            drv.record(self.ready, h)  # before the device's attention share: the CPU starts first
        if self.attn:
            if p.streamed:
                streamer.ready(i, h)
            drv.launch(self.attn[i], h)
            if p.stream_last:  # the step's last reader of the layer's streamed blocks
                streamer.release(i, h)
                if i + 2 < runner.cfg.num_layers:
                    streamer.prefetch(i + 2)
        runner.spans.end(span, h)

    def host(self, runner: Runner, p: Part, i: int, slots, rows, st: StepTimes) -> None:
        """Layer i's CPU share once q, k, v are down: the new rows into the host tier, the attention
        into `up`; its seconds and the wait for q, k, v into st."""
        if p.work is None:
            return
        t0 = now()
        driver().synchronize(self.ready)
        t = now()
        if slots is not None:
            k, v = (self.k, self.v) if rows is None else (self.k[rows], self.v[rows])
            self.write(runner.cache.host, i, slots, k, v)
        p.work.run(runner.cache.host, i, self.q, runner.model.scale, self.o, self.lse, scaled=self.qs)
        st.wait += t - t0
        st.cpu_attention += now() - t

    def back(self, runner: Runner, i: int, h: int) -> None:
        """Queue layer i's post segment ((o, lse) up, the merge, the rest of the layer)."""
        span = runner.spans.begin(h)
        driver().launch(self.post[i], h)
        runner.spans.end(span, h)

    def host_rows(self, p: Part):
        """(flat host slots of the host-bound new rows or None, their rows or None for every row)."""
        slots = p.host_slots.numpy() if p.host_slots is not None else None
        return slots, None if slots is None or len(slots) == len(self.q) else p.host_rows.numpy()

    def count(self, p: Part, slots, st: StepTimes, layers: int) -> None:
        """The bytes a step of this sub-batch moved down (q, host-bound k and v) and up (o, lse)."""
        if p.work is not None:
            kv_row = self.k[0].nbytes + self.v[0].nbytes
            st.d2h_bytes += layers * (self.q.nbytes + (kv_row * len(slots) if slots is not None else 0))
            st.h2d_bytes += layers * (self.o.nbytes + self.lse.nbytes)


def run_layers(runner: Runner, parts: list[Part], loops: list[InlineLayers], st: StepTimes) -> None:
    """All layers of one step for one sub-batch, or two skewed (the module's docstring): each part's
    layer i + 1 is queued as soon as its layer i's CPU share and post segment are."""
    h = torch.cuda.current_stream(runner.dev).cuda_stream
    L = runner.cfg.num_layers
    each = list(zip(loops, parts, [lp.host_rows(p) for lp, p in zip(loops, parts)]))
    for lp, p, _ in each:
        lp.front(runner, p, 0, h)
    for i in range(L):
        for lp, p, (slots, rows) in each:
            lp.host(runner, p, i, slots, rows, st)
            lp.back(runner, i, h)
            if i + 1 < L:
                lp.front(runner, p, i + 1, h)
    for lp, p, (slots, _) in each:
        lp.count(p, slots, st, L)
