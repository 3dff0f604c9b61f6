"""The all-GPU decode step (and prefill) over a `Model` built on cuda and a `GpuKVPool`.

    embed → per layer: pre_attention → pool.write → paged decode attention → post_attention → logits

`GpuDecoder.step` captures that whole step as one CUDA graph per batch-size bucket: its inputs
(the token ids, or their embedding rows when the table stays in host memory) live in static buffers (block tables padded to `max_blocks_per_seq` columns, padding rows
pointed at the pool's scratch block), so a replay costs one launch instead of ~15 a layer.
Where a graph cannot hold the step (MoE routing that reads expert ids back to the host,
`Model.capturable`; a CPU model) it runs eagerly, with the same arithmetic.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import logging

import torch

from gpu_ops.attention import AttnKernel, decode_attention, prefill_attention
from gpu_ops.runs import RunRows, run_bucket, run_codes
from gpu_ops.kv_pool import GpuKVPool
from hetero.model import Model

log = logging.getLogger(__name__)


@contextlib.contextmanager
def collector_paused():
    """No cyclic garbage collection inside: a finalizer it ran during a CUDA graph capture (an old
    pool's cudaHostUnregister) would end the capture, and the process with it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def no_sync_view(model: Model, max_pos: int) -> Model:
    """A shallow copy of `model` (same weights) whose RoPE never syncs, for positions < max_pos."""
    view = copy.copy(model)
    view.rope = model.rope.fixed(max_pos)
    return view


def default_buckets(max_batch: int) -> list[int]:
    steps = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    return sorted({b for b in steps if b < max_batch} | {max_batch})


class GpuDecoder:
    """One decode token for each of B ≤ max_batch sequences, everything on the model's GPU."""

    def __init__(
        self,
        model: Model,
        pool: GpuKVPool,
        max_batch: int,
        max_blocks_per_seq: int,
        graphs: bool = True,
        attn: AttnKernel = AttnKernel.AUTO,
        buckets: list[int] | None = None,
        compile: bool = False,
    ):
        self.pool, self.max_batch, self.max_blocks, self.attn = pool, max_batch, max_blocks_per_seq, attn
        self.model = no_sync_view(model, max_blocks_per_seq * pool.block_size)
        self.device = model.device
        self.graphs = graphs and self.device.type == "cuda" and model.capturable(max_batch)
        self.buckets = buckets or default_buckets(max_batch)
        dev, i64, i32 = self.device, torch.int64, torch.int32
        self.ids = torch.zeros(max_batch, dtype=i64, device=dev)
        self.pos = torch.zeros(max_batch, dtype=i64, device=dev)
        self.slots = torch.zeros(max_batch, dtype=i64, device=dev)
        self.tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=i32, device=dev)
        self.lens = torch.ones(max_batch, dtype=i32, device=dev)
        self.run_codes = torch.ones(max_batch, dtype=i32, device=dev)  # RunRows.codes: 1, each row its own
        # an embedding table in host memory: the step's rows are gathered there and copied up into
        # x_in through pinned staging before the replay (a row a token: microseconds)
        self.host_embed = model.embed_w.device.type == "cpu" and dev.type != "cpu"
        self.x_in = self._x_host = self._x_copied = None
        if self.host_embed:
            self.x_in = torch.zeros(max_batch, model.cfg.hidden_size, dtype=model.act_dtype, device=dev)
            self._x_host = torch.zeros(max_batch, model.cfg.hidden_size, dtype=model.act_dtype,
                                       pin_memory=dev.type == "cuda")
            self._x_copied = torch.cuda.Event() if dev.type == "cuda" else None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (bucket, run rows)
        self._mempool = torch.cuda.graph_pool_handle() if self.graphs else None
        # torch.compile fuses the ~60 small elementwise kernels a layer (norms, RoPE, SwiGLU,
        # casts) that otherwise cost more than the weights' bytes at batch 1; one compile per bucket
        self._fwd = torch.compile(self._forward, dynamic=False) if compile else self._forward

    @torch.inference_mode()
    def step(
        self,
        token_ids: torch.Tensor,  # [B] the last token of each sequence
        positions: torch.Tensor,  # [B] its position
        slots: torch.Tensor,  # [B] its flat KV slot in the pool (block * BS + offset)
        block_tables: torch.Tensor,  # [B, ≤ max_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [B] tokens in the pool after this one is written
        run_sizes: list[int] | None = None,  # runs of one sequence's rows, in order (offload/rows.run_sizes)
    ) -> torch.Tensor:
        """→ float32 logits [B, V]. With runs, a program attends several rows of a run (each KV block
        read once for them): a graph per (batch bucket, longest run's power of two)."""
        B, W = block_tables.shape
        if B > self.max_batch or W > self.max_blocks:
            raise ValueError(
                f"batch {B} × {W} blocks exceeds the decoder's {self.max_batch} × {self.max_blocks}: "
                "build the GpuDecoder with a larger max_batch / max_blocks_per_seq"
            )
        nb = next(b for b in self.buckets if b >= B)
        rows = run_bucket(max(run_sizes)) if run_sizes else 1
        self._load(B, nb, token_ids, positions, slots, block_tables, seq_lens, run_sizes)
        if not self.graphs:  # the graph's own inputs, run eagerly (fresh tensors here gave wrong tokens on CUDA)
            return self._fwd(self.ids[:nb], self.pos[:nb], self.slots[:nb], self.tables[:nb], self.lens[:nb],
                             rows)[:B]
        if (nb, rows) not in self._graphs:
            self._graphs[nb, rows] = self._capture(nb, rows)
        graph, logits = self._graphs[nb, rows]
        graph.replay()
        return logits[:B].clone()

    def _load(self, B, nb, token_ids, positions, slots, block_tables, seq_lens, run_sizes) -> None:
        """Copy the inputs into the static buffers; rows B..nb and unused columns → the scratch block."""
        scratch = self.pool.scratch_block
        if self.host_embed:
            if self._x_copied is not None:
                self._x_copied.synchronize()  # the last step's rows have left the staging buffer
            if self.model.embed_w.dtype == self._x_host.dtype:
                self.model.host_rows(token_ids, out=self._x_host[:B])
            else:
                self._x_host[:B].copy_(self.model.host_rows(token_ids))
            self.x_in[:B].copy_(self._x_host[:B], non_blocking=True)
            if self._x_copied is not None:
                self._x_copied.record()
        self.ids[:B].copy_(token_ids, non_blocking=True)
        self.pos[:B].copy_(positions, non_blocking=True)
        self.slots[:B].copy_(slots, non_blocking=True)
        self.lens[:B].copy_(seq_lens, non_blocking=True)
        if run_sizes:
            self.run_codes[:B].copy_(torch.tensor(run_codes(run_sizes), dtype=torch.int32), non_blocking=True)
        else:
            self.run_codes[:B].fill_(1)
        self.tables[:nb].fill_(scratch)
        self.tables[:B, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        if nb > B:
            self.ids[B:nb].zero_()
            self.pos[B:nb].zero_()
            self.slots[B:nb].fill_(scratch * self.pool.block_size)
            self.lens[B:nb].fill_(1)
            self.run_codes[B:nb].fill_(1)

    def _capture(self, nb: int, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        log.debug("capturing the decode step for batch bucket %d, runs of up to %d rows", nb, rows)
        args = (self.ids[:nb], self.pos[:nb], self.slots[:nb], self.tables[:nb], self.lens[:nb], rows)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles kernels, creates handles (idempotent KV writes)
            self._fwd(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool), collector_paused():
            logits = self._fwd(*args)
        return graph, logits

    def _forward(self, ids, pos, slots, tables, lens, rows: int) -> torch.Tensor:
        m = self.model
        runs = RunRows(self.run_codes[: ids.shape[0]], rows) if rows > 1 else None
        x = self.x_in[: ids.shape[0]] if self.host_embed else m.embed(ids)
        target = self.pool.write_target(slots)  # where the new k, v go: the pool, or its blocks' tails
        kp, vp, dst = target
        for i in range(m.cfg.num_layers):
            q, k, v = m.pre_attention(i, x, pos, kv_out=(kp, vp, i, dst, self.pool.block_size))
            if k is not None:  # not stored by the fused kernels
                self.pool.write(i, slots, k, v, target=target)
            o, _ = decode_attention(self.pool, i, q, tables, lens, m.scale, self.attn, out_dtype=x.dtype, runs=runs)
            x = m.post_attention(i, x, o)
        return m.logits(x)


@torch.inference_mode()
def prefill(
    model: Model,
    pool: GpuKVPool,
    token_ids: torch.Tensor,  # [T] tokens at positions q_pos0 .. q_pos0 + T - 1 of one sequence
    q_pos0: int,
    slots: torch.Tensor,  # [T] their flat KV slots
    block_table: torch.Tensor,  # [≥ ceil((q_pos0 + T) / BS)] int32: the sequence's blocks from position 0
    all_logits: bool = False,
) -> torch.Tensor:
    """One chunk of prefill, eager, all on the GPU → float32 logits of the last token [1, V] (or all [T, V])."""
    dev = model.device
    T = token_ids.shape[0]
    model = no_sync_view(model, q_pos0 + T)  # Rope's growth check would sync twice a layer
    pos = torch.arange(q_pos0, q_pos0 + T, device=dev)
    slots, block_table = slots.to(dev), block_table.to(dev)
    x = model.embed(token_ids.to(dev))
    for i in range(model.cfg.num_layers):
        q, k, v = model.pre_attention(i, x, pos)
        pool.write(i, slots, k, v)
        o, _ = prefill_attention(pool, i, q, block_table, q_pos0 + T, q_pos0, model.scale)
        x = model.post_attention(i, x, o.to(x.dtype))
    return model.logits(x if all_logits else x[-1:])
