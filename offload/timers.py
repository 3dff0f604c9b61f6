"""Step timers and counters the engine exposes (and the monitor will draw).

Per decode step: wall time, the GPU segments' time (CUDA events, when detailed timing is on),
the CPU attention kernels' time (measured in the worker), the CPU's MoE experts' time (their
kernel's own clock), the time the main thread waited for the CPU, transfer time, and bytes moved
each way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from offload.driver import driver, event_handle


@dataclass
class StepTimes:
    wall: float = 0.0
    gpu: float = 0.0  # GPU segments (projections, MLP, GPU attention), from CUDA events
    cpu_attention: float = 0.0  # host-tier attention kernels, in the worker thread
    # MoE experts the host computes (offload/moe.py), since the last step was recorded: a step run
    # as a CUDA graph may still be computing when it is, so a step's time can land in the next
    cpu_experts: float = 0.0
    wait: float = 0.0  # main thread blocked on the other side (on the CPU's share; in the lean loop on q, k, v)
    transfer: float = 0.0  # CUDA events on the copy streams: q/k/v down and (o, lse) up outside the
    # layer graphs, and host KV blocks and weights copied up a layer ahead (these overlap the rest)
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    tokens: int = 0

    @property
    def idle(self) -> float:
        """Wall time neither device was known busy: wall − max(GPU, CPU) − transfers."""
        return max(0.0, self.wall - max(self.gpu, self.cpu_attention + self.cpu_experts) - self.transfer)


@dataclass
class Metrics:
    last: StepTimes = field(default_factory=StepTimes)
    steps: int = 0
    total: StepTimes = field(default_factory=StepTimes)
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    kv_gpu_tokens: int = 0
    kv_host_tokens: int = 0

    def add(self, s: StepTimes) -> None:
        self.last, self.steps = s, self.steps + 1
        for f in ("wall", "gpu", "cpu_attention", "cpu_experts", "wait", "transfer", "d2h_bytes", "h2d_bytes",
                  "tokens"):
            setattr(self.total, f, getattr(self.total, f) + getattr(s, f))

    @property
    def tokens_per_s(self) -> float:
        return self.total.tokens / self.total.wall if self.total.wall else 0.0


class GpuSpans:
    """Pairs of CUDA events around GPU segments; summed after the step's final sync.

    The events are made once and reused step after step: creating one costs the main thread
    microseconds, and a split step records a few per layer."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._events: list[torch.cuda.Event] = []
        self._handles: list[int | None] = []  # their driver handles, once asked for
        self._used = 0

    def _event(self, stream: torch.cuda.Stream | int | None) -> torch.cuda.Event:
        if self._used == len(self._events):
            self._events.append(torch.cuda.Event(enable_timing=True))
            self._handles.append(None)
        e = self._events[self._used]
        if isinstance(stream, int):  # a driver stream handle (offload/driver.py): record through the driver
            h = self._handles[self._used]
            if h is None:
                h = self._handles[self._used] = event_handle(e, torch.cuda.current_stream())
            driver().record(h, stream)
        else:
            e.record(stream)
        self._used += 1
        return e

    def begin(self, stream: torch.cuda.Stream | int | None = None):
        """stream: a torch stream, a driver stream handle, or None for the current stream."""
        return self._event(stream) if self.enabled else None

    def end(self, start, stream: torch.cuda.Stream | int | None = None) -> None:
        if start is not None:
            self.spans.append((start, self._event(stream)))

    def discard(self) -> None:
        """Forget spans recorded outside a step (e.g. weight copies queued by a prefill pass)."""
        self.spans.clear()
        self._used = 0

    def total_s(self) -> float:
        """Call after a synchronize (every recorded event complete); the events are then free again."""
        t = sum(a.elapsed_time(b) for a, b in self.spans) / 1e3
        self.spans.clear()
        self._used = 0
        return t


def now() -> float:
    return time.perf_counter()
