"""The Hadamard rotation int8 and int4 KV are stored in (`rotation.py`), as Numba code: the
many-row transforms of the writers' rows (bit-exact), q and the output (`rotate_rows`,
`unrotate_rows`, through a transposed copy so the butterflies are vectors across rows), and a
kernel's few rows (`hadamard_rows`: the stages within 16 channels as one 16-lane vector,
`fwht16`)."""
from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from cpu_attention._numba import _flat_ptr, _indexable


ROWS = 32  # rows the *_rows transforms take at a time (measured against 16 and 64: fastest here)


@numba.njit(inline="always", nogil=True, cache=True)
def _butterflies_t(t, P, m):
    """The unnormalized Walsh-Hadamard transform of each P-block of each of the first m columns
    of t [D, ROWS], in place: a stage is adds and subtracts of whole rows, so the loop over the
    columns vectorizes (one row of x at a time the transform stays scalar, ~1 ns a pair)."""
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
    """Each row of x [N, D] float32 := row @ R, in place, with `rotation.rotate`'s float32 ops in
    its order (so the same bits: the writers store what the torch twins do), ROWS rows at a time through a transposed copy that stays in L1 (one copy of
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
