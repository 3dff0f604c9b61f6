"""What a mixture-of-experts model's host experts share beside a GPU (`HostStaging`): the Numba
scratch, the experts' own pool of threads (cpu_attention.experts_pool), the side stream their
calls are queued on, the page-locked buffers a row goes down and comes up in, and how a call
reaches the pool: signalled in memory where the driver's stream memory operations work, else as
a host function. `offload.moe.MoEFeedForward` uses it layer by layer.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from hetero.config import ModelConfig


class HostStaging:
    """What every MoE layer's host share uses, one at a time: the Numba scratch and, on CUDA, the
    threads that compute it, the side stream and the pinned buffers a row goes down and comes up in."""

    MAX_CALLS = 4096  # distinct (layer, rows) calls a model's host experts may be signalled for

    def __init__(self, cfg: ModelConfig, device: torch.device, max_rows: int, threads: int | None = None):
        """threads: the engine's CPU threads (None: the physical cores); on CUDA one is left to the
        thread launching the GPU's work, and the experts' pool takes the rest (experts_pool)."""
        from cpu_attention.experts import Scratch

        H, k = cfg.hidden_size, cfg.num_experts_per_tok
        self.cfg, self.max_rows = cfg, max_rows
        self.scratch = Scratch(max_rows, k, H, cfg.moe_intermediate_size, cfg.num_experts)
        self.cuda = device.type == "cuda"
        if self.cuda:
            from cpu_attention._numba import physical_cores
            from cpu_attention.experts_pool import ExpertsPool
            from offload.driver import driver

            self.driver = driver()
            if self.driver is None:
                raise RuntimeError("host-resident experts on CUDA need the CUDA driver (libcuda)")
            # each call runs on a pool of spinning threads, not OpenMP's (experts_pool)
            self.scratch.pool = ExpertsPool(max(1, (threads or physical_cores()) - 1))
            self.entry = ExpertsPool.entry_address()
            self.side = torch.cuda.Stream(device)
            self.copy = torch.cuda.Stream(device)  # host experts going up for a prefill
            self.down = torch.empty(max_rows * (H + 2 * k), dtype=torch.float32, pin_memory=True)  # h, weights, ids
            self.up = torch.empty(max_rows, H, dtype=torch.float32, pin_memory=True)
            # calls signalled in memory where the driver's stream memory operations work, else host functions
            self.go, self.done = (torch.zeros(self.MAX_CALLS, dtype=torch.int64, pin_memory=True) for _ in "gd")
            self.scratch.pool.serve_flags(self.go.numpy(), self.done.numpy(), np.zeros(self.MAX_CALLS, np.int64))
            self.calls: dict[int, int] = {}  # descriptor address → its index in the flags
            self.signals = self._signals_work()
        self.layers: list = []  # the layers' host experts (cpu_attention.experts.HostExperts) in layer order
        self._ahead = None  # (host experts, a fetch of their first piece) copied up ahead of their layer

    def pieces(self, he) -> list[tuple[int, int]]:
        """he's experts in the pieces a prefill copies up one at a time ([a, b) of its stacks),
        planner.workspace.moe_host_piece_bytes each; the plan's workspace holds two."""
        from planner.workspace import moe_host_piece_bytes

        E = len(he.experts)
        per = max(1, moe_host_piece_bytes(self.cfg) * E // he.nbytes)
        return [(a, min(a + per, E)) for a in range(0, E, per)]

    def fetch(self, he, a: int, b: int) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        """Experts [a, b) of he going up on the copy stream: their four stacks on the device, and the
        event after which they are there."""
        with torch.cuda.stream(self.copy):
            ts = [torch.from_numpy(arr[a:b]).to(self.copy.device, non_blocking=True)
                  for arr in (he.gu_q, he.gu_s, he.d_q, he.d_s)]
            done = torch.cuda.Event()
            done.record(self.copy)
        return ts, done

    def fetch_next(self, he) -> None:
        """Start the first piece of the next layer's host experts going up (its layer takes it,
        `take`), so that the copy engine works through this layer's end and the next one's attention."""
        i = next((n for n, x in enumerate(self.layers) if x is he), len(self.layers))
        if i + 1 < len(self.layers):
            nxt = self.layers[i + 1]
            self._ahead = (nxt, self.fetch(nxt, *self.pieces(nxt)[0]))

    def take(self, he):
        """The fetch of he's first piece started by the layer before, or None; anything else fetched
        ahead is dropped."""
        ahead, self._ahead = self._ahead, None
        return ahead[1] if ahead is not None and ahead[0] is he else None

    def queue(self, descriptor: np.ndarray) -> None:
        """Queue the host experts' call `descriptor` on the current stream, the stream's later work
        waiting for it: signalled in memory (go set, done awaited and cleared: the pool's flags'
        thread runs it, experts_pool.serve_flags), or as a host function (the driver's thread runs it)."""
        stream, address = torch.cuda.current_stream().cuda_stream, descriptor.ctypes.data
        if not self.signals:
            self.driver.host_func(stream, self.entry, address)
            return
        i = self.calls.get(address)
        if i is None:
            i = self.calls[address] = self.scratch.pool.register(address)
        self._signal(stream, i)

    def _signal(self, stream: int, i: int) -> None:
        go, done = self.go.data_ptr() + 8 * i, self.done.data_ptr() + 8 * i  # pinned: device address = host's
        self.driver.write_value(stream, go, 1)
        self.driver.wait_value(stream, done, 1)
        self.driver.write_value(stream, done, 0)

    def _signals_work(self, timeout_s: float = 2.0) -> bool:
        """Whether a round trip through the flags completes, eagerly and replayed from a CUDA graph
        (stream memory operations may be missing, or refused in a capture); a stuck one is released
        and host functions carry the calls instead."""
        bare = self.scratch.pool.register(0)
        try:
            with torch.cuda.stream(self.side):
                self._signal(self.side.cuda_stream, bare)
            if not self._completes(self.side, bare, timeout_s):
                return False
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.side):
                self._signal(self.side.cuda_stream, bare)
            graph.replay()
            return self._completes(torch.cuda.current_stream(), bare, timeout_s)
        except Exception:  # noqa: BLE001  an error from the driver or the capture: not on this machine
            return False

    def _completes(self, stream: torch.cuda.Stream, call: int, timeout_s: float) -> bool:
        """Whether the stream's work is done within timeout_s; if not, call's wait is released."""
        ev = torch.cuda.Event()
        ev.record(stream)
        end = time.monotonic() + timeout_s
        while not ev.query():
            if time.monotonic() > end:
                self.done[call] = 1
                ev.synchronize()
                return False
            time.sleep(1e-4)
        return True
