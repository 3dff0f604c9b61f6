"""Each layer's GPU segments of a split decode step, captured as CUDA graphs.

    pre(i):  x → pre_attention → q, k, v; the new k/v into the device tier; q, k, v (float32)
             down into pinned staging (`down`), one copy (gpu_ops/split_io.py)
    attn(i): the device's attention shares → partial (o, lse) each: over its own tier, and over
             the streamed host blocks (offload/stream.py; the runner waits for their copy first)
             (only when there is a device tier or a streamer)
    post(i): (o_c, lse_c) up from pinned staging (`up`; with a streamer, read by a kernel,
             gpu_ops/host_read.py), merged with the device's partials by one kernel
             (gpu_ops/split_io.py) → post_attention → x

Between pre and post, outside any graph, the CPU attends: it waits for pre's event, reads q and
the new k/v from `down`, appends and attends, and writes (o, lse) into `up`. A step then costs
2–3 graph launches and one event a layer; every copy is inside a graph. Inputs and outputs live
in static buffers, one set per (sub-batch slot, batch size); new tokens whose KV goes to the host
write their device-tier copy into the pool's scratch block, and a sequence with no device-tier
tokens gets lse −inf there.
"""
from __future__ import annotations

import logging

import torch

from gpu_ops.attention import decode_attention
from gpu_ops.decode_step import collector_paused, no_sync_view
from gpu_ops.host_read import read_pinned
from gpu_ops.nf4 import MMA_AUTO_ROWS
from gpu_ops.runs import RunRows, run_bucket, run_codes
from gpu_ops.split_io import merge_into, pack_rows
from hetero.model import Model
from offload.kv_cache import TieredKVCache
from offload.stream import KVStreamer

log = logging.getLogger(__name__)
MMA_MAX_ROWS = MMA_AUTO_ROWS[-1]


class Captured:
    """Static buffers and graphs for one batch size and longest run of one sequence's rows (a power
    of two: `run_bucket`)."""

    def __init__(self, model: Model, cache: TieredKVCache, B: int, mempool, streamer: KVStreamer | None = None,
                 run_rows: int = 1, stream_row0: int = 0):
        """streamer: the KV streamer whose blocks this set's rows attend over, from its staging row
        stream_row0 on (`KVStreamer.first_rows`)."""
        c, dev, dt = model.cfg, model.device, model.act_dtype
        self.B, self.model, self.cache, self.streamer, self.stream_row0 = B, model, cache, streamer, stream_row0
        self.runs = RunRows(torch.ones(B, dtype=torch.int32, device=dev), run_rows) if run_rows > 1 else None
        self.gpu = cache.gpu
        z = lambda *s, dtype=dt: torch.zeros(*s, dtype=dtype, device=dev)  # noqa: E731
        pin = lambda *s: torch.zeros(*s, dtype=torch.float32, pin_memory=True)  # noqa: E731
        self.x = z(B, c.hidden_size)
        self.pos = z(B, dtype=torch.int64)
        nq, nk = B * c.num_heads * c.head_dim, B * c.num_kv_heads * c.head_dim
        self.down_dev = z(nq + 2 * nk, dtype=torch.float32)  # q, k, v as `pack_rows` lays them out
        self.down_all = pin(nq + 2 * nk)  # the same, on the host: one copy a layer
        self.down = dict(q=self.down_all[:nq].view(B, c.num_heads, c.head_dim),
                         k=self.down_all[nq:nq + nk].view(B, c.num_kv_heads, c.head_dim),
                         v=self.down_all[nq + nk:].view(B, c.num_kv_heads, c.head_dim))
        self.up = dict(o=pin(B, c.num_heads, c.head_dim), lse=pin(B, c.num_heads))
        self.o_c = z(B, c.num_heads, c.head_dim, dtype=torch.float32)
        self.lse_c = z(B, c.num_heads, dtype=torch.float32)
        self.o_x = z(B, c.num_heads, c.head_dim)  # the tiers' merged output, in the activations' dtype
        if self.gpu is not None:
            width = max(1, -(-cache.gpu_tokens_per_seq // cache.block_size))
            self.slots = torch.full((B,), self.gpu.scratch_block * cache.block_size, dtype=torch.int64, device=dev)
            self.dst = torch.empty_like(self.slots)  # flat slots the new k, v go to (`write_target`), set by pre(0)
            self.target: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (k pool, v pool, dst)
            self.tables = torch.full((B, width), self.gpu.scratch_block, dtype=torch.int32, device=dev)
            self.lens = z(B, dtype=torch.int32)
        self.pre: list[torch.cuda.CUDAGraph] = []
        self.attn: list[torch.cuda.CUDAGraph] = []  # empty without a device tier or a streamer
        self.post: list[torch.cuda.CUDAGraph] = []
        self.outs: list[tuple] = []  # per layer (q, k, v), pre's static outputs
        for i in range(c.num_layers):
            self._capture(i, mempool)

    def _pre(self, i: int):
        q, k, v = self.model.pre_attention(i, self.x, self.pos)
        if self.gpu is not None:
            if i == 0:  # where the new k, v go: the same for every layer, so its index arithmetic once a step
                kp, vp, dst = self.gpu.write_target(self.slots)
                self.dst.copy_(dst)
                self.target = (kp, vp, self.dst)
            self.gpu.write(i, self.slots, k, v, target=self.target)  # host-bound rows: into the scratch block
        pack_rows(q, k, v, self.down_dev)
        self.down_all.copy_(self.down_dev, non_blocking=True)  # into pinned memory: a captured async copy
        return q, k, v

    def _attn(self, i: int, q) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parts = []
        if self.gpu is not None:
            parts.append(decode_attention(self.gpu, i, q, self.tables, self.lens, self.model.scale, runs=self.runs))
        if self.streamer is not None:  # lens 0 on a step that streams nothing: lse -inf, merged away
            parts.append(self.streamer.attend(i, q, self.model.scale, wait=False, row0=self.stream_row0))
        return parts

    def _post(self, i: int, parts) -> None:
        if self.streamer is not None:  # by a kernel: a copy would queue behind the streamed KV blocks
            read_pinned(self.up["o"], self.o_c)
            read_pinned(self.up["lse"], self.lse_c)
        else:
            self.o_c.copy_(self.up["o"], non_blocking=True)
            self.lse_c.copy_(self.up["lse"], non_blocking=True)
        merge_into(self.o_x, [(self.o_c, self.lse_c), *parts])
        self.x.copy_(self.model.post_attention(i, self.x, self.o_x))

    def _capture(self, i: int, mempool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (Triton compiles, cuBLAS handles)
            q, k, v = self._pre(i)
            self._post(i, self._attn(i, q))
        torch.cuda.current_stream().wait_stream(side)
        g_pre, g_attn, g_post = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_pre, pool=mempool), collector_paused():
            q, k, v = self._pre(i)
        parts = []
        if self.gpu is not None or self.streamer is not None:
            with torch.cuda.graph(g_attn, pool=mempool), collector_paused():
                parts = self._attn(i, q)
            self.attn.append(g_attn)
        with torch.cuda.graph(g_post, pool=mempool), collector_paused():
            self._post(i, parts)
        self.pre.append(g_pre)
        self.post.append(g_post)
        self.outs.append((q, k, v))

    def load(self, x: torch.Tensor, pos: torch.Tensor, gpu_rows: list[int], gpu_slots: list[int],
             tables: torch.Tensor | None, lens: torch.Tensor | None, run_sizes: list[int] | None = None) -> None:
        """One step's inputs into the static buffers (asynchronous copies); the CPU's share empty
        (out 0, lse -inf) until a host job writes it."""
        self.x.copy_(x)
        self.pos.copy_(pos, non_blocking=True)
        if self.gpu is not None:
            scratch = self.gpu.scratch_block
            slots = torch.full((self.B,), scratch * self.cache.block_size, dtype=torch.int64)
            if gpu_rows:
                slots[torch.tensor(gpu_rows)] = torch.tensor(gpu_slots)
            self.slots.copy_(slots, non_blocking=True)
            self.tables.fill_(scratch)
            self.lens.zero_()
            if tables is not None:
                self.tables[:, : tables.shape[1]].copy_(tables, non_blocking=True)
                self.lens.copy_(lens, non_blocking=True)
            if self.runs is not None:
                codes = run_codes(run_sizes or [1] * self.B)
                self.runs.codes.copy_(torch.tensor(codes, dtype=torch.int32), non_blocking=True)
        self.up["o"].zero_()
        self.up["lse"].fill_(float("-inf"))


class SegmentGraphs:
    """Captured layer segments per (sub-batch slot, batch size), built on first use."""

    def __init__(self, model: Model, cache: TieredKVCache, max_pos: int, streamer: KVStreamer | None = None):
        self.model = no_sync_view(model, max_pos)  # same weights; its RoPE never syncs with the host
        self.cache, self.max_pos, self.streamer = cache, max_pos, streamer
        self._sets: dict[tuple[int, int, int], Captured] = {}

    # Above this many rows a sub-batch runs eagerly: there the 4-bit linears are bitsandbytes'
    # (gpu_ops.nf4), whose dequantized bf16 temporaries would fill each captured set's private
    # pool. Up to it they are nf4_mma's, which allocate nothing but their outputs.
    MAX_ROWS = MMA_MAX_ROWS

    @staticmethod
    def supported(model: Model) -> bool:
        return model.device.type == "cuda" and model.capturable(SegmentGraphs.MAX_ROWS)

    def get(self, slot: int, B: int, longest_run: int = 1) -> Captured:
        """The set for sub-batch `slot` of B rows whose longest run of one sequence has `longest_run` rows."""
        run_rows = run_bucket(longest_run)
        key = (slot, B, run_rows)
        if key not in self._sets:
            log.debug("capturing %d layers' decode segments for sub-batch %d, batch %d, runs of %d",
                      self.model.cfg.num_layers, slot, B, run_rows)
            # One memory pool per set: a set's graphs replay in capture order (pre0, post0, pre1, …) so
            # they may share one, but two sub-batches' sets interleave, and a shared pool would let one
            # set's intermediates overwrite the other's live outputs.
            # the streamer serves sub-batches of sequences a row each, each from its own staging row
            sv = self.streamer
            row0 = sv.row0(slot) if sv is not None else 0
            streams = sv is not None and run_rows == 1 and row0 + B <= sv.max_rows
            self._sets[key] = Captured(self.model, self.cache, B, torch.cuda.graph_pool_handle(),
                                       sv if streams else None, run_rows, row0)
        return self._sets[key]
