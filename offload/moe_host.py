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
        self.max_rows = max_rows
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
