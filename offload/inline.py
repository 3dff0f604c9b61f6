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
        """One captured sub-batch (batch 1, or any batch run as one) whose CPU share runs in this
        thread, no weights moving, a CUDA driver to call."""
        return (len(parts) == 1 and parts[0].cap is not None and parts[0].inline and runner.weights is None
                and RAW_GRAPHS and driver() is not None)

    def run(self, runner: Runner, p: Part, st: StepTimes) -> None:
        """All layers of one step for sub-batch p (its inputs loaded into the captured set)."""
        drv, cache, spans, streamer, write = driver(), runner.cache, runner.spans, runner.streamer, self.write
        pool, work = cache.host, p.work
        h = torch.cuda.current_stream(runner.dev).cuda_stream
        scale = runner.model.scale
        slots = p.host_slots.numpy() if p.host_slots is not None else None  # where the host-bound new k/v go
        rows = None if slots is None or len(slots) == len(self.q) else p.host_rows.numpy()  # None: every row
        L = runner.cfg.num_layers
        cpu = 0.0
        for i in range(L):
            span = spans.begin(h)
            drv.launch(self.pre[i], h)
            if work is not None:
                drv.record(self.ready, h)  # before the device's attention share: the CPU starts first
            if self.attn:
                if p.streamed:
                    streamer.ready(i, h)
                drv.launch(self.attn[i], h)
                if p.streamed:
                    streamer.release(i, h)
                    if i + 2 < L:
                        streamer.prefetch(i + 2)
            spans.end(span, h)
            if work is not None:
                drv.synchronize(self.ready)
                t = now()
                if slots is not None:
                    write(pool, i, slots, *((self.k, self.v) if rows is None else (self.k[rows], self.v[rows])))
                work.run(pool, i, self.q, scale, self.o, self.lse, scaled=self.qs)
                cpu += now() - t
            span = spans.begin(h)
            drv.launch(self.post[i], h)
            spans.end(span, h)
        st.cpu_attention += cpu
        if work is not None:
            kv_row = self.k[0].nbytes + self.v[0].nbytes
            st.d2h_bytes += L * (self.q.nbytes + (kv_row * len(slots) if slots is not None else 0))
            st.h2d_bytes += L * (self.o.nbytes + self.lse.nbytes)
