"""The host experts' call on a pool of threads of its own, which wait for calls by spinning: one
hand-off a call, instead of OpenMP's fork and join at each of the kernel's three passes.

Why: the CUDA driver's thread runs a decode step's host experts once a layer, ~0.1–0.4 ms of
work each. Under OpenMP each of the three passes forks and joins; where libgomp sees more pool
threads than CPUs (another thread's pool, torch's included: cpu_attention._numba) its workers
sleep at once and every pass pays their wake-up: ~110–200 µs a layer measured on the GPU host
(bench.moe), against ~20 µs for three passes of a pool alone (bench.omp_pools). These threads are
outside OpenMP, so no other pool slows them, and between passes they wait on counters: a call of
10.6 MB took 95–108 µs against OpenMP's 183–214 on the GPU host with the weights mostly in its
300 MiB L3; past it (13.3 MB calls over 810 MiB, 15 threads) 177–192 µs, 69–75 GB/s, where one
thread streams ~8 GB/s and 15 ~70–95 (bench.experts_pool).

A call, from the caller's thread (the CUDA driver's, through the C entry point of a host function;
or, where a GPU stream signals calls in memory, a thread of the pool's own: `serve_flags`):

    caller:  pairs grouped by expert, x prepared (`experts_kernels.prepare_x`), the counters zeroed,
             the descriptor's address published, the call opened (GEN odd)
    all:     pass 1: gate/up rows, a CHUNK claimed at a time from a counter → act
             pass 2, once pass 1's rows are all done: act rows prepared (quantized or summed)
             pass 3, once pass 2's are: output rows, a CHUNK at a time → out
    caller:  once pass 3's rows are all done: the call closed (GEN even), and returned once no
             worker is still inside it (`_serve`)

Between calls a worker spins (x86 `pause`) for SPIN_S, then gives its core away at each look
(sched_yield) until IDLE_S, then naps NAP_US at a time until DOZE_S, then DOZE_US at a time: a
decode step's next layer finds it spinning, a pause between steps costs a nap at most, and an
idle engine's workers wake ~500 times a second (a call after a long pause starts on the caller
and the workers that are awake; the others join within DOZE_US).

The control block `ctl` (int64) keeps each counter on a cache line of its own (LINE apart).
"""
from __future__ import annotations

import atexit
import functools
import threading
import time

import numpy as np
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from cpu_attention import experts_kernels as kn
from cpu_attention._numba import arrive, depart, load_acquire

LINE = 8  # int64s a cache line
(GEN, DESC, STOP, GROUPS, ROWS1, DONE1, PAIRS2, DONE2, ROWS3, DONE3, ACTIVE, READY, SPIN, IDLE, DOZE, CALLS,
 RUNS, JOINS, FINISH, PASS1, BARRIERS, CTL) = (LINE * i for i in range(22))
CHUNK = 32  # rows a claim takes in passes 1 and 3: 8 read 56–58 GB/s, 32 69–75, 64–128 64–71 (H100 host)
SPIN_S, IDLE_S, NAP_US, DOZE_S, DOZE_US = 300e-6, 5e-3, 100, 50e-3, 2000


def _libc(builder, name: str, args: list):
    """Call libc's `int name(...)` on 32-bit int args, declared by name (so the code caches: no
    function address is baked in)."""
    from llvmlite import ir
    from numba.core import cgutils

    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32] * len(args)), name)
    builder.call(fn, [builder.trunc(a, i32) for a in args])


@intrinsic
def _yield(typingctx):
    """Give the core to another runnable thread, if any (sched_yield)."""
    def codegen(context, builder, signature, args):
        _libc(builder, "sched_yield", [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _nap(typingctx, us):
    """Sleep at least `us` µs (usleep)."""
    def codegen(context, builder, signature, args):
        _libc(builder, "usleep", [args[0]])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@intrinsic
def _pause(typingctx):
    """A spin-wait hint to the core (x86 `pause`; nothing elsewhere)."""
    def codegen(context, builder, signature, args):
        import platform

        from llvmlite import ir

        if platform.machine() in ("x86_64", "AMD64"):
            fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(inline="always", nogil=True)
def _wait_for(ctl, i, n):
    while load_acquire(ctl, i) < n:
        _pause()


@njit(**kn.JIT)
def _share(ctl, d, caller=False):
    """Whatever is left of the call d's three passes, claimed a CHUNK of rows at a time; a pass
    starts once every row of the one before is done (counted in rows, not threads: a thread that
    comes late finds the work taken and holds nobody up). The caller also counts its cycles to
    the end of pass 1 (PASS1) and those it waited at the two passes' ends (BARRIERS)."""
    t0 = kn.cycles()
    x, ids, w, gu_q, gu_s, d_q, d_s, tok, pws, starts, gexp, act, out, xsum, asum, xq, xcorr, aq, acorr = kn.views(d)
    vnni = d[kn.VNNI_] != 0
    G = ctl[GROUPS]
    rows, P, H = G * act.shape[1], starts[G], out.shape[1]
    chunks1, chunks3 = (rows + CHUNK - 1) // CHUNK, (H + CHUNK - 1) // CHUNK
    c = arrive(ctl, ROWS1)
    while c < chunks1:
        for r in range(c * CHUNK, min(c * CHUNK + CHUNK, rows)):
            kn.act_row(r, x, tok, starts, gexp, gu_q, gu_s, act, xsum, xq, xcorr, vnni)
        arrive(ctl, DONE1)
        c = arrive(ctl, ROWS1)
    t1 = kn.cycles()
    _wait_for(ctl, DONE1, chunks1)
    t2 = kn.cycles()
    p = arrive(ctl, PAIRS2)
    while p < P:
        kn.act_prep(p, act, asum, aq, acorr, vnni)
        arrive(ctl, DONE2)
        p = arrive(ctl, PAIRS2)
    t3 = kn.cycles()
    _wait_for(ctl, DONE2, P)
    if caller:  # only the caller writes these
        t4 = kn.cycles()
        ctl[PASS1] += t2 - t0
        ctl[BARRIERS] += (t2 - t1) + (t4 - t3)
    c = arrive(ctl, ROWS3)
    while c < chunks3:
        kn.out_rows(c * CHUNK, min(c * CHUNK + CHUNK, H), w, tok, pws, starts, gexp, G, d_q, d_s, act, out, asum, aq,
                    acorr, vnni)
        arrive(ctl, DONE3)
        c = arrive(ctl, ROWS3)
    return chunks3


@njit(**kn.JIT)
def _serve(ctl):
    """A worker's life. GEN is odd while a call is open: the worker joins (ACTIVE + 1, then GEN
    checked again: both are locked read-modify-writes, full fences on x86), takes what is left,
    and leaves (ACTIVE − 1); the caller closes the call and waits for ACTIVE 0 before it resets the
    counters for the next, so no worker reads a counter or descriptor of a call it did not join."""
    served = load_acquire(ctl, GEN)
    arrive(ctl, READY)
    last = kn.cycles()
    while True:
        g = load_acquire(ctl, GEN)
        if load_acquire(ctl, STOP) != 0:
            return
        if g % 2 == 1 and g != served:
            served = g
            arrive(ctl, ACTIVE)
            if load_acquire(ctl, GEN) == g:
                arrive(ctl, JOINS)
                _share(ctl, carray(kn._ptr(ctl[DESC], np.int64(0)), (kn.FIELDS,)))
            depart(ctl, ACTIVE)
            last = kn.cycles()
            continue
        _wait_a_little(ctl, kn.cycles() - last)


@njit(inline="always", nogil=True)
def _wait_a_little(ctl, idle):
    """One look's wait, by how long (cycles) there has been nothing to do (module doc)."""
    if idle < ctl[SPIN]:
        _pause()
    elif idle < ctl[IDLE]:
        _yield()
    else:
        _nap(np.int64(NAP_US if idle < ctl[DOZE] else DOZE_US))


@njit(**kn.JIT)
def _dispatch(ctl, go, done, table):
    """The caller's thread for calls the GPU signals in memory: call i is run (its descriptor at
    table[i]; 0: nothing to run, a round trip alone) when a stream sets go[i], which this clears
    first; done[i] is set once it has run, and the stream waiting for it clears it again."""
    arrive(ctl, READY)
    last = kn.cycles()
    while load_acquire(ctl, STOP) == 0:
        busy = False
        for i in range(load_acquire(ctl, CALLS)):
            if load_acquire(go, i) != 0:
                depart(go, i)
                if table[i] != 0:
                    run_pooled(carray(kn._ptr(table[i], np.int64(0)), (kn.FIELDS,)))
                arrive(done, i)
                busy = True
        if busy:
            last = kn.cycles()
        else:
            _wait_a_little(ctl, kn.cycles() - last)


@njit(**kn.JIT)
def run_pooled(d):
    """The call d (an `experts_kernels` descriptor naming its pool, POOL_) on the pool; returns when done."""
    ctl = carray(kn._ptr(d[kn.POOL_], np.int64(0)), (CTL,))
    spent = carray(kn._ptr(d[kn.CYCLES_], np.int64(0)), (2,))  # cycles, pairs
    t0 = kn.cycles()
    x, ids, w, gu_q, gu_s, d_q, d_s, tok, pws, starts, gexp, act, out, xsum, asum, xq, xcorr, aq, acorr = kn.views(d)
    P, G = kn.group_pairs(ids, gu_q.shape[0], tok, pws, starts, gexp)
    kn.prepare_x(x, xsum, xq, xcorr, d[kn.VNNI_] != 0)
    for c in (ROWS1, DONE1, PAIRS2, DONE2, ROWS3, DONE3):
        ctl[c] = 0
    ctl[GROUPS] = G
    ctl[DESC] = d.ctypes.data
    arrive(ctl, GEN)  # open (odd), publishing the above: the workers read GEN with acquire order
    chunks3 = _share(ctl, d, True)
    t3 = kn.cycles()
    _wait_for(ctl, DONE3, chunks3)
    arrive(ctl, GEN)  # closed (even)
    while load_acquire(ctl, ACTIVE) != 0:
        _pause()
    t = kn.cycles()
    ctl[FINISH] += t - t3
    ctl[RUNS] += 1
    spent[0] += t - t0
    spent[1] += P


@functools.cache
def _entry():
    """The compiled C entry point, kept alive here (compiled on first use: beside a GPU only)."""

    @cfunc(types.void(types.CPointer(types.int64)), nogil=True)
    def entry(p):
        run_pooled(carray(p, (kn.FIELDS,)))

    return entry


class ExpertsPool:
    """A call's threads: the caller and `threads` − 2 workers, a core left to the CUDA driver's
    other threads (the thread launching the GPU's work, spinning while it waits for the device, has
    the core `threads` already leaves): a spinning worker that loses its core holds up every pass
    it has rows of. `address` goes in a descriptor's POOL_."""

    def __init__(self, threads: int):
        from cpu_attention.experts import tsc_hz

        self.threads = max(1, int(threads) - 1)
        self.ctl = np.zeros(CTL, np.int64)
        hz = tsc_hz()
        self.ctl[SPIN], self.ctl[IDLE], self.ctl[DOZE] = int(SPIN_S * hz), int(IDLE_S * hz), int(DOZE_S * hz)
        self.address = self.ctl.ctypes.data
        _entry()  # compiled (or loaded from the cache) here, with _serve: not by the workers, under the GIL
        _serve.compile((types.Array(types.int64, 1, "C"),))
        self._workers = [threading.Thread(target=_serve, args=(self.ctl,), name=f"hetero-experts-{me}", daemon=True)
                         for me in range(1, self.threads)]
        for t in self._workers:
            t.start()
        atexit.register(self.close)
        while self.ctl[READY] < len(self._workers):  # every worker waiting for calls: each joins the first
            time.sleep(1e-4)

    def serve_flags(self, go: np.ndarray, done: np.ndarray, table: np.ndarray) -> None:
        """Start a thread that runs calls signalled in memory (`_dispatch`), the calls' caller: go,
        done int64 [n] (page-locked, so that a GPU stream writes go and waits for done: a stream's
        memory operations, offload.driver), table int64 [n] the calls' descriptor addresses,
        `register` filling it. Instead of a host function, whose hand-off waits for the CUDA
        driver's thread to wake and then for the stream to learn that it returned."""
        self._flags = (go, done, table)
        self.calls = 0
        _dispatch.compile((types.Array(types.int64, 1, "C"),) * 4)
        t = threading.Thread(target=_dispatch, args=(self.ctl, go, done, table), name="hetero-experts-calls",
                             daemon=True)
        t.start()
        self._workers.append(t)
        while self.ctl[READY] < len(self._workers):
            time.sleep(1e-4)

    def register(self, descriptor: int) -> int:
        """A call's index in the flags (`serve_flags`) for the descriptor at that address (0: none)."""
        go, done, table = self._flags
        if self.calls == table.shape[0]:
            raise RuntimeError(f"more than {table.shape[0]} distinct host-expert calls")
        i = self.calls
        table[i] = descriptor
        self.calls += 1
        self.ctl[CALLS] = self.calls  # after the entry (x86 keeps the two stores in order)
        return i

    def stats(self) -> dict[str, int]:
        """Since the pool started: calls run, workers that joined them (summed), and the callers'
        cycles: to the end of a call's pass 1, waiting at the ends of passes 1 and 2, and waiting
        after their own share of pass 3 (for the workers' last rows and their leaving)."""
        return dict(calls=int(self.ctl[RUNS]), joins=int(self.ctl[JOINS]), pass1=int(self.ctl[PASS1]),
                    barriers=int(self.ctl[BARRIERS]), finish=int(self.ctl[FINISH]))

    @staticmethod
    def entry_address() -> int:
        """The C entry point `void f(int64_t *descriptor)` that runs a call on its pool (cuLaunchHostFunc)."""
        return _entry().address

    def close(self) -> None:
        """Stop the workers and the flags' thread (they finish a call in progress first)."""
        if self._workers:
            self.ctl[STOP] = 1  # seen at a worker's next look (after its nap at most)
            for t in self._workers:
                t.join()
            self._workers = []

