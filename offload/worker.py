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


MAIN, WORKER, ELSEWHERE = "main", "worker", "elsewhere"  # which thread runs the CPU's kernels


class CpuWorker:
    def __init__(self, inline: bool = False):
        """inline: run jobs in the caller's thread (CPU-only runs, where there is nothing to overlap)."""
        self._pool = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-attention")
        self._kernels_on: str | None = None  # None: not known yet (the main thread may hold a pool)

    def kernels_on(self, where: str | None) -> None:
        """The CPU's parallel work runs on `where` from now on: MAIN (the caller's thread: a prefill,
        a step's inline share), WORKER, or ELSEWHERE (threads outside OpenMP: the host experts'
        pool, cpu_attention.experts_pool). The OpenMP pools of the threads that ran it before are freed, so
        that only the new one's counts (cpu_attention._numba.release_pool); a switch costs the
        new pool's start (~1 ms), and staying put nothing; None: no CPU work, nothing changes."""
        if self._pool is None or where is None or where == self._kernels_on:
            return
        from cpu_attention._numba import release_pool

        if where != MAIN and self._kernels_on in (None, MAIN):
            release_pool()
        if where != WORKER and self._kernels_on in (None, WORKER):
            self._pool.submit(release_pool).result()
        self._kernels_on = where

    def submit(self, fn: Callable[..., Any], *args: Any, inline: bool = False) -> Job:
        """inline: run now in the caller's thread, when the caller has nothing to do meanwhile
        (one sub-batch: the main thread would only wait), which saves two thread hand-offs."""
        if self._pool is None or inline:
            return Job(value=fn(*args))
        return Job(self._pool.submit(fn, *args))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
