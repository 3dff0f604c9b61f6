"""Numba plumbing shared by the host kernels: threading layer, thread counts, bit casts, the
work queue's atomic claim.

Threading layer: OpenMP ('omp') first, then TBB, then Numba's own 'workqueue'. omp is
thread-safe (the engine launches kernels from a worker thread while other code may launch
too; workqueue aborts on concurrent launches) and has the lowest launch latency, which
matters at 32 launches a decode step. A `NUMBA_THREADING_LAYER` set by the user wins.

Oversubscription: in the engine the Numba kernels run while the main thread only launches GPU
work, so each kernel takes `threads` (default: physical cores) and torch's intra-op threads are
left alone; when torch and Numba compute on the CPU at the same time (the CPU-only path never
does: layer math and attention alternate), give them disjoint counts, e.g. `threads=
physical_cores() - 1`. Thread counts are per calling thread in Numba, so each call sets its own
and a worker thread's setting does not leak into the main thread.

OpenMP pools: libgomp keeps a pool of threads for every thread that has run a parallel region,
and where a process holds more of them than CPUs it lets waiting workers sleep almost at once,
so each region then pays their wake-up; torch's parallel CPU ops on the main thread count too.
Three small regions from a worker thread (`python3 -m bench.omp_pools`, 2-core machine): 7.7 µs
alone, 172 µs beside a Numba pool of the main thread, 197 µs after torch's parallel ops there.
`hetero.load` with CUDA therefore loads on a thread that ends with it, the runner frees a
thread's pool when another thread takes over the CPU's kernels (`release_pool`,
`offload.worker.CpuWorker.kernels_on`), and the GPU benchmarks record each row's thread count
(`bench.budget.process_threads`). Numba's omp layer runs on whichever libgomp the process loaded
first (torch's, where torch is imported first), so both libraries' pools count together.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic, overload

_configured = False
_configuring = threading.Lock()


def configure() -> None:
    """Numba's settings for the host kernels, made before their first compile (the codegen reads
    them once): OpenMP first as the threading layer, and on AVX-512 hosts 512-bit vectors
    (`_prefer_512_bit_vectors`). Called explicitly where kernels are about to run: at engine start
    (the warm-up, `warm.load`), at `linear`'s first kernel call, by the profile's measurement and
    by the background compiles, so cached kernels share one cache key. Idempotent; a user's NUMBA_THREADING_LAYER / NUMBA_CPU_FEATURES win.
    A kernel compiled before it is correct, with Numba's default vector width."""
    global _configured
    with _configuring:  # the engine's warm-up thread and the main thread may both get here first
        if _configured:
            return
        if "NUMBA_THREADING_LAYER" not in os.environ:
            numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
        _prefer_512_bit_vectors()
        _configured = True


def _prefer_512_bit_vectors() -> None:
    """On AVX-512 hosts, let LLVM vectorize with 512-bit registers.

    LLVM's tuning for Skylake-X and later Xeons (incl. Sapphire Rapids) includes
    `prefer-256-bit`, so Numba's loops use 8-float ymm vectors although 16-float zmm ones
    exist; our attention kernels are compute-bound, so twice the lanes per FMA is what they
    need. The feature string is part of Numba's cache key, so cached kernels are never
    mixed up. Must run before Numba's codegen is created (its first compile): `configure`. A
    NUMBA_CPU_FEATURES set by the user wins.

    Where AVX-512 VNNI is there, also LLVM's `fast-dpwssd` tuning (LLVM 19+): without it LLVM's
    machine combiner splits vpdpwssd back into vpmaddwd + vpaddd wherever that shortens a
    dependency chain, in loops with many independent accumulators too (compiled for Sapphire
    Rapids: 26 of the int8 kernel's 216, about half of the int4 kernels'), which costs an
    instruction each on the ports the dot products are bound by."""
    if "NUMBA_CPU_FEATURES" in os.environ or numba.config.CPU_FEATURES is not None:
        return
    from numba.core.codegen import get_host_cpu_features
    from llvmlite import binding

    try:
        has_avx512 = binding.get_host_cpu_features().get("avx512f", False)
    except RuntimeError:  # LLVM cannot read this host's features: keep Numba's default
        return
    if has_avx512:
        features = get_host_cpu_features() + ",-prefer-256-bit"
        if "+avx512vnni" in features.split(",") and binding.llvm_version_info >= (19,):
            features += ",+fast-dpwssd"
        numba.config.CPU_FEATURES = features


# Flags for the hot kernels. fastmath lets LLVM reassociate the dot products into SIMD
# lanes; the kernels never produce inf/nan except the -inf max they guard explicitly,
# so only the reassociation/contraction flags are enabled (no 'nnan'/'ninf').
FASTMATH = {"reassoc", "contract", "nsz", "arcp", "afn"}
JIT = dict(nogil=True, cache=True, fastmath=FASTMATH)
# The quantizing appends' flags: no fastmath, so every operation rounds as their torch twins' do.
WJIT = dict(nogil=True, cache=True)


def release_pool() -> bool:
    """Free the calling thread's OpenMP pool (libgomp's `omp_pause_resource_all`: its workers
    exit), so that it no longer counts beside the pool of the thread that runs the kernels next;
    a later parallel region on this thread builds a new one (~1 ms). → whether libgomp was loaded
    and freed it (nothing to do otherwise: no pool was ever made)."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    return gomp.omp_pause_resource_all(1) == 0  # omp_pause_soft


@functools.cache  # reads /sys; called once per kernel call otherwise
def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings counted once)."""
    cpus = sorted(os.sched_getaffinity(0))
    seen = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                seen.add(f.read().strip())
        except OSError:
            seen.add(str(c))
    return max(1, len(seen))


def resolve_threads(threads: int | None) -> int:
    """The thread count a kernel call uses, set for the calling thread."""
    n = physical_cores() if threads is None else int(threads)
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


@intrinsic
def bits_to_f32(typingctx, x):
    """Reinterpret the low 32 bits of an integer as a float32 (a register bit cast)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        i32 = context.get_value_type(types.uint32)
        if x.bitwidth > 32:
            v = builder.trunc(v, i32)
        elif x.bitwidth < 32:
            v = builder.zext(v, i32)
        return builder.bitcast(v, context.get_value_type(types.float32))

    return types.float32(x), codegen


@intrinsic
def f32_to_bits(typingctx, x):
    """Reinterpret a float32 as its uint32 bit pattern."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(x), codegen


@numba.njit(inline="always", nogil=True, cache=True)
def bf16_to_f32(h):
    return bits_to_f32(np.uint32(h) << np.uint32(16))


def widen(x):
    """A stored 16/32-bit float element → float32: uint16 holds bf16 bits, float32 passes."""
    raise NotImplementedError("only callable from Numba code")


@overload(widen, inline="always")
def _widen_impl(x):
    if x == types.uint16:
        return lambda x: bits_to_f32(np.uint32(x) << np.uint32(16))
    return lambda x: np.float32(x)


@numba.njit(inline="always", nogil=True, cache=True)
def f32_to_bf16(x):
    """float32 → bf16 bits, round to nearest even (what torch's .to(bfloat16) does)."""
    b = f32_to_bits(np.float32(x))
    b = b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
    return np.uint16(b >> np.uint32(16))


@numba.njit(inline="always", nogil=True, cache=True, fastmath=FASTMATH)
def exp_neg(x):
    """e^x for x <= 0 (softmax weights), rel. error < 2e-7, branch-free so loops vectorize.

    2^(x log2 e) split into 2^n (built in the exponent bits) and 2^f, f in [-0.5, 0.5],
    by a degree-6 polynomial; inputs below -87 return 0 instead of a denormal.
    """
    y = max(x, np.float32(-87.0)) * np.float32(1.4426950408889634)
    n = np.floor(y + np.float32(0.5))
    f = y - n
    p = np.float32(1.5403530393381606e-4)
    p = p * f + np.float32(1.3333558146428443e-3)
    p = p * f + np.float32(9.618129107628477e-3)
    p = p * f + np.float32(5.550410866482158e-2)
    p = p * f + np.float32(2.402265069591007e-1)
    p = p * f + np.float32(6.931471805599453e-1)
    p = p * f + np.float32(1.0)
    r = p * bits_to_f32(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))
    return r if x > np.float32(-87.0) else np.float32(0.0)


def _indexable(arr, dtype, i) -> bool:
    """An intrinsic's (array, index) arguments: a C-contiguous array of dtype and an integer."""
    return (isinstance(arr, types.Array) and arr.dtype == dtype and arr.layout == "C"
            and isinstance(i, types.Integer))


def _flat_ptr(context, builder, signature, args):
    """The codegen of an intrinsic f(arr, i): a pointer to arr.flat[i]."""
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.gep(ary.data, [context.cast(builder, args[1], signature.args[1], types.int64)])


@intrinsic
def claim(typingctx, counter):
    """The next value of counter[0] (int64, C-contiguous), taken atomically: c = counter[0]++ in
    one lock-free step, so threads that call it at once each get a different c (a work queue)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and counter.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        one = context.get_constant(types.int64, 1)
        return builder.atomic_rmw("add", ary.data, one, "monotonic")

    return types.int64(counter), codegen


def _make_rmw(op: str, doc: str):
    """An intrinsic f(counter, i): counter[i] changed by one atomically (`op`: LLVM's "add" or
    "sub"; int64, C-contiguous), acquire and release ordered, returning the value before."""

    def f(typingctx, counter, i):
        if not _indexable(counter, types.int64, i):
            return None

        def codegen(context, builder, signature, args):
            one = context.get_constant(types.int64, 1)
            return builder.atomic_rmw(op, _flat_ptr(context, builder, signature, args), one, "acq_rel")

        return types.int64(counter, i), codegen

    f.__doc__ = doc
    return intrinsic(f)


arrive = _make_rmw("add", """counter[i]++ atomically (int64, C-contiguous), returning the value before: of the threads
    that arrive at one counter, exactly one sees n - 1 as the n-th. Acquire and release ordered, so that thread
    also sees every store the others made before they arrived (their partial results).""")
depart = _make_rmw("sub", "counter[i]-- atomically (int64, C-contiguous), acquire and release ordered; returns the "
                          "value before.")


@intrinsic
def load_acquire(typingctx, counter, i):
    """counter[i] (int64, C-contiguous) read atomically with acquire order: once it shows what a
    thread wrote with `arrive`, the stores that thread made before are seen too."""
    if not _indexable(counter, types.int64, i):
        return None

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_flat_ptr(context, builder, signature, args), "acquire", 8)

    return types.int64(counter, i), codegen


def _make_prefetch(locality: int, doc: str):
    """An intrinsic f(arr, index) hinting the cache line of arr.flat[index] at LLVM's locality
    (3: L1 and L2, prefetcht0; 2: L2, prefetcht1); a no-op where the target has no prefetch."""

    def f(typingctx, arr, index):
        if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            from llvmlite import ir
            from numba.core import cgutils

            ary = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.gep(ary.data, [args[1]])
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch")
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(locality), i32(1)])
            return context.get_dummy_value()

        return types.void(arr, index), codegen

    f.__doc__ = doc
    return intrinsic(f)


prefetch = _make_prefetch(3, "Hint the cache line holding arr.flat[index] into L2/L1 (a no-op if unsupported).")
prefetch_l2 = _make_prefetch(2, "Hint the cache line holding arr.flat[index] into L2 (prefetcht1).")


def line_elems(a):
    """Elements of array `a` in one 64-byte cache line, as a compile-time constant (Numba's
    `a.itemsize` is read from the array at run time, which turns a strided loop's trip count
    into a division)."""
    raise NotImplementedError("only callable from Numba code")


@overload(line_elems, inline="always")
def _line_elems_impl(a):
    n = max(64 * 8 // a.dtype.bitwidth, 1)
    return lambda a: n


@numba.njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _sum(x):
    acc = 0.0
    for i in numba.prange(x.size):
        acc += x[i]
    return acc


def dram_read_gbps(nbytes: int = 2**30, threads: int | None = None, reps: int = 5) -> float:
    """Host DRAM read bandwidth: a parallel sum over `nbytes` of float32 on `threads` threads
    (default: physical cores; left set for the calling thread), best of reps after one untimed call.

    The bound the decode kernels are measured against (benchmarks print it in the same run)."""
    import time

    resolve_threads(threads)
    x = np.ones(nbytes // 4, np.float32)
    _sum(x)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        _sum(x)
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9
