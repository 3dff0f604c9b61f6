"""A mixture-of-experts layer whose experts the plan splits between the device and the host.

Per layer and step (`MoEFeedForward`, the layer's `ffn`):

    device:  router → top-k → each slot's expert as the device's index (or −1) and the host's
    host:    h, the slots' weights and host indices down → the CPU computes the host's experts
             (cpu_attention.experts, Numba) → their weighted sum up
    device:  meanwhile its own experts for every slot in two grouped kernels (gate/up with
             SiLU·up, down: gpu_ops.nf4_gemv.nf4_experts_gemv) → weighted sum → + the host's

On CUDA the routing after the router's product is one kernel, and the weighted sum with the
host's share another, at any row count (gpu_ops.moe_route; `route` and `combine` below are their
torch twins, which CPU stand-ins run). Down and up are no copies there: the routing kernel writes
the host's input into page-locked memory (`HostStaging.down`), and the sum's kernel reads the
host's share where the CPU wrote it (`HostStaging.up`); a cast, a concatenation and two copies
took ~10 µs of a layer's chain on the H200 host.

On CUDA the host's share is queued on a side stream and run by the experts' own pool of threads
(cpu_attention.experts_pool): signalled in memory where the driver's stream memory operations
work (the stream sets a flag the pool's thread polls, then waits for the flag it sets back:
`HostStaging.queue`), else as a host function (the CUDA driver's thread calls the Numba
kernel's C entry point, `cuLaunchHostFunc`). No Python runs in between and nothing syncs, so the
step still captures as one CUDA graph (memory-operation or host nodes per MoE layer), and the CPU
computes while the GPU runs its experts. The main stream waits for the side stream only before
the sum. Many rows (prefill) take the same path, except that the device's experts run as one
grouped GEMM over the chunk's slots sorted by expert (gpu_ops.moe_prefill; one expert at a time
where they are not stacked NF4). From the plan's `moe_upload_rows` on (the cost model's choice),
the host's experts go up instead of being computed by the CPU (`_upload_host`: the layer's whole
int4 stacks in pieces, applied by the same grouped GEMM): the rows share each expert's weights,
which the CPU kernel would decode again for every token, while a copy reads them once; such a
step is not captured. On a CPU stand-in device the host's share is a
plain call (and the uploaded path the same arithmetic, expert by expert: `_stream_host`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hetero.config import ModelConfig
from hetero.model import Linear, swiglu
from offload.moe_host import HostStaging


@dataclass
class DeviceExperts:
    """The experts the device holds for one layer: `experts` (layer indices, ascending), their
    (gate_up, down) linears, and where these are NF4 on CUDA the same codes stacked for the
    grouped kernel (gate_up, gate_up absmax, down, down absmax; the linears are views of them)."""

    experts: list[int]
    linears: list[tuple[Linear, Linear]]
    stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class TorchHostExperts:
    """Host experts in a float format (a CPU plan's stand-in, tests): the torch math, one expert at a time."""

    def __init__(self, experts: list[int], linears: list[tuple[Linear, Linear]]):
        self.experts, self.linears = experts, linears

    def __call__(self, x: np.ndarray, ids: np.ndarray, w: np.ndarray, out: np.ndarray, scratch=None) -> None:
        xt, wt, k = torch.from_numpy(x), torch.from_numpy(w).reshape(-1), ids.shape[1]
        acc = torch.zeros(out.shape, dtype=torch.float32)
        for j, sel in by_expert(torch.from_numpy(ids).reshape(-1), len(self.experts)):
            gate_up, down = self.linears[j]
            acc.index_add_(0, sel // k, swiglu(gate_up, down, xt[sel // k]).float() * wt[sel, None])
        out[:] = acc.numpy()


class MoEFeedForward:
    """h [N, H] → the layer's routed experts' weighted sum [N, H] (the residual not added)."""

    # rows up to which the device's experts run in the grouped GEMV kernels (a slot a program: each
    # slot reads its expert's weights; more rows take the grouped GEMM, gpu_ops.moe_prefill), and the
    # host's are computed by the CPU; with up to this many rows nothing is read back to the host: a
    # CUDA graph can hold the layer
    GROUPED_ROWS = 64

    def __init__(self, cfg: ModelConfig, router: torch.Tensor, device_experts: DeviceExperts | None,
                 host_experts, device: torch.device, staging: HostStaging | None, upload_rows: int = 0):
        """upload_rows: rows from which a step's host experts go up to the device (the plan's
        `moe_upload_rows`, the cost model's choice); 0: from GROUPED_ROWS + 1."""
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        self.cfg, self.router, self.dev, self.host, self.staging = cfg, router, device, host_experts, staging
        self.device_experts = device_experts
        self.stream_rows = upload_rows or self.GROUPED_ROWS + 1  # rows from which the host's int4 experts go up
        # rows a step may have with nothing read back to the host (`Model.capturable`): the copies up
        # are not in a graph
        self.graph_rows = self.GROUPED_ROWS if device_experts is None or device_experts.stacked is not None else 0
        if host_experts is not None:
            self.graph_rows = min(self.graph_rows, self.stream_rows - 1)
        self.routed: torch.Tensor | None = None  # [E] how often each expert was routed to, while counting
        self.out_features = cfg.hidden_size
        self.norm_topk = cfg.norm_topk_prob
        self.k = k
        gpu_map = torch.full((E,), -1, dtype=torch.int32)
        host_map = torch.full((E,), -1, dtype=torch.int32)
        if device_experts is not None:
            gpu_map[device_experts.experts] = torch.arange(len(device_experts.experts), dtype=torch.int32)
        if host_experts is not None:
            host_map[host_experts.experts] = torch.arange(len(host_experts.experts), dtype=torch.int32)
        self.gpu_map, self.host_map = gpu_map.to(device), host_map.to(device)
        self.cuda = device.type == "cuda"
        self.kernels = None  # gpu_ops.moe_route on CUDA: the decode steps' routing and sum
        if self.cuda:
            from gpu_ops import moe_route

            self.kernels = moe_route
        self.int4_host = host_experts is not None and not isinstance(host_experts, TorchHostExperts)
        if host_experts is not None and (staging is None or self.cuda and not self.int4_host):
            raise ValueError("host experts need the staging; on CUDA, in the int4 format")
        if self.cuda and self.int4_host:
            staging.layers.append(host_experts)  # built in layer order: a prefill copies the next one's up ahead

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """h [N, H] → the experts' sum [N, H] in h's dtype, plus residual [N, H] where given (added in
        the sum's kernel on CUDA)."""
        N = h.shape[0]
        fused = self.kernels  # on CUDA one kernel each for the routing and the sum
        to_cpu = self.host is not None and (N < self.stream_rows or not self.int4_host)  # the CPU computes them
        if fused:  # the routing kernel also writes the host's input into its page-locked buffer
            stage = self.staging.down if to_cpu and N <= self.staging.max_rows else None
            idx, w, local, ids = fused.route(h, self.router, self.k, self.norm_topk, self.gpu_map, self.host_map, stage)
        else:
            idx, w, local, ids = route(h, self.router, self.k, self.norm_topk, self.gpu_map, self.host_map)
        if self.routed is not None:
            self.routed += torch.bincount(idx.reshape(-1).long(), minlength=self.cfg.num_experts)
        host = lambda: None  # noqa: E731  the host's weighted sum [N, H], once its work is done
        y = None  # each slot's output [N·k, H] (a prefill's, both devices')
        if self.host is not None:
            if to_cpu:
                host = self._queue_host(h, ids, w)
            elif self.cuda:  # a prefill chunk: its tokens share each expert's weights
                y = self._upload_host(h, ids, torch.zeros(N * self.k, self.out_features, dtype=torch.bfloat16,
                                                          device=self.dev))
            else:
                host = functools.partial(self._stream_host, h, ids, w)
        dx = self.device_experts
        if dx is not None and dx.stacked is not None:  # NF4 on CUDA: every expert in two launches
            # the GEMV kernels for few rows, unless the host's experts went up (their rows are in y)
            y = self._grouped(h, local) if N <= self.GROUPED_ROWS and y is None else self._grouped_many(h, local, y)
            return (fused.combine if fused else combine)(y, w, host(), h.dtype, residual)
        out = combine(y, w, None, torch.float32) if y is not None else None
        for part in (self._device(h, local, w) if dx is not None else None, host()):
            if part is not None:
                part = part.to(h.device, non_blocking=True)  # the host's share: in host memory on CUDA
                out = part if out is None else out + part
        return out.to(h.dtype) if residual is None else residual + out.to(h.dtype)

    def _grouped(self, h: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Each slot's output [N·k, H] from the device's experts in two grouped kernels (gate/up with
        SiLU·up, down); a slot routed elsewhere (local −1) gets a zero row."""
        from gpu_ops.nf4_gemv import nf4_experts_gemv

        gu, gu_a, dn, dn_a = self.device_experts.stacked
        H, Fi = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        slots = local.reshape(-1)
        act = nf4_experts_gemv(h, slots, gu, gu_a, (2 * Fi, H), xdiv=self.k, swiglu=True)  # [N·k, F]
        return nf4_experts_gemv(act, slots, dn, dn_a, (H, Fi), xdiv=1)

    def _grouped_many(self, h: torch.Tensor, local: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """`_grouped` for many rows (a prefill chunk): the slots sorted by expert into blocks, each
        block's expert's codes read once for its rows (gpu_ops.moe_prefill); written into y where
        given (the host's slots' rows already there: `_upload_host`)."""
        from gpu_ops.moe_prefill import block_rows, grouped_gemm, sort_slots

        gu, gu_a, dn, dn_a = self.device_experts.stacked
        H, Fi, E = self.cfg.hidden_size, self.cfg.moe_intermediate_size, len(self.device_experts.experts)
        P = local.numel()
        bm = block_rows(P, E)
        slots, blocks = sort_slots(local, E, bm)
        act = grouped_gemm(h, slots, blocks, bm, gu, gu_a, (2 * Fi, H), xdiv=self.k, rows=P, swiglu=True)  # [N·k, F]
        return grouped_gemm(act, slots, blocks, bm, dn, dn_a, (H, Fi), xdiv=1, rows=P, zero=True, out=y)

    def _device(self, h: torch.Tensor, local: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The device's experts' weighted sum, float32 [N, H], one expert at a time over its tokens: for
        prefill chunks, and experts not stacked for the grouped kernels (local [N, k]: each slot's
        expert among the device's, −1: elsewhere)."""
        dx = self.device_experts
        N, k = local.shape
        wflat = w.reshape(-1)
        out = torch.zeros(N, self.cfg.hidden_size, dtype=torch.float32, device=h.device)
        for j, sel in by_expert(local.reshape(-1), len(dx.experts)):
            gate_up, down = dx.linears[j]
            out.index_add_(0, sel // k, swiglu(gate_up, down, h[sel // k]).float() * wflat[sel, None])
        return out

    def _queue_host(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The host's experts' weighted sum, float32 [N, H] on the device (ids [N, k]: each slot's
        expert among the host's, −1: elsewhere), as a function returning it: computed now on a CPU
        stand-in; on CUDA queued on the side stream (`HostStaging.queue`), the main stream waiting
        for it when the function is called (after the device's experts are queued: they overlap)."""
        N, k = ids.shape
        H = self.cfg.hidden_size
        st = self.staging
        if N > st.max_rows:
            raise ValueError(f"{N} rows, more than the {st.max_rows} the host experts were sized for")
        if not self.cuda:
            out = np.empty((N, H), np.float32)
            self.host(h.float().contiguous().numpy(), ids.numpy(), w.float().contiguous().numpy(), out, st.scratch)
            return lambda: torch.from_numpy(out)
        main = torch.cuda.current_stream(self.dev)
        st.side.wait_stream(main)  # the routing kernel wrote h, w and ids into st.down (`route`'s stage)
        n = N * (H + 2 * k)
        with torch.cuda.stream(st.side):
            down = st.down.numpy()
            st.queue(self.host.descriptor(down[: N * H].reshape(N, H), down[N * (H + k): n].view(np.int32).reshape(N, k),
                                          down[N * H: N * (H + k)].reshape(N, k), st.up.numpy()[:N], st.scratch))

        def result() -> torch.Tensor:
            """The sum in page-locked host memory: the combining kernel reads it there, no copy up."""
            main.wait_stream(st.side)
            return st.up[:N]

        return result

    def _upload_host(self, h: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The host's experts for many rows on CUDA, computed by the device into the rows of y [N·k, H]
        of the slots routed to them (ids as `_queue_host`'s; y's other rows untouched), returned: the
        layer's host experts go up whole, a piece (planner.workspace.moe_host_piece_bytes) at a time,
        the next piece's copy in flight while the device applies this one's to the slots routed to
        them in the grouped int4 GEMM (gpu_ops.moe_prefill)."""
        from gpu_ops.moe_prefill import block_rows, grouped_gemm, sort_slots

        he, st = self.host, self.staging
        E, H, Fi = len(he.experts), self.cfg.hidden_size, self.cfg.moe_intermediate_size
        N, k = ids.shape
        pieces = st.pieces(he)
        main = torch.cuda.current_stream(self.dev)
        bm = block_rows(N * k, E)
        ahead = st.take(he) or st.fetch(he, *pieces[0])
        for n, (a, b) in enumerate(pieces):
            (gq, gs, dq, ds), done = ahead
            if n + 1 < len(pieces):
                ahead = st.fetch(he, *pieces[n + 1])
            else:  # the next layer's first piece goes up while this one computes (two in flight, as above)
                st.fetch_next(he)
            main.wait_event(done)
            for t in (gq, gs, dq, ds):
                t.record_stream(main)
            slots, blocks = sort_slots(ids, b - a, bm, lo=a)
            act = grouped_gemm(h, slots, blocks, bm, gq, gs, (2 * Fi, H), xdiv=k, rows=N * k, swiglu=True, int4=True)
            grouped_gemm(act, slots, blocks, bm, dq, ds, (H, Fi), xdiv=1, rows=N * k, int4=True, out=y)
        return y

    def _stream_host(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`_upload_host`'s arithmetic on a CPU stand-in, float32 [N, H]: each routed host expert
        dequantized to the activations' dtype and applied to its tokens (ids as `_queue_host`'s)."""
        he = self.host
        N, k = ids.shape
        wflat = w.reshape(-1)
        out = torch.zeros(N, self.cfg.hidden_size, dtype=torch.float32, device=h.device)
        for j, sel in by_expert(ids.reshape(-1), len(he.experts)):
            gq, gs, dq, ds = (torch.from_numpy(a[j]) for a in (he.gu_q, he.gu_s, he.d_q, he.d_s))
            tok = sel // k
            g, u = _linear_int4(h[tok], gq, gs).chunk(2, dim=-1)
            y = _linear_int4((F.silu(g.float()) * u.float()).to(h.dtype), dq, ds)
            out.index_add_(0, tok, y.float() * wflat[sel, None])
        return out

def by_expert(slots: torch.Tensor, n: int) -> list[tuple[int, torch.Tensor]]:
    """slots [S] (each slot's expert among n, −1: another device's) → (expert, its slots) for each
    expert that has any, in expert order, from one read-back (how many slots each has)."""
    order = torch.argsort(slots)
    counts = torch.bincount(slots + 1, minlength=n + 1).tolist()  # [−1, 0, 1, …]
    groups, at = [], counts[0]
    for j, c in enumerate(counts[1:]):
        if c:
            groups.append((j, order[at: at + c]))
            at += c
    return groups


def _linear_int4(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, piece: int = 2**24) -> torch.Tensor:
    """x @ Wᵀ for W in the host experts' int4 format, dequantized to x's dtype a piece of rows at a
    time (a Mixtral expert's gate/up whole would need ~1 GB of temporaries)."""
    from cpu_attention.experts import dequantize_int4

    rows = max(1, piece // (2 * codes.shape[1]))
    return torch.cat([F.linear(x, dequantize_int4(codes[a: a + rows], scale[a: a + rows], x.dtype))
                      for a in range(0, codes.shape[0], rows)], dim=-1)


def count_routing(model) -> Callable[[], dict[int, list[float]]]:
    """Start counting how often each expert of each MoE layer of `model` is routed to; the returned
    function reads the counts so far (layer → per expert)."""
    counters = {}
    for i, lw in enumerate(model.layers):
        # the layer's router: in a MoEFeedForward, in the host's copy of a layer the CPU computes
        # whole (offload.host_compute.HostFFN), or in the layer's own weights
        owner = lw.ffn if isinstance(lw.ffn, MoEFeedForward) else getattr(lw.ffn, "host", lw)
        if getattr(owner, "router", None) is not None:
            owner.routed = torch.zeros(model.cfg.num_experts, dtype=torch.int64, device=owner.router.device)
            counters[i] = owner
    return lambda: {i: o.routed.tolist() for i, o in counters.items()}


def experts_scratch(model):
    """The host experts' shared scratch of `model` (its clock: `Scratch.take_seconds`), or None."""
    return next((lw.ffn.staging.scratch for lw in model.layers
                 if isinstance(lw.ffn, MoEFeedForward) and lw.ffn.staging is not None), None)


def route(h: torch.Tensor, router: torch.Tensor, k: int, norm_topk: bool, gpu_map: torch.Tensor,
          host_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing of rows h [N, H] (`gpu_ops.moe_route.route`'s contract, in torch ops) → idx [N, k],
    w [N, k] float32, the device's and the host's index of each slot's expert [N, k] (−1: not theirs)."""
    logits = F.linear(h.to(router.dtype), router).float()  # [N, E]
    top, idx = logits.topk(k, dim=-1)  # the softmax's top-k are the logits'
    if norm_topk:  # softmax, then the top k renormalised: the softmax of the top k
        w = torch.softmax(top, dim=-1)
    else:
        w = torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True))
    return idx, w, gpu_map[idx], host_map[idx]


def combine(y: torch.Tensor, w: torch.Tensor, host: torch.Tensor | None, dtype: torch.dtype,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over a row's k slots of w · y (+ host) [N, H] in dtype (+ residual) (`gpu_ops.moe_route.combine`'s contract)."""
    N, k = w.shape
    out = (y.view(N, k, -1).float() * w[..., None]).sum(1)
    out = (out if host is None else out + host).to(dtype)
    return out if residual is None else residual + out
