"""The decode step's strategies, one loop each (the runner is an argument, not an attribute: a
strategy held by its runner must not make a reference cycle, which only the cyclic collector
frees, at any moment, CUDA graph captures included). Which of them a runner has is settled when it is
built from the plan; a step takes the first that fits where the batch's KV lies now (a sequence's
first tokens are all on the device tier, later ones reach the host tier).

    GraphStep      every sequence's KV on the device tier, all weights resident: the whole step as
                   one CUDA graph (gpu_ops.decode_step)
    LeanStep       one or two captured sub-batches with a host tier: the layer loop of
                   offload/inline.py (two: skewed, NEO / APEX), driver launches and Numba calls on
                   numpy views, no torch call a layer
    PipelinedStep  the general loop through torch, sub-batches skewed the same way, the CPU's share
                   on the worker thread; also the eager loop when weights are streamed or computed
                   by the CPU
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from offload import rows
from offload.inline import InlineLayers, run_layers
from offload.timers import StepTimes

if TYPE_CHECKING:
    from offload.graphs import Captured
    from offload.kv_cache import Slots
    from offload.runner import Part, Runner


class GraphStep:
    """The all-device step: one CUDA graph per batch bucket, the embedding rows copied up first
    when the table stays on the host."""

    def __init__(self):
        self.decoder = None  # gpu_ops.decode_step.GpuDecoder, built at the first step it takes

    @staticmethod
    def takes(r: Runner, seqs: list[int], slots: list[Slots]) -> bool:
        return all(sl.gpu_rows and not r.cache.seqs[s].host.num_tokens for s, sl in zip(seqs, slots))

    def run(self, r: Runner, seqs: list[int], tokens: list[int], positions: list[int],
            slots: list[Slots]) -> torch.Tensor:
        from gpu_ops.decode_step import GpuDecoder

        c, dev = r.cache, r.dev
        bt, lens = c.tables(seqs, "gpu", slots)
        need_blocks = -(-c.gpu_tokens_per_seq // c.block_size)
        d = self.decoder
        if d is None or d.max_batch < len(seqs) or d.max_blocks < max(bt.shape[1], need_blocks):
            d = self.decoder = GpuDecoder(r.model, c.gpu, max(r.max_batch, len(seqs)), max(need_blocks, bt.shape[1]))
        return d.step(torch.tensor(tokens), torch.tensor(positions, device=dev),
                      torch.tensor([sl.gpu_slots[0] for sl in slots], device=dev), bt.to(dev), lens.to(dev),
                      rows.run_sizes(seqs))


class LeanStep:
    """One or two captured sub-batches whose CPU share runs in the main thread: offload/inline.py's loops."""

    def __init__(self):
        self.loops: dict[Captured, InlineLayers] = {}  # a captured set's driver handles, made once

    @staticmethod
    def takes(r: Runner, parts: list[Part]) -> bool:
        return InlineLayers.usable(r, parts)

    def run(self, r: Runner, parts: list[Part], st: StepTimes) -> None:
        for p in parts:
            if p.cap not in self.loops:
                self.loops[p.cap] = InlineLayers(p.cap, torch.cuda.current_stream(r.dev))
        run_layers(r, parts, [self.loops[p.cap] for p in parts], st)


class PipelinedStep:
    """Layer by layer through torch: part p finishes layer i-1, then starts layer i, so with two
    sub-batches the device works on one while the CPU attends for the other; streamed weights are
    waited for before a layer's first use and released after its last."""

    @staticmethod
    def run(r: Runner, parts: list[Part], st: StepTimes) -> None:
        L = r.cfg.num_layers
        for i in range(L + 1):
            for k, p in enumerate(parts):
                if i > 0:
                    r.finish_layer(i - 1, p, st)
                    if k == len(parts) - 1:
                        r.release_weights(i - 1)  # layer i-1's weights: last use queued
                if i < L:
                    if k == 0:
                        r.ready_weights(i)  # layer i's weights: the device waits for them (streamed)
                    r.start_layer(i, p, st)
