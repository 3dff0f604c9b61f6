"""The server's engine loop: one thread owns the engine; requests join and leave between steps.

HTTP handlers `submit` requests (a bounded queue: `QueueFull` past it) and `cancel` them (a
client that went away, a stop string that matched); the thread admits queued requests while
fewer than `parallel` are active, runs one `Scheduler.step()` at a time, hands each new token to
its request's `deliver` callback, and frees a cancelled sequence's KV (both tiers) before the next
step. Only this thread touches the engine, so the engine needs no locks.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from hetero.app.live import LiveStats
from hetero.app.engine import Engine
from hetero.app.scheduler import Chunk, Scheduler, Sequence

log = logging.getLogger(__name__)

MEMORY_EVERY_S = 0.5


class QueueFull(Exception):
    """More requests wait than the queue holds; the client should retry later."""


class StepFailed(Exception):
    """The engine raised inside a step; the requests in that step end with this error."""


@dataclass(eq=False)
class Request:
    seq: Sequence
    # called on the engine thread with each Chunk, or a StepFailed; must not block
    deliver: Callable[[Chunk | StepFailed], None]
    arrived: float = field(default_factory=time.perf_counter)
    first_at: float | None = None
    last_at: float | None = None


class EngineLoop:
    def __init__(self, engine: Engine, live: LiveStats, parallel: int, max_waiting: int):
        if parallel < 1 or max_waiting < 0:
            raise ValueError(f"parallel must be ≥ 1 and the queue ≥ 0 (got {parallel}, {max_waiting})")
        self.engine, self.live = engine, live
        self.parallel, self.max_waiting = parallel, max_waiting
        self._cond = threading.Condition()
        self._queue: deque[Request] = deque()
        self._cancels: list[tuple[Request, str]] = []
        self._dead: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._memory_at = 0.0
        self._active_n = 0  # requests admitted to the scheduler (written under the lock)
        self._admitted_waiting = 0  # of those, not yet prefilled (written under the lock)

    # ------------------------------------------------------------------ called from other threads
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hetero-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, req: Request) -> None:
        with self._cond:
            if self._dead is not None:
                raise StepFailed(f"the engine loop stopped after an error: {self._dead}; restart the server")
            free_slots = max(0, self.parallel - self._active_n)  # admitted at the loop's next turn
            if len(self._queue) >= self.max_waiting + free_slots:
                raise QueueFull(f"{self._active_n} requests run and {len(self._queue)} wait "
                                f"(--parallel {self.parallel}, --queue {self.max_waiting})")
            self._queue.append(req)
            self._count_waiting()
            self._cond.notify()

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """reason: what the request counts as finished by ("stop" for a stop string that matched)."""
        with self._cond:
            self._cancels.append((req, reason))
            self._cond.notify()

    def _count_waiting(self) -> None:
        """Under the lock: the live count of waiting requests changes as they are submitted and
        admitted, not only after the step in progress (which may take seconds) ends."""
        self.live.set_waiting(len(self._queue) + self._admitted_waiting)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        sched = Scheduler(self.engine)
        active: dict[int, Request] = {}
        try:
            self._loop(sched, active)
        except Exception as e:  # noqa: BLE001 - not a step's error: say so to every request, refuse new ones
            log.exception("the engine loop stopped")
            with self._cond:
                self._dead = e
                waiting = list(self._queue)
                self._queue.clear()
            for r in [*active.values(), *waiting]:
                r.deliver(StepFailed(f"the engine loop stopped: {type(e).__name__}: {e}"))

    def _loop(self, sched: Scheduler, active: dict[int, Request]) -> None:
        self._publish(sched, active)
        while True:
            with self._cond:
                while not (self._stop or self._queue or self._cancels or not sched.idle):
                    self._cond.wait()
                if self._stop:
                    break
                cancels, self._cancels = self._cancels, []
                for r, reason in cancels:
                    if r in self._queue:
                        self._queue.remove(r)
                        self.live.finished(reason)
                while self._queue and len(active) < self.parallel:
                    r = self._queue.popleft()
                    active[r.seq.id] = r
                    sched.add(r.seq)
                self._active_n = len(active)
                self._admitted_waiting = len(sched.waiting)
                self._count_waiting()
            for r, reason in cancels:
                if active.pop(r.seq.id, None) is not None:
                    sched.cancel(r.seq)  # its KV, both tiers, is free before the next step
                    self.live.finished(reason)
            if not sched.idle:
                self._step(sched, active)
            self._publish(sched, active)
        for r in active.values():
            sched.cancel(r.seq)

    def _step(self, sched: Scheduler, active: dict[int, Request]) -> None:
        m = self.engine.metrics.total
        before = (m.cpu_attention, m.gpu, m.h2d_bytes, m.d2h_bytes, sched.stats.prompt_tokens, m.cpu_experts)
        drafted, accepted = sched.stats.drafted, sched.stats.accepted
        decode = not sched.waiting
        t0 = time.perf_counter()
        try:
            out = sched.step()
        except Exception as e:  # noqa: BLE001 - the server must outlive a failed step
            log.exception("a step failed; its requests end with an error")
            failed = StepFailed(f"the engine failed: {type(e).__name__}: {e}")
            for r in list(active.values()):
                sched.cancel(r.seq)
                r.deliver(failed)
                self.live.finished("error")
            active.clear()
            return
        now = time.perf_counter()
        wall = now - t0
        gpu = m.gpu - before[1]
        if self.engine.runner.cuda and gpu == 0.0:
            gpu = wall  # a prefill, or a whole-step CUDA graph: the device is what the step waits on
        self.live.step(prompt_tokens=sched.stats.prompt_tokens - before[4], generation_tokens=len(out), wall=wall,
                       decode=decode, cpu_attention=m.cpu_attention - before[0], gpu=gpu,
                       h2d=m.h2d_bytes - before[2], d2h=m.d2h_bytes - before[3],
                       drafted=sched.stats.drafted - drafted, accepted=sched.stats.accepted - accepted,
                       cpu_experts=m.cpu_experts - before[5])
        for seq, chunk in out:
            r = active.get(seq.id)
            if r is None:
                continue
            if r.first_at is None:
                r.first_at = now
                self.live.latency("ttft", now - r.arrived)
            else:
                self.live.latency("itl", now - r.last_at)
            r.last_at = now
            if chunk.finish_reason is not None:
                del active[seq.id]
                self.live.finished(chunk.finish_reason)
            r.deliver(chunk)

    def _publish(self, sched: Scheduler, active: dict[int, Request]) -> None:
        cache = self.engine.cache
        gpu, host = cache.tier_tokens()
        now = time.perf_counter()
        memory = None
        if now - self._memory_at >= MEMORY_EVERY_S:
            self._memory_at, memory = now, _memory(self.engine)
        with self._cond:
            self._active_n = len(active)
            self._admitted_waiting = len(sched.waiting)
            self._count_waiting()
        self.live.state(running=len(sched.running), kv={"gpu": gpu, "cpu": host},
                        kv_capacity={"gpu": cache.gpu_alloc.num_blocks * cache.block_size,
                                     "cpu": cache.host_alloc.num_blocks * cache.block_size},
                        memory=memory)


def _memory(engine: Engine) -> dict[str, dict[str, int | None]]:
    """Bytes used against the plan's budgets (None where there is no budget or no such device)."""
    budget = engine.plan.budget if engine.plan is not None else None
    out = {"host": {"used": host_rss_bytes(), "budget": budget.host_bytes if budget else None}}
    if engine.runner.cuda:
        import torch

        out["gpu"] = {"used": torch.cuda.memory_allocated(engine.runner.dev),
                      "budget": budget.gpu_bytes if budget else None}
    return out


def host_rss_bytes() -> int | None:
    """This process's resident memory."""
    import psutil

    return psutil.Process().memory_info().rss
