"""The CPU-attention worker: one thread that runs host-tier attention while the main thread
keeps launching GPU work. The Numba kernels release the GIL, so both really run at once.

Usage is a visible pair: `job = worker.submit(fn, *args)` … `result = job.wait()`.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class Job:
    def __init__(self, future: Future | None = None, value: Any = None):
        self._future, self._value = future, value

    def wait(self) -> Any:
        return self._future.result() if self._future is not None else self._value


class CpuWorker:
    def __init__(self, inline: bool = False):
        """inline: run jobs in the caller's thread (CPU-only runs, where there is nothing to overlap)."""
        self._pool = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-attention")

    def submit(self, fn: Callable[..., Any], *args: Any, inline: bool = False) -> Job:
        """inline: run now in the caller's thread, when the caller has nothing to do meanwhile
        (one sub-batch: the main thread would only wait), which saves two thread hand-offs."""
        if self._pool is None or inline:
            return Job(value=fn(*args))
        return Job(self._pool.submit(fn, *args))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
