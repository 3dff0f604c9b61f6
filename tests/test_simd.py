"""The decode kernels' vector micro-kernels (`cpu_attention._simd`, `_simd_vnni`, `_simd_int4`)
against numpy (CPU, CI).

Each runs at this host's shapes and at the AVX-512 host's (16 float lanes, 4 tokens a score
pass, 4 vectors an accumulator pass, pmaddwd of 16 int32 lanes; int8's vpdpbusd as this
host's instruction and as plain IR at 16 and 8 lanes): the IR is generic vectors, so the wide
shapes run here too (split into this CPU's registers, pmaddwd and vpdpbusd as plain IR).
"""
from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from cpu_attention import _simd, _simd_int4, _simd_int4_factors, _simd_int4_weights, _simd_vnni, int4
from cpu_attention.decode_tiles import _row_max

HOST = (_simd.VEC, _simd.DOT_TOKENS, _simd.ACC_CHUNKS, _simd.IVEC)
AVX512 = (16, 4, 4, 16)
SHAPES = pytest.mark.parametrize("W,T,C,IW", [HOST, AVX512], ids=["host", "avx512"])


def bf16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded to bf16: (its bits as uint16, its value as float32)."""
    bits = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def rows(kind: str, shape, rng) -> tuple[np.ndarray, np.ndarray]:
    """(stored rows as the kernels take them, their values in float64)."""
    if kind == "bf16":
        bits, val = bf16(rng.standard_normal(shape))
        return bits, val.astype(np.float64)
    if kind == "int8":
        x = rng.integers(-127, 128, shape).astype(np.int8)
        return x, x.astype(np.float64)
    x = rng.standard_normal(shape).astype(np.float32)
    return x, x.astype(np.float64)


def to_pairs(x: np.ndarray, W: int) -> np.ndarray:
    """numpy twin of `_simd.to_pair_layout` for W lanes."""
    y, full = x.copy(), x.shape[-1] // (2 * W) * 2 * W
    for c in range(0, full, 2 * W):
        y[..., c:c + W], y[..., c + W:c + 2 * W] = x[..., c:c + 2 * W:2], x[..., c + 1:c + 2 * W:2]
    return y


def from_pairs(y: np.ndarray, W: int) -> np.ndarray:
    x, full = y.copy(), y.shape[-1] // (2 * W) * 2 * W
    for c in range(0, full, 2 * W):
        x[..., c:c + 2 * W:2], x[..., c + 1:c + 2 * W:2] = y[..., c:c + W], y[..., c + W:c + 2 * W]
    return x


@SHAPES
@pytest.mark.parametrize("kind", ["bf16", "int8", "f32"])
def test_dots(W, T, C, IW, kind):
    dots = [_simd.make_dots(ng, T, W) for ng in (1, 2, 3, 4)]
    d1, d2, d3, d4 = dots

    @numba.njit
    def run(q, k, r0, r1, s):  # every head group size over heads 0..9, T rows a pass
        for j in range(r0, r1, T):
            d4(q, 0, k, j, r1, s, j - r0)
            d3(q, 4, k, j, r1, s, j - r0)
            d2(q, 7, k, j, r1, s, j - r0)
            d1(q, 9, k, j, r1, s, j - r0)

    rng = np.random.default_rng(0)
    for D in (48, 80, 128):  # 48, 80: a last chunk of W lanes alone
        if D % W:
            continue
        k, kv = rows(kind, (20, D), rng)
        q = rng.standard_normal((10, D)).astype(np.float32)
        qk = to_pairs(q, W) if kind == "bf16" else q
        for r0, r1 in ((3, 16), (0, 1), (5, 20)):
            s = np.full((10, 24), np.nan, np.float32)
            run(qk, k, r0, r1, s)
            ref = q.astype(np.float64) @ kv[r0:r1].T
            assert np.abs(s[:, :r1 - r0] - ref).max() < 1e-4 * np.abs(ref).max(), (D, r0, r1)


@SHAPES
@pytest.mark.parametrize("kind", ["bf16", "int8", "f32"])
def test_accumulate(W, T, C, IW, kind):
    a1, a2, a3, a4 = (_simd.make_accumulate(ng, C, W) for ng in (1, 2, 3, 4))

    @numba.njit
    def run(p, pj, v, r0, n, acc):
        a4(p, 0, pj, v, r0, n, acc)
        a3(p, 4, pj, v, r0, n, acc)
        a2(p, 7, pj, v, r0, n, acc)
        a1(p, 9, pj, v, r0, n, acc)

    rng = np.random.default_rng(1)
    for D in (48, 80, 128, 256):
        v, vv = rows(kind, (20, D), rng)
        p = rng.random((10, 30)).astype(np.float32)
        acc0 = rng.standard_normal((10, D)).astype(np.float32)
        for pj, r0, n in ((2, 5, 11), (0, 0, 1), (7, 3, 17)):
            acc = to_pairs(acc0, W) if kind == "bf16" else acc0.copy()
            run(p, pj, v, r0, n, acc)
            got = from_pairs(acc, W) if kind == "bf16" else acc
            ref = acc0 + p[:, pj:pj + n].astype(np.float64) @ vv[r0:r0 + n]
            assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max(), (D, pj, r0, n)


# int8 (`cpu_attention._simd_vnni`): vpdpbusd over the pool's VNNI byte order, at this host's
# width with its instruction, and as plain IR at 16 and 8 lanes
VNNI = pytest.mark.parametrize("W,name", [(_simd_vnni.W_LANES, _simd_vnni.DPBUSD), (16, None), (8, None)],
                               ids=["host", "ir16", "ir8"])


def split16(x: np.ndarray, signed: bool) -> np.ndarray:
    """x = 256 hi + lo as [2, ...] bytes: hi, lo int8 (signed; lo in [-128, 128)) or uint8."""
    x = x.astype(np.int64)
    hi = (x + 128) >> 8 if signed else x >> 8
    return np.stack([hi, x - 256 * hi]).astype(np.int8 if signed else np.uint8)


@VNNI
def test_vnni_scores(W, name):
    s1, s2, s3, s4 = (_simd_vnni.make_scores(ng, W, name) for ng in (1, 2, 3, 4))

    @numba.njit
    def run(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s):  # every head group size over heads 0..9
        s4(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, 0)
        s3(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, 4)
        s2(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, 7)
        s1(qp, qc, qsc, k, v, kbase, ks, ksbase, pf, nch, BS, s, 9)

    rng = np.random.default_rng(2)
    for D, BS in ((64, W), (128, 2 * W), (256, W)):
        k = rng.integers(-127, 128, (5, D // 4, BS, 4)).astype(np.int8)  # 5 (block, head) regions
        k[2, :, 0] = -127  # the extreme sums the int32 lanes must hold
        keys = k.transpose(0, 2, 1, 3).reshape(5, BS, D).astype(np.int64)  # token order
        ks = rng.random((5, BS)).astype(np.float32)
        q16 = rng.integers(-32000, 32001, (10, D))
        q16[0] = 32000
        qp = split16(q16, signed=True)
        qc = (-128 * qp.astype(np.int64).sum(-1)).astype(np.int32)
        qsc = rng.random(10).astype(np.float32)
        for chunks in ([(2, 0)], [(3, BS // W - 1), (1, 0), (4, 0)], [(0, 0), (2, 0)]):  # (region, chunk)
            kbase = np.array([r * D * BS + c * 4 * W for r, c in chunks], np.int64)
            ksbase = np.array([r * BS + c * W for r, c in chunks], np.int64)
            pf = np.array([((r + 1) % 5) * D * BS for r, _ in chunks], np.int64)
            s = np.full((10, W * len(chunks) + 3), np.nan, np.float32)
            run(qp, qc, qsc, k, k, kbase, ks, ksbase, pf, len(chunks), BS, s)
            for i, (r, c) in enumerate(chunks):
                tok = slice(c * W, (c + 1) * W)
                exact = (q16 @ keys[r, tok].T).astype(np.float64)
                ref = exact * qsc[:, None].astype(np.float64) * ks[r, tok].astype(np.float64)
                got = s[:, i * W:(i + 1) * W]
                assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max(), (D, BS, chunks, i)
            assert np.isnan(s[:, W * len(chunks):]).all()


@VNNI
def test_vnni_values(W, name):
    v1, v2, v3, v4 = (_simd_vnni.make_values(ng, _simd_vnni.VALUE_CHUNKS, W, name) for ng in (1, 2, 3, 4))

    @numba.njit
    def run(wp, wsc, v, gbase, ngr, acc):
        v4(wp, wsc, v, gbase, ngr, acc, 0)
        v3(wp, wsc, v, gbase, ngr, acc, 4)
        v2(wp, wsc, v, gbase, ngr, acc, 7)
        v1(wp, wsc, v, gbase, ngr, acc, 9)

    rng = np.random.default_rng(3)
    for D in (3 * W, 128, 256):  # 3 W: a pass of C = 2 vectors, then one of a vector
        v = rng.integers(-127, 128, (5, 4, D, 4)).astype(np.int8)  # 5 regions of 4 groups of 4 tokens
        v[1, 2] = -128
        every = [(r, u) for r in range(5) for u in range(4)]
        for groups in ([(1, 2)], [(0, 0), (3, 1), (1, 2), (4, 3), (2, 0)], every * 4):  # 80 groups: 320 tokens
            gbase = np.array([(r * 4 + u) * 4 * D for r, u in groups], np.int64)
            w8 = rng.integers(0, 256, (10, 4 * len(groups) + 5))
            w8[:, :4] = 255
            wp = w8.astype(np.uint8)
            wsc = (rng.random(10) * 1e-4).astype(np.float32)
            acc0 = rng.standard_normal((10, D)).astype(np.float32)
            acc = acc0.copy()
            run(wp, wsc, v, gbase, len(groups), acc)
            vals = np.concatenate([v[r, u].T for r, u in groups]).astype(np.int64)  # [4 ngr, D], token order
            exact = w8[:, :4 * len(groups)] @ vals
            ref = acc0 + wsc[:, None].astype(np.float64) * exact
            assert np.abs(acc - ref).max() < 1e-5 * np.abs(ref).max(), (D, len(groups))


def test_layouts_round_trip():
    @numba.njit
    def pairs(x, y, z):
        _simd.to_pair_layout(x, y)
        _simd.from_pair_layout(y, z)

    for D in (48, 64, 80, 128):
        x = np.arange(3 * D, dtype=np.float32).reshape(3, D)
        y, z = np.empty_like(x), np.empty_like(x)
        pairs(x, y, z)
        assert np.array_equal(y, to_pairs(x, _simd.VEC)) and np.array_equal(z, x)


def test_row_max():
    """decode's integer-keyed max of float rows: -inf, signed zeros, negatives, huge and tiny."""
    run = numba.njit(lambda x, n: _row_max(x, n))
    rng = np.random.default_rng(3)
    for _ in range(300):
        x = (rng.standard_normal(70) * 10.0 ** rng.integers(-30, 30)).astype(np.float32)
        x[rng.integers(0, 70, 4)] = -np.inf
        if rng.random() < 0.3:
            x = -np.abs(x)
        n = int(rng.integers(0, 70))
        assert run(x, n) == (x[:n].max() if n else -np.inf)


# int4 (`cpu_attention._simd_int4`): integer dot products over 4-bit codes, the scales folded into
# int16 factors; checked against numpy on the packed layout of `int4.py`

def test_pair_order_is_a_permutation_within_rows():
    for D in (32, 64, 96, 128, 160):
        o = _simd_int4.pair_order(D)
        assert sorted(o) == list(range(D)), D
        assert np.array_equal(o // 8, np.arange(D) // 8), D  # each row of 8 channels stays in place


@SHAPES
def test_scores_int4(W, T, C, IW):
    """Scores over the VNNI key order (`int4.pack_keys`) against numpy, for whole blocks, a
    block's middle (an item starting and ending inside it), a last partial vector, and the
    pool's last block (its tokens read lane by lane: nothing past them)."""
    s1, s2, s3, s4 = (_simd_int4.make_scores_int4(ng, IW) for ng in (1, 2, 3, 4))

    @numba.njit
    def run(qp, qsc, qc, k, kb, BS, off, nb, v, s, col):
        s4(qp, qsc, qc, k, kb, BS, off, nb, v, 0, 0, 0, s, col, 0)
        s3(qp, qsc, qc, k, kb, BS, off, nb, v, 0, 0, 0, s, col, 4)
        s2(qp, qsc, qc, k, kb, BS, off, nb, v, 0, 0, 0, s, col, 7)
        s1(qp, qsc, qc, k, kb, BS, off, nb, v, 0, 0, 0, s, col, 9)

    rng = np.random.default_rng(4)
    for D in (64, 96, 128, 256):
        for BS in (16, 7, 32):
            NB = 3
            codes = rng.integers(0, 16, (NB, BS, D))
            codes[1, 2] = 15  # all codes 15: the extreme sums
            k = int4.pack_keys(torch.from_numpy(codes)).numpy()  # [NB, D/8, BS, 4]
            v = np.zeros(8, np.uint8)
            qch = rng.integers(-32767, 32768, (10, D)).astype(np.int16)  # channel order
            qch[:, ::7] = 32767
            qp = np.ascontiguousarray(qch[:, _simd_int4.pair_order(D)])  # position p holds channel order[p]
            qsc = (rng.random(10) * 1e-4).astype(np.float32)
            qc = rng.standard_normal(10).astype(np.float32)
            region = BS * D // 2
            for blk, off, nb in ((1, 0, BS), (0, 3, BS - 5), (2, 0, BS), (2, BS - 1, 1), (2, 1, BS - 1)):
                if nb <= 0:
                    continue
                s = np.full((10, 3 + nb + IW), np.nan, np.float32)
                run(qp, qsc, qc, k, blk * region, BS, off, nb, v, s, 3)
                exact = qch.astype(np.int64) @ codes[blk, off:off + nb].T
                ref = qsc[:, None].astype(np.float64) * exact + qc[:, None]
                got = s[:, 3:3 + nb]
                assert np.abs(got - ref).max() < 1e-6 * np.abs(ref).max(), (D, BS, blk, off, nb)
                assert np.isnan(s[:, :3]).all(), (D, BS)  # nothing before col


@SHAPES
@pytest.mark.parametrize("P", [1, 2])
def test_accumulate_int4(W, T, C, IW, P):
    """Value sums over quads of 4 tokens in the VNNI value order (`int4.quads`), weights in P
    bytes, against numpy's integer sums: every head-group size, quads in any order, the extreme
    codes and weights."""
    a1, a2, a3, a4 = (_simd_int4.make_accumulate_int4(ng, max(C // 2, 1) if P == 1 else 1, IW, P)
                      for ng in (1, 2, 3, 4))

    @numba.njit
    def run(wq, wsc, zsum, v, quads, nq, acc):
        a4(wq, wsc, zsum, 0, v, quads, nq, acc)
        a3(wq, wsc, zsum, 4, v, quads, nq, acc)
        a2(wq, wsc, zsum, 7, v, quads, nq, acc)
        a1(wq, wsc, zsum, 9, v, quads, nq, acc)

    rng = np.random.default_rng(5)
    for D in (64, 96, 128, 256):
        NG = D // 32
        codes = rng.integers(0, 16, (12, 4, D))  # 12 quads of 4 tokens
        codes[3] = 15
        v = int4.quads(int4.pack(torch.from_numpy(codes))).numpy().reshape(12, D // 2, 4)  # a block of 4 a quad
        assert v.shape == (12, D // 2, 4)
        for nq in (4, 1, 3, 10):
            sel = rng.permutation(12)[:nq]
            sel[0] = 3
            wq = rng.integers(0, 256, (P, 10, NG, 4 * nq + 1)).astype(np.uint8)
            wq[:, :, :, :4] = 255 if P == 1 else [[[[253]]], [[[255]]]]  # the extreme sums of the int32 lanes
            w = wq[0].astype(np.int64) if P == 1 else 256 * wq[0].astype(np.int64) + wq[1]
            wsc = (rng.random((10, NG)) * 1e-6).astype(np.float32)
            zsum = rng.standard_normal((10, NG)).astype(np.float32)
            acc0 = rng.standard_normal((10, D)).astype(np.float32)
            acc = acc0.copy()
            run(wq, wsc, zsum, v, (sel * 2 * D).astype(np.int64), nq, acc)  # quads as byte offsets
            cols = codes[sel].reshape(4 * nq, NG, 32)  # column 4u + j: quad u's token j
            exact = np.einsum("grt,trc->grc", w[:, :, :4 * nq], cols)
            ref = acc0 + (wsc[:, :, None] * exact + zsum[:, :, None]).reshape(10, D)
            assert np.abs(acc - ref).max() < 1e-5 * np.abs(ref).max(), (D, nq, P)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return bf16(x)[0]


@SHAPES
def test_key_factors(W, T, C, IW):
    """A block's query: the scales' integer form (make_block_scales) and each head's q' by
    pmulhrsw (make_block_query), against the same integer arithmetic in numpy."""
    bs = _simd_int4_factors.make_block_scales(W, IW)
    f1, f2, f3, f4 = (_simd_int4_factors.make_block_query(ng, W, IW) for ng in (1, 2, 3, 4))

    @numba.njit
    def run(q16, qa, ks, kz, row, u16, zs, bsc, qn, qp, qsc, qcon):
        bs(ks, kz, row, u16, zs, bsc)
        f4(q16, qa, u16, bsc, zs, qn, 0, qp, qsc, qcon)
        f3(q16, qa, u16, bsc, zs, qn, 4, qp, qsc, qcon)
        f2(q16, qa, u16, bsc, zs, qn, 7, qp, qsc, qcon)
        f1(q16, qa, u16, bsc, zs, qn, 9, qp, qsc, qcon)

    rng = np.random.default_rng(6)
    for D in (64, 96, 128, 256):
        if D % (2 * IW):
            continue
        order = _simd_int4.pair_order(D)
        for zero_scales in (False, True):
            qn = rng.standard_normal((10, D)).astype(np.float32)
            qn[9] = 0.0  # an all-zero query
            q16 = rng.integers(-32767, 32768, (10, D)).astype(np.int16)
            q16[0, :] = 32767  # the extreme products
            qa = (rng.random(10) * 1e-4 + 1e-6).astype(np.float32)
            ks = bf16_bits(np.zeros((3, D)) if zero_scales else rng.random((3, D)) * 0.3 + 1e-3)
            kz = bf16_bits(rng.standard_normal((3, D)))
            u16, zs, bsc = np.zeros(D, np.int16), np.zeros(D, np.float32), np.zeros(1, np.float32)
            qp = np.zeros((10, D), np.int16)
            qsc, qcon = np.zeros(10, np.float32), np.zeros(10, np.float32)
            run(q16, qa, ks, kz, 1, u16, zs, bsc, qn, qp, qsc, qcon)
            s = (ks[1].astype(np.uint32) << 16).view(np.float32)
            z = (kz[1].astype(np.uint32) << 16).view(np.float32)
            b = s.max() / np.float32(32767.0) if s.max() > np.float32(1e-30) else np.float32(1.0)
            assert bsc[0] == np.float32(b)
            u = np.rint(s * (np.float32(1.0) / np.float32(b))).astype(np.int64)
            assert np.array_equal(u16, u[order]), D  # the code layout
            assert np.array_equal(zs, (np.float32(7.5) * s + z).astype(np.float32)) or \
                np.abs(zs - (7.5 * s + z)).max() < 1e-6 * np.abs(zs).max(), D
            ref = (q16.astype(np.int64) * u[order] + (1 << 14)) >> 15  # pmulhrsw: a·b / 2^15, half up
            assert np.array_equal(qp, ref.astype(np.int16)), D
            sc = qa * np.float32(b) * np.float32(32768.0)
            assert np.allclose(qsc, sc, rtol=1e-6), D
            con = qn.astype(np.float64) @ zs.astype(np.float64) - 7.5 * sc * ref.sum(1)
            scale = np.abs(qn).astype(np.float64) @ np.abs(zs) + 7.5 * sc * np.abs(ref).sum(1) + 1e-30
            assert (np.abs(qcon - con) / scale).max() < 1e-5, D


@SHAPES
@pytest.mark.parametrize("P", [1, 2])
def test_value_factors(W, T, C, IW, P):
    vf = _simd_int4_weights.make_value_factors(W, P)
    run = numba.njit(lambda p, vsc, vzr, n, wq, wsc, zsum: vf(p, vsc, vzr, n, wq, wsc, zsum))
    levels = np.float32(_simd_int4_weights.WEIGHT_LEVELS[P])
    rng = np.random.default_rng(7)
    for NG, n in ((2, 64), (4, 37), (3, 1), (8, 16)):
        cols = -(-n // W) * W
        p = rng.random((5, cols)).astype(np.float32)
        p[:, n:] = np.nan  # past n: never read into the results
        p[4] = 0.0  # a head whose tile is all but zero
        vsc = (rng.random((NG, cols)) * 0.1 + 1e-3).astype(np.float32)
        vzr = rng.standard_normal((NG, cols)).astype(np.float32)
        vsc[:, n:], vzr[:, n:] = np.inf, np.nan
        wq = np.full((P, 5, NG, cols), 99, np.uint8)
        wsc, zsum = np.zeros((5, NG), np.float32), np.zeros((5, NG), np.float32)
        run(p, vsc, vzr, n, wq, wsc, zsum)
        pn, sn, zn = p[:, :n], vsc[:, :n], vzr[:, :n]
        mx = pn.max(1) * sn.max()
        sc = np.where(mx > np.float32(1e-30), mx / levels, np.float32(1.0)).astype(np.float32)
        prod = pn[:, None, :] * sn[None]  # [5, NG, n] float32
        r = np.rint(prod * (np.float32(1.0) / sc)[:, None, None])
        assert r.max() <= levels
        w = wq[0].astype(np.int64) if P == 1 else 256 * wq[0].astype(np.int64) + wq[1]
        assert np.array_equal(w[:, :, :n], r.astype(np.int64)), (NG, n)
        assert np.all(wq[:, :, :, n:] == 0)
        assert np.array_equal(wsc, np.repeat(sc[:, None], NG, 1))
        err = (r.astype(np.float64) * sc[:, None, None] - prod).sum(2)
        ref = np.einsum("gt,rt->gr", pn.astype(np.float64), zn) - 7.5 * err
        assert np.abs(zsum - ref).max() < 1e-5 * np.abs(pn).sum(1).max() * np.abs(zn).max(), (NG, n)


@SHAPES
def test_scales_copy(W, T, C, IW):
    sc = _simd_int4_weights.make_scales_copy(W)
    run = numba.njit(lambda vs, vz, row, nb, vsc, vzr, col: sc(vs, vz, row, nb, vsc, vzr, col))
    rng = np.random.default_rng(8)
    for NG in (1, 2, 3, 4, 5, 8):  # 1, 5: the scalar loop
        vs = bf16_bits(rng.standard_normal((80, NG)))
        vz = bf16_bits(rng.standard_normal((80, NG)))
        for row, nb, col in ((16, 16, 0), (3, 31, 5), (40, 7, 1), (0, 1, 0), (50, 30, 2)):
            vsc = np.full((NG, 40), np.nan, np.float32)
            vzr = np.full((NG, 40), np.nan, np.float32)
            run(vs, vz, row, nb, vsc, vzr, col)
            for got, src in ((vsc, vs), (vzr, vz)):
                want = np.full((NG, 40), np.nan, np.float32)
                want[:, col:col + nb] = (src[row:row + nb].astype(np.uint32) << 16).view(np.float32).T
                assert np.array_equal(got, want, equal_nan=True), (NG, row, nb, col)


WIDE = r"""
import pickle, sys, types
pkg = types.ModuleType("cpu_attention")  # _simd's shapes set before the package imports decode
pkg.__path__ = [sys.argv[1] + "/cpu_attention"]
sys.modules["cpu_attention"] = pkg
import cpu_attention._simd as S
S.VEC, S.IVEC, S.DOT_TOKENS, S.ACC_CHUNKS, S._MADD, S._MULHRS = 16, 16, 4, 4, (None, 16), (None, 32)
S.make_dots.__defaults__, S.make_accumulate.__defaults__ = (4, 16), (4, 16)
del sys.modules["cpu_attention"]
import cpu_attention._simd_vnni as V  # int8's vpdpbusd as plain IR
V.make_scores.__defaults__, V.make_values.__defaults__ = (16, None), (V.VALUE_CHUNKS, 16, None)
from cpu_attention import decode, decode_tiles, _simd_int4
assert (decode.VEC, decode_tiles.DOT_TOKENS, _simd_int4.IVEC) == (16, 4, 16)
from cpu_attention import decode_attention
for path in sys.argv[2:]:
    with open(path, "rb") as f:
        pool, bt, sl, q, scale = pickle.load(f)
    with open(path + ".out", "wb") as f:
        pickle.dump(decode_attention(pool, 0, q, bt, sl, scale, threads=2), f)
"""


@pytest.mark.slow
def test_decode_at_avx512_shapes(tmp_path):
    """The decode kernels at the AVX-512 host's shapes (16 lanes, 4 tokens a score pass, 4
    accumulator vectors, int4's pmaddwd and int8's vpdpbusd of 16 int32 lanes as plain IR), run here
    against their float64 references in a fresh process (its own Numba cache: the shapes are
    constants compiled in): the layouts, tails and remainders those shapes take, which the
    micro-kernel tests above do not reach. The pools and references are made here (the pool
    writers do not depend on the shapes), so the fresh process compiles only the decode
    kernels, and at NUMBA_OPT=0: what is checked is what the IR computes, which LLVM's
    optimizations keep; the tests above compile the same IR at -O3. ~1 min on 2 cores (all in
    the fresh process, at -O3: ~2 min)."""
    import math
    import os
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    import torch
    from test_cpu_attention import KERNEL_TOL, make, rel

    from cpu_attention import KVDtype, decode_attention_ref

    cases, paths = [], []
    for dt, D, BS, by_token in (("int4", 128, 16, True), ("int4", 96, 32, False), ("int8", 128, 16, False),
                                ("bf16", 128, 16, False)):
        pool, bt, sl, q, _ = make(KVDtype(dt), D, BS, [1, 40, 1000], seed=D + BS, by_token=by_token)
        cases.append((dt, D, BS, decode_attention_ref(pool, 0, q, bt, sl, 1 / math.sqrt(D), dtype=torch.float64)))
        paths.append(str(tmp_path / f"{dt}_{D}_{BS}.pkl"))
        with open(paths[-1], "wb") as f:
            pickle.dump((pool, bt, sl, q, 1 / math.sqrt(D)), f)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "NUMBA_OPT": "0"}
    r = subprocess.run([sys.executable, "-c", WIDE, root, *paths], capture_output=True, text=True, env=env,
                       timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    for (dt, D, BS, (ro, rl)), path in zip(cases, paths):
        with open(path + ".out", "rb") as f:
            out, lse = pickle.load(f)
        err, lse_err = rel(out, ro), float((lse.double() - rl).abs().max())
        assert err < KERNEL_TOL[KVDtype(dt)] and lse_err < (3e-4 if dt == "int8" else 1e-4), (dt, D, BS, err, lse_err)
