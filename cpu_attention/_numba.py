"""Numba plumbing shared by the host kernels: threading layer, thread counts, bit casts, the
work queue's atomic claim.

Threading layer: OpenMP ('omp') first, then TBB, then Numba's own 'workqueue'. omp is
thread-safe (the engine launches kernels from a worker thread while other code may launch
too; workqueue aborts on concurrent launches) and has the lowest launch latency, which
matters at 32 launches a decode step. A `NUMBA_THREADING_LAYER` set by the user wins.

Oversubscription: torch's CPU pool and Numba's pool are separate. In the engine the Numba
kernels run while the main thread only launches GPU work, so each kernel takes
`threads` (default: physical cores) and torch's intra-op threads are left alone; when torch
and Numba compute on the CPU at the same time (the CPU-only path never does: layer math and
attention alternate), give them disjoint counts, e.g. `threads=physical_cores() - 1`.
Thread counts are per calling thread in Numba, so each call sets its own and a worker
thread's setting does not leak into the main thread.
"""
from __future__ import annotations

import functools
import os

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic, overload

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


def _prefer_512_bit_vectors() -> None:
    """On AVX-512 hosts, let LLVM vectorize with 512-bit registers.

    LLVM's tuning for Skylake-X and later Xeons (incl. Sapphire Rapids) includes
    `prefer-256-bit`, so Numba's loops use 8-float ymm vectors although 16-float zmm ones
    exist; our attention kernels are compute-bound, so twice the lanes per FMA is what they
    need. The feature string is part of Numba's cache key, so cached kernels are never
    mixed up. Must run before Numba's codegen is created (its first compile): every module
    with Numba kernels imports this one first. A NUMBA_CPU_FEATURES set by the user wins.

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


_prefer_512_bit_vectors()

# Flags for the hot kernels. fastmath lets LLVM reassociate the dot products into SIMD
# lanes; the kernels never produce inf/nan except the -inf max they guard explicitly,
# so only the reassociation/contraction flags are enabled (no 'nnan'/'ninf').
FASTMATH = {"reassoc", "contract", "nsz", "arcp", "afn"}
JIT = dict(nogil=True, cache=True, fastmath=FASTMATH)


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


@numba.njit(inline="always", nogil=True, cache=True)
def _butterflies(y, P):
    """Unnormalized Walsh-Hadamard transform of each P-block of y [D], in place."""
    D = y.shape[0]
    h = 1
    while h < P:
        for i0 in range(0, D, 2 * h):
            for i in range(i0, i0 + h):
                a, b = y[i], y[i + h]
                y[i], y[i + h] = a + b, a - b
        h *= 2


@numba.njit(inline="always", nogil=True, cache=True)
def hadamard_rotate(x, signs, P, c, y):
    """y [D] = x @ R of `rotation.py` (signs [D], block P, c = float32(1/sqrt(P))), with
    `rotation.rotate`'s float32 ops in its order, so without fastmath the bits agree."""
    for d in range(x.shape[0]):
        y[d] = x[d] * signs[d]
    _butterflies(y, P)
    for d in range(y.shape[0]):
        y[d] = y[d] * c


ROWS = 32  # rows the *_rows transforms take at a time (measured against 16 and 64: fastest here)


@numba.njit(inline="always", nogil=True, cache=True)
def _butterflies_t(t, P, m):
    """`_butterflies` on each of the first m columns of t [D, ROWS]: a stage is adds and
    subtracts of whole rows, so the loop over the columns vectorizes (one row of x at a time
    the transform stays scalar, ~1 ns a pair)."""
    D = t.shape[0]
    h = 1
    while h < P:
        for i0 in range(0, D, 2 * h):
            for i in range(i0, i0 + h):
                a, b = t[i], t[i + h]
                for n in range(m):
                    u, w = a[n], b[n]
                    a[n], b[n] = u + w, u - w
        h *= 2


@numba.njit(inline="always", nogil=True, cache=True)
def transform_rows(x, r0, t, signs, P, c, back):
    """Rows r0 .. r0 + n (n = t.shape[1], at most) of x := row @ R, or row @ R.T where `back` (a
    constant at each call site), through t [D, n]: the signs go before the butterflies, or after.
    Inside a decode kernel: one kv head's G query heads (t [D, G])."""
    m = min(t.shape[1], x.shape[0] - r0)
    for n in range(m):
        for d in range(x.shape[1]):
            t[d, n] = x[r0 + n, d] if back else x[r0 + n, d] * signs[d]
    _butterflies_t(t, P, m)
    for n in range(m):
        for d in range(x.shape[1]):
            x[r0 + n, d] = (t[d, n] * c) * signs[d] if back else t[d, n] * c


def _indexable(arr, dtype, i) -> bool:
    """An intrinsic's (array, index) arguments: a C-contiguous array of dtype and an integer."""
    return (isinstance(arr, types.Array) and arr.dtype == dtype and arr.layout == "C"
            and isinstance(i, types.Integer))


def _flat_ptr(context, builder, signature, args):
    """The codegen of an intrinsic f(arr, i): a pointer to arr.flat[i]."""
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.gep(ary.data, [context.cast(builder, args[1], signature.args[1], types.int64)])


@intrinsic
def fwht16(typingctx, arr, i):
    """arr.flat[i:i + 16] (float32, C-contiguous) := its unnormalized Walsh-Hadamard transform, in one
    16-lane vector: four butterfly stages, each a lane shuffle (lane j with j ^ h), an add, a
    subtract and a select. The stages of a transform within 16 channels, without the scalar loops
    LLVM leaves them in (their pairs lie within a vector)."""
    if not _indexable(arr, types.float32, i):
        return None

    def codegen(context, builder, signature, args):
        from llvmlite import ir

        vty = ir.VectorType(ir.FloatType(), 16)
        ptr = builder.bitcast(_flat_ptr(context, builder, signature, args), vty.as_pointer())
        v = builder.load(ptr, align=4)
        for h in (1, 2, 4, 8):
            partner = ir.Constant(ir.VectorType(ir.IntType(32), 16), [j ^ h for j in range(16)])
            s = builder.shuffle_vector(v, v, partner)
            upper = ir.Constant(ir.VectorType(ir.IntType(1), 16), [bool(j & h) for j in range(16)])
            v = builder.select(upper, builder.fsub(s, v), builder.fadd(v, s))  # (a, b) -> (a + b, a - b)
        builder.store(v, ptr, align=4)
        return context.get_dummy_value()

    return types.void(arr, i), codegen


@numba.njit(nogil=True, cache=True)  # not inlined: a call per pair, compiled once for every kernel
def hadamard_rows(x, r0, n, signs, P, c, back, t):
    """Rows r0 .. r0 + n of x [N, D] float32 (C-contiguous) := row @ R, or row @ R.T where `back`:
    a kernel's few rows (one kv head's G query heads). Row by
    row: the stages within 16 channels by `fwht16`, those across pieces of 16 as adds of whole
    pieces. (`transform_rows`' columns make vectors only with many rows: ~0.5 µs a row at 4 rows,
    GPU host.) The same ops as `rotation.rotate` in another order: equal to float32 rounding, not
    to the bit (for readers only: q, the output). P % 16 != 0 goes to `transform_rows` through
    t [D, n]."""
    if P % 16:
        transform_rows(x, r0, t, signs, P, c, back)
        return
    D = x.shape[1]
    for r in range(r0, r0 + n):
        y = x[r]
        if not back:
            for d in range(D):
                y[d] *= signs[d]
        for base in range(0, D, 16):
            fwht16(x, r * D + base)
        h = 16
        while h < P:
            for i0 in range(0, D, 2 * h):
                a, b = y[i0:i0 + h], y[i0 + h:i0 + 2 * h]
                for i in range(h):
                    u, w = a[i], b[i]
                    a[i], b[i] = u + w, u - w
            h *= 2
        for d in range(D):
            y[d] = (y[d] * c) * signs[d] if back else y[d] * c


@numba.njit(nogil=True, cache=True)
def rotate_rows(x, signs, P, c):
    """Each row of x [N, D] float32 := row @ R, in place, with `hadamard_rotate`'s ops (so the
    same bits), ROWS rows at a time through a transposed copy that stays in L1 (one copy of
    all N rows costs more than the transform: its stores stride N floats)."""
    t = np.empty((x.shape[1], ROWS), np.float32)
    for r0 in range(0, x.shape[0], ROWS):
        transform_rows(x, r0, t, signs, P, c, False)


@numba.njit(nogil=True, cache=True)
def unrotate_rows(x, signs, P, c):
    """Each row of x [N, D] float32 := row @ R.T (`rotation.unrotate`), in place."""
    t = np.empty((x.shape[1], ROWS), np.float32)
    for r0 in range(0, x.shape[0], ROWS):
        transform_rows(x, r0, t, signs, P, c, True)


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


@intrinsic
def arrive(typingctx, counter, i):
    """counter[i]++ atomically (int64, C-contiguous), returning the value before: of the threads that
    arrive at one counter, exactly one sees n - 1 as the n-th. Acquire and release ordered, so that
    thread also sees every store the others made before they arrived (their partial results)."""
    if not _indexable(counter, types.int64, i):
        return None

    def codegen(context, builder, signature, args):
        one = context.get_constant(types.int64, 1)
        return builder.atomic_rmw("add", _flat_ptr(context, builder, signature, args), one, "acq_rel")

    return types.int64(counter, i), codegen


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


def dram_read_gbps(nbytes: int = 2**30, reps: int = 5) -> float:
    """Host DRAM read bandwidth on Numba's current threads: a parallel sum over `nbytes`, best of reps.

    The bound the decode kernels are measured against (benchmarks print it in the same run)."""
    import time

    x = np.ones(nbytes // 4, np.float32)
    _sum(x)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        _sum(x)
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9
