"""The heterogeneous step: the model on its device, the KV split over a device tier and a host tier.

Decode, per layer and sub-batch (docs/design.md, "one decode step"):
  start:  pre_attention (device) → new k/v into their tiers → q (and host-tier k/v) down on the
          copy stream → the device attends over its own blocks (queued) → the CPU attends over
          the host blocks (Numba, off the GIL) meanwhile
  finish: wait for the CPU's (o, lse) → up → merge by log-sum-exp → post_attention (device)
With two sub-batches the loop is skewed so the device runs one sub-batch's projections and MLP
while the CPU attends for the other (NEO / APEX): the CPU's share runs on the worker thread.
With one, the main thread would only wait for the worker, so it runs the CPU's share itself
while the device's share of attention (already queued) runs; so does offload/inline.py's lean
loop, for one sub-batch or two.

Prefill (`offload.prefill`, mixed in) runs layer by layer over the whole new chunk of a
sequence: this layer's earlier KV (both tiers) is gathered to the device once, the new tokens
attend to it and causally to themselves in one SDPA call, and the new k/v are written to their
tiers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import cpu_attention
from gpu_ops import attention as gpu_attention
from gpu_ops.runs import RunRows, run_codes
from gpu_ops.split_io import merge_into
from hetero.model import Model
from offload import rows
from offload.graphs import Captured, SegmentGraphs
from offload.kv_cache import Slots, TieredKVCache
from offload.moe import experts_scratch
from offload.prefill import Prefill
from offload.steps import GraphStep, LeanStep, PipelinedStep
from offload.stream import KVStreamer
from offload.timers import GpuSpans, Metrics, StepTimes, now
from offload.worker import ELSEWHERE, MAIN, WORKER, CpuWorker, Job

if TYPE_CHECKING:
    from offload.placement import PlacedWeights

@dataclass
class Part:
    """One sub-batch in flight through the decode layer loop."""

    seqs: list[int]
    x: torch.Tensor  # [B, H] residual stream, on the model's device
    pos: torch.Tensor  # [B]
    slots: Slots
    gpu_slots: torch.Tensor | None  # [n] on the pool's device
    gpu_rows: torch.Tensor | None
    host_rows: torch.Tensor | None  # rows whose new k/v go to the host tier (None: none, or all of them)
    host_slots: torch.Tensor | None  # their flat host slots [n] int64
    gpu_tables: tuple[torch.Tensor, torch.Tensor] | None  # (block tables, lens) on the pool's device
    gpu_runs: RunRows | None  # runs of one sequence's rows, attended together by the device
    host_tables: tuple[torch.Tensor, torch.Tensor] | None  # on the host
    buf: dict[str, torch.Tensor] | None = None  # pinned staging buffers (CUDA only)
    gpu_out: tuple[torch.Tensor, torch.Tensor] | None = None
    job: Job | None = None  # the CPU's share of the current layer
    cap: Captured | None = None  # this sub-batch's captured layer segments (CUDA graphs)
    work: cpu_attention.DecodeWork | None = None  # the host tier's attention plan for this step
    inline: bool = False  # the CPU's share runs in the main thread (one sub-batch, or the lean loop)
    streamed: bool = False  # the device attends over the host tier's first blocks (KVStreamer)
    stream_row0: int = 0  # from this staging row on (`KVStreamer.first_rows`)
    stream_last: bool = False  # the step's last sub-batch to read a layer's streamed blocks: it frees them
    stream_out: tuple[torch.Tensor, torch.Tensor] | None = None
    ready: torch.cuda.Event | None = None  # recorded when a layer's q (and k, v) are down; reused layer after layer


@dataclass
class Down:
    """What the CPU's share of a layer reads, on the host once `ready` has fired (None: already)."""

    ready: torch.cuda.Event | None
    q: torch.Tensor  # [B, Hq, D]
    k: torch.Tensor | None  # the new keys bound for the host tier (None: none)
    v: torch.Tensor | None
    rows: torch.Tensor | None = None  # k, v hold every row of the sub-batch: the host-bound ones are these


class Runner(Prefill):
    def __init__(self, model: Model, cache: TieredKVCache, threads: int | None = None,
                 sub_batches: int | None = None, detailed_timing: bool = False, max_batch: int = 1,
                 graphs: bool = True, max_context: int | None = None, stream_tokens: int = 0,
                 weights: PlacedWeights | None = None, driver_loop: bool = True):
        """sub_batches: 1 or 2 (None: 2 when there is a host tier to overlap with and the batch allows);
        max_batch: the batch the CUDA-graph decoder is built for (it grows if a larger one comes);
        stream_tokens: how many of each sequence's host-tier first tokens the device attends over
        after copying them up each step (up to max_batch sequences a row each, in one sub-batch or two; see
        offload/stream.py); weights: the plan's streamed and CPU-computed weight groups
        (offload/placement.py; None: all on the model's device);
        driver_loop: run a step of one or two captured sub-batches through offload/inline.py's lean loop.

        Streamed weights keep the per-layer CUDA graphs (the graphs read the staging slots, whose
        addresses never change; the copy and the wait for it happen between replays), but not the
        whole-step graph of an all-device step, which would have to wait inside itself. CPU-computed
        groups wait for the CPU in the middle of a layer: with any of them, decode runs eagerly."""
        self.model, self.cache, self.threads = model, cache, threads
        self.weights = weights.streamer if weights is not None else None
        self.host_compute = weights.host if weights is not None else None
        host_compute = self.host_compute is not None
        self.cfg = model.cfg
        self.dev = model.device
        self.cuda = self.dev.type == "cuda"
        self.sub_batches = sub_batches
        self.worker = CpuWorker(inline=not self.cuda)
        self.copy_stream = torch.cuda.Stream(self.dev) if self.cuda else None
        self.metrics = Metrics()
        self.spans = GpuSpans(detailed_timing and self.cuda)
        self.xfer = GpuSpans(detailed_timing and self.cuda)
        self._bufs: dict[int, dict[str, torch.Tensor]] = {}
        self.max_batch = max_batch
        self.segments = None  # per-layer CUDA graphs of the split step
        self.streamer = None
        if stream_tokens >= cache.block_size:
            self.streamer = KVStreamer(cache.host, stream_tokens, self.dev, max_batch)
        for copier in (self.streamer, self.weights):  # their copies up count as transfer time
            if copier is not None:
                copier.timer = self.xfer
        if graphs and SegmentGraphs.supported(model) and not host_compute:
            self.segments = SegmentGraphs(model, cache, max_context or model.cfg.max_position_embeddings,
                                          self.streamer)
        # the strategies this plan can use (offload/steps.py): the whole-step graph where every weight
        # is resident and there is a device tier; the lean loop where layer segments are captured
        all_device = graphs and self.cuda and cache.gpu is not None and (weights is None or weights.device_only)
        self.graph_step = GraphStep() if all_device else None
        self.lean_step = LeanStep() if driver_loop and self.segments is not None else None
        self.pipelined_step = PipelinedStep()
        self._experts = experts_scratch(model)  # the CPU's MoE experts' clock (None: none)

    # ================================================================== decode
    @torch.inference_mode()
    def decode(self, seqs: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One new token a row (tokens at positions) → float32 logits [B, V]. A sequence has one row,
        or a run of consecutive rows at consecutive positions (a speculative step: offload/rows.py)."""
        t0, st = now(), StepTimes(tokens=len(seqs))
        self.xfer.discard()  # copies a prefill queued are not this step's transfers
        self.cache.seal_complete()  # blocks the last step completed on a quantized device tier
        # between steps: blocks swapped out earlier come back where sequences have left room,
        # short of what this step's new tokens take on the device tier
        moved_in = self.cache.swap_in_free_room(keep_free=self.cache.gpu_blocks_needed(rows.runs(seqs)))
        if moved_in and self.cuda:
            st.h2d_bytes += moved_in * self.cache.gpu.nbytes // (self.cache.gpu.num_blocks + 1)
        slots = rows.reserve(self.cache, seqs)
        if self.graph_step is not None and self.graph_step.takes(self, seqs, slots):
            self._kernels_on([])
            logits = self.graph_step.run(self, seqs, tokens, positions, slots)  # everything on the GPU: one graph
            st.wall = now() - t0
            self._record(st)
            return logits
        parts = [self._part(seqs, tokens, positions, slots, a, b, k) for k, (a, b) in enumerate(self._split(seqs))]
        moved = self._weight_bytes()
        if self.streamer is not None:
            self.streamer.idle()
            if rows.run_sizes(seqs) is None:  # sequences a row each, not runs of drafts
                self._begin_stream(parts)
        for p in parts:  # the CPU's share of the host tier, once the streamer has taken its own
            if p.host_tables is not None:
                p.work = cpu_attention.DecodeWork(self.cache.host, *p.host_tables, self.threads)
        lean = self.lean_step is not None and self.lean_step.takes(self, parts)
        for p in parts:  # the lean loop runs every sub-batch's CPU share in this thread
            p.inline = lean or len(parts) == 1
        self._kernels_on(parts)
        self._begin_pass()
        (self.lean_step if lean else self.pipelined_step).run(self, parts, st)
        self.ready_weights(self.cfg.num_layers)
        logits = torch.cat([self.model.logits(p.x) for p in parts])  # a captured x is exactly [B, H]
        self.release_weights(self.cfg.num_layers)
        if any(p.streamed for p in parts):
            st.h2d_bytes += self.streamer.bytes_up
        up, down = self._weight_bytes()
        st.h2d_bytes += up - moved[0]
        st.d2h_bytes += down - moved[1]
        if self.cuda:
            torch.cuda.synchronize(self.dev)
            st.gpu, st.transfer = self.spans.total_s(), self.xfer.total_s()
        st.wall = now() - t0
        self._record(st)
        return logits

    def _kernels_on(self, parts: list[Part]) -> None:
        """The thread of this step's CPU kernels, one OpenMP pool live (offload/worker.py): the main one for an
        inline share or CPU-computed weights, the worker for two sub-batches', neither for host experts alone."""
        host = [p for p in parts if p.host_tables is not None]
        main = self.host_compute is not None or any(p.inline for p in host)
        self.worker.kernels_on(MAIN if main else WORKER if host else ELSEWHERE if self._experts is not None else None)

    def _split(self, seqs: list[int]) -> list[tuple[int, int]]:
        n = self.sub_batches
        if n is None:
            n = 2 if self.cuda and len(seqs) >= 2 and any(self.cache.seqs[s].host.num_tokens for s in seqs) else 1
        n = max(1, min(n, len(seqs)))
        # a run of one sequence's rows stays in one sub-batch: its rows read each other's new KV
        cuts = sorted({next(j for j in range(round(k * len(seqs) / n), len(seqs) + 1)
                            if j in (0, len(seqs)) or seqs[j] != seqs[j - 1]) for k in range(n + 1)})
        return list(zip(cuts, cuts[1:]))

    def _part(self, seqs, tokens, positions, slots, a: int, b: int, k: int) -> Part:
        c, dev = self.cache, self.dev
        sl = Slots()
        for j, s in enumerate(slots[a:b]):
            sl.extend(s, j)
        ids = torch.tensor(tokens[a:b])
        ss = seqs[a:b]
        host_tables = c.tables(ss, "host", slots[a:b]) if any(c.seqs[s].host.num_tokens for s in ss) else None
        sizes = rows.run_sizes(ss)
        if self.segments is not None and b - a <= SegmentGraphs.MAX_ROWS:
            cap = self.segments.get(k, b - a, max(sizes or [1]))
            cap.load(self.model.embed(ids), torch.tensor(positions[a:b]), sl.gpu_rows, sl.gpu_slots,
                     *(c.tables(ss, "gpu", slots[a:b]) if c.gpu is not None else (None, None)), sizes)
            # the graphs copy q, k, v down into cap.down and (o, lse) up from cap.up themselves
            return Part(seqs=ss, x=cap.x, pos=cap.pos, slots=sl, gpu_slots=None, gpu_rows=None,
                        host_rows=torch.tensor(sl.host_rows) if sl.host_rows else None,
                        host_slots=torch.tensor(sl.host_slots, dtype=torch.int64) if sl.host_rows else None,
                        gpu_tables=None, gpu_runs=None, host_tables=host_tables, cap=cap,
                        buf={**cap.down, **cap.up})
        gpu_tables = gpu_runs = None  # the eager loop's: on the pool's device
        if c.gpu is not None and any(c.seqs[s].gpu.num_tokens for s in ss):
            bt, lens = c.tables(ss, "gpu", slots[a:b])
            gpu_tables = (bt.to(c.gpu.k.device), lens.to(c.gpu.k.device))
            if sizes:
                codes = torch.tensor(run_codes(sizes), dtype=torch.int32)
                gpu_runs = RunRows(codes.to(c.gpu.k.device), max(sizes))
        pdev = c.gpu.k.device if c.gpu is not None else dev
        return Part(
            seqs=ss,
            x=self.model.embed(ids),
            pos=torch.tensor(positions[a:b], device=dev),
            slots=sl,
            gpu_slots=torch.tensor(sl.gpu_slots, device=pdev) if sl.gpu_rows else None,
            gpu_rows=torch.tensor(sl.gpu_rows, device=dev) if sl.gpu_rows else None,
            host_rows=torch.tensor(sl.host_rows, device=dev) if sl.host_rows else None,
            host_slots=torch.tensor(sl.host_slots, dtype=torch.int64) if sl.host_rows else None,
            gpu_tables=gpu_tables,
            gpu_runs=gpu_runs,
            host_tables=host_tables,
            buf=self._buffers(k, b - a) if self.cuda and host_tables is not None else None,
        )

    def _begin_stream(self, parts: list[Part]) -> None:
        """Give each row's host tier's first full blocks to the streamer (capped by the plan), the rest to the CPU."""
        first = self.streamer.first_rows([len(p.seqs) for p in parts])
        got = first and self.streamer.take([(([self.cache.seqs[s].host.blocks for s in p.seqs], p.host_tables)
                                              if p.host_tables is not None else None) for p in parts], first)
        for p, tables, r0 in zip(parts, got or [], first or []):
            if tables is not None:
                p.host_tables, p.streamed, p.stream_row0 = tables, True, r0
        if got:
            [p for p in parts if p.streamed][-1].stream_last = True

    def start_layer(self, i: int, p: Part, st: StepTimes) -> None:
        """Layer i's first half for sub-batch p: pre_attention, the new KV into its tiers, the
        device's attention queued, the CPU's handed to the worker (or run inline at finish)."""
        span = self.spans.begin()
        if p.cap is not None:
            p.cap.pre[i].replay()
            q, k, v = p.cap.outs[i]
        else:
            q, k, v = self.model.pre_attention(i, p.x, p.pos)
            if p.gpu_rows is not None:
                self.cache.gpu.write(i, p.gpu_slots, k[p.gpu_rows], v[p.gpu_rows])
        down = self._send_down(p, q, k, v, st) if p.host_tables is not None else None
        if p.cap is not None and p.cap.attn:
            if p.streamed:
                self.streamer.ready(i)
            p.cap.attn[i].replay()
            if p.stream_last:
                self.streamer.release(i)
        elif p.cap is None and p.gpu_tables is not None:
            p.gpu_out = gpu_attention.decode_attention(self.cache.gpu, i, q, *p.gpu_tables, self.model.scale,
                                                       runs=p.gpu_runs)
        if p.cap is None and p.streamed:
            p.stream_out = self.streamer.attend(i, q, self.model.scale, row0=p.stream_row0, release=p.stream_last)
        if p.stream_last and i + 2 < self.cfg.num_layers:
            self.streamer.prefetch(i + 2)
        self.spans.end(span)
        if down is not None:
            p.job = self.worker.submit(self._host_job, i, p, down, inline=p.inline)

    def finish_layer(self, i: int, p: Part, st: StepTimes) -> None:
        """Layer i's second half: the CPU's (o, lse) up, merged with the device's, post_attention."""
        o = lse = None
        if p.job is not None:
            t = now()
            o, lse, dt = p.job.wait()
            st.wait += now() - t
            st.cpu_attention += dt
            if self.cuda:
                st.h2d_bytes += o.numel() * 4 + lse.numel() * 4
            if self.cuda and p.cap is None:  # up from the pinned buffers: async DMAs on the compute stream
                xs = self.xfer.begin()
                o, lse = o.to(self.dev, non_blocking=True), lse.to(self.dev, non_blocking=True)
                self.xfer.end(xs)
        span = self.spans.begin()
        if p.cap is not None:  # the post graph copies (o, lse) up itself and merges the device's shares
            p.cap.post[i].replay()
            p.job = None
            self.spans.end(span)
            return
        found = [x for x in (None if o is None else (o, lse), p.gpu_out, p.stream_out) if x is not None]
        parts = [(a.to(self.dev), b.to(self.dev)) for a, b in found]
        p.job = p.gpu_out = p.stream_out = None
        merged = torch.empty(parts[0][0].shape, dtype=p.x.dtype, device=self.dev)
        merge_into(merged, parts)  # the tiers' partials by one kernel, as the post graph merges them
        p.x = self.model.post_attention(i, p.x, merged)
        self.spans.end(span)

    def _send_down(self, p: Part, q, k, v, st: StepTimes) -> Down:
        """Queue q and the host-bound new k/v down on the copy stream → what the CPU's share reads."""
        hr = p.host_rows
        if not self.cuda:  # on the host already; every row is host-bound on a CPU-only run
            every = hr is not None and hr.numel() == k.shape[0]
            kh = None if hr is None else (k if every else k[hr])
            vh = None if hr is None else (v if every else v[hr])
            return Down(None, q, kh, vh)
        B, n = q.shape[0], 0 if hr is None else hr.numel()
        buf = p.buf
        st.d2h_bytes += (q.numel() + 2 * n * k.shape[1] * k.shape[2]) * 4
        if p.ready is None:  # one event a sub-batch: its host job waits on it before the next record
            p.ready = torch.cuda.Event()
        ready = p.ready
        if p.cap is not None:  # pre's graph copied q, k, v of every row down already
            ready.record(torch.cuda.current_stream(self.dev))
            if not n:
                return Down(ready, buf["q"], None, None)
            return Down(ready, buf["q"], buf["k"], buf["v"], rows=None if n == B else hr)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(self.copy_stream):
            xs = self.xfer.begin(self.copy_stream)
            buf["q"][:B].copy_(q.float(), non_blocking=True)
            if n:
                buf["k"][:n].copy_(k[hr].float(), non_blocking=True)
                buf["v"][:n].copy_(v[hr].float(), non_blocking=True)
            self.xfer.end(xs, self.copy_stream)
            ready.record(self.copy_stream)
        return Down(ready, buf["q"][:B], buf["k"][:n] if n else None, buf["v"][:n] if n else None)

    @torch.inference_mode()  # thread-local: the worker needs its own
    def _host_job(self, i: int, p: Part, down: Down):
        """Runs on the CPU worker (or inline): append the host-tier k/v, attend over the host blocks."""
        if down.ready is not None:
            down.ready.synchronize()
        t = now()
        q, kh, vh = down.q, down.k, down.v
        if down.rows is not None:  # every row came down: the host-bound ones, picked now the copy is done
            kh, vh = kh[down.rows], vh[down.rows]
        if kh is not None:
            self.cache.host.write(i, p.host_slots, kh, vh)
        B = q.shape[0]
        out = (p.buf["o"][:B], p.buf["lse"][:B]) if p.buf is not None else None  # pinned: the copy up is a true async DMA
        o, lse = cpu_attention.decode_attention(self.cache.host, i, q.float(), None, None, self.model.scale,
                                                work=p.work, out=out)
        return o, lse, now() - t

    def _buffers(self, k: int, B: int) -> dict[str, torch.Tensor]:
        """Pinned staging buffers for sub-batch slot k, grown to at least B rows."""
        c = self.cfg
        have = self._bufs.get(k)
        if have is None or have["q"].shape[0] < B:
            n = max(B, 8)
            mk = lambda *s: torch.empty(*s, dtype=torch.float32, pin_memory=True)  # noqa: E731
            have = dict(q=mk(n, c.num_heads, c.head_dim), o=mk(n, c.num_heads, c.head_dim),
                        lse=mk(n, c.num_heads), k=mk(n, c.num_kv_heads, c.head_dim),
                        v=mk(n, c.num_kv_heads, c.head_dim))
            self._bufs[k] = have
        return have

    def _record(self, st: StepTimes) -> None:
        if self._experts is not None:
            st.cpu_experts = self._experts.take_seconds()
        m = self.metrics
        m.add(st)
        m.kv_gpu_tokens, m.kv_host_tokens = self.cache.tier_tokens()
        m.swapped_out_blocks, m.swapped_in_blocks = self.cache.swapped_out_blocks, self.cache.swapped_in_blocks

    # ------------------------------------------------------------------ streamed weights
    def _weight_bytes(self) -> tuple[int, int]:
        """(up, down) bytes moved for weights so far: streamed weights, CPU-computed groups' activations."""
        up = self.weights.bytes_up if self.weights is not None else 0
        hc = self.host_compute
        return up + (hc.bytes_up if hc is not None else 0), hc.bytes_down if hc is not None else 0

    def _begin_pass(self) -> None:
        if self.weights is not None:
            self.weights.reset()  # a pass cut short by an error may have left a layer in use

    def ready_weights(self, layer: int) -> None:
        """Before layer's first use in a pass (layer L: the head); see offload/weights.py."""
        if self.weights is not None:
            self.weights.ready(layer)

    def release_weights(self, layer: int) -> None:
        """After layer's last use in a pass is queued."""
        if self.weights is not None:
            self.weights.release(layer)

    def close(self) -> None:
        self.worker.close()
