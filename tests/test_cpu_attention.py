"""Numba host attention kernels against float64 torch references (CPU, CI).

Data: keys and values are randn plus a fixed per-channel offset of each kv head (real
K/V activations have such channel means), queries randn, scale 1/sqrt(D).
"""
from __future__ import annotations

import math
import threading

import pytest
import torch

from cpu_attention import (
    HostKVPool,
    KVDtype,
    decode_attention,
    decode_attention_ref,
    merge_attention,
    prefill_attention,
    prefill_attention_ref,
)

LENS = [1, 17, 1000, 4097]
HKV, G = 2, 3  # odd group size on purpose
# Against the dequantized pool every kernel must be exact to 1e-4 (the issue asks 1e-3 for
# bf16). Against the unquantized data: int8 2e-2 and int4 8e-2 as the issue asks; bf16's own
# storage rounding (2^-9 relative per element) alone gives ~1.5e-3 on a one-token sequence,
# so its bound there is 4e-3.
# int4 exception: a one-token sequence's output is one dequantized V row, and 16 levels over
# a gaussian group of 32 leave ~8% rms error per row (measured 8.0-8.2% here even with the
# clip search), so that single case gets 1e-1; every longer sequence must meet 8e-2.
QUANT_TOL = {KVDtype.BF16: 4e-3, KVDtype.INT8: 2e-2, KVDtype.INT4: 8e-2}
# int8 scores are integer dot products with q rounded to int16 (per head, 2^-16 of its largest
# element): that shifts all of a head's scores alike by about q's rounding error · the keys'
# channel means, which the output does not see (softmax) but its log-sum-exp does (measured
# up to 8e-5 here, vs the 1e-2 of int8 keys themselves)
LSE_TOL = {KVDtype.BF16: 1e-4, KVDtype.INT8: 3e-4, KVDtype.INT4: 1e-4}
INT4_ONE_ROW_TOL = 1e-1
CASES = [  # (head dim, block size): every head dim, several block sizes; 72 and 36 are not
    # multiples of every vector width, so they also run the kernels' fallbacks (`decode_*_any`)
    (64, 16), (80, 5), (96, 32), (128, 16), (256, 7), (72, 16), (36, 9),
]


def make(dtype: KVDtype, D: int, BS: int, lens: list[int], seed: int = 0, g: int = G):
    """A pool holding len(lens) sequences in shuffled blocks, plus their exact K/V (float64),
    and queries for g query heads per kv head."""
    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-n // BS) for n in lens]
    NB = sum(nbs) + 2
    pool = HostKVPool(1, NB, HKV, BS, D, dtype)
    perm = torch.randperm(NB, generator=gen)
    bt = torch.zeros(len(lens), max(nbs), dtype=torch.int32)
    kmu = torch.randn(HKV, D, generator=gen, dtype=torch.float64)
    vmu = torch.randn(HKV, D, generator=gen, dtype=torch.float64)
    raw, c = [], 0
    for i, (n, nb) in enumerate(zip(lens, nbs)):
        bt[i, :nb] = perm[c:c + nb].int()
        c += nb
        k = torch.randn(n, HKV, D, generator=gen, dtype=torch.float64) + kmu
        v = torch.randn(n, HKV, D, generator=gen, dtype=torch.float64) + vmu
        t = torch.arange(n)
        pool.write(0, bt[i, t // BS].long() * BS + t % BS, k, v)
        raw.append((k, v))
    q = torch.randn(len(lens), HKV * g, D, generator=gen)
    return pool, bt, torch.tensor(lens), q, raw


def exact_attention(q, raw, scale):
    """float64 attention over the unquantized K/V: out [B, Hq, D], lse [B, Hq]."""
    outs, lses = [], []
    g = q.shape[1] // HKV
    for b, (k, v) in enumerate(raw):
        kk = k.permute(1, 0, 2).repeat_interleave(g, 0)  # [Hq, n, D]
        vv = v.permute(1, 0, 2).repeat_interleave(g, 0)
        s = torch.einsum("hd,hnd->hn", q[b].double(), kk) * scale
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hn,hnd->hd", torch.exp(s - lse[:, None]), vv))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.INT8, KVDtype.INT4])
@pytest.mark.parametrize("D,BS", CASES)
def test_decode_matches_references(dtype, D, BS):
    if dtype is KVDtype.INT4 and D % 32:
        pytest.skip("int4 groups of 32 need head_dim % 32 == 0")
    pool, bt, sl, q, raw = make(dtype, D, BS, LENS, seed=D + BS)
    scale = 1 / math.sqrt(D)
    out, lse = decode_attention(pool, 0, q, bt, sl, scale, threads=2)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    # kernel exactness: the same dequantized pool in float64
    ro, rl = decode_attention_ref(pool, 0, q, bt, sl, scale, dtype=torch.float64)
    assert rel(out, ro) < 1e-4
    assert (lse.double() - rl).abs().max() < LSE_TOL[dtype]
    # quantization error against the unquantized float64 attention, per sequence
    eo, el = exact_attention(q, raw, scale)
    for b, n in enumerate(LENS):
        tol = INT4_ONE_ROW_TOL if (dtype is KVDtype.INT4 and n == 1) else QUANT_TOL[dtype]
        assert rel(out[b], eo[b]) < tol, (b, n)


@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.INT8, KVDtype.INT4])
@pytest.mark.parametrize("g", [1, 2, 4, 5, 6, 7, 8])
def test_decode_every_group_size(dtype, g):
    """The kernels do heads in groups of 4, then one group of 3, 2 or 1 (G = 3 is the main
    test's): every remainder and more than one full group, odd lengths (odd last tiles)."""
    D, BS, lens = 64, 16, [1, 17, 1000]
    pool, bt, sl, q, raw = make(dtype, D, BS, lens, seed=g, g=g)
    scale = 1 / math.sqrt(D)
    out, lse = decode_attention(pool, 0, q, bt, sl, scale, threads=2)
    ro, rl = decode_attention_ref(pool, 0, q, bt, sl, scale, dtype=torch.float64)
    assert rel(out, ro) < 1e-4
    assert (lse.double() - rl).abs().max() < LSE_TOL[dtype]
    eo, _ = exact_attention(q, raw, scale)
    for b, n in enumerate(lens):
        tol = INT4_ONE_ROW_TOL if (dtype is KVDtype.INT4 and n == 1) else QUANT_TOL[dtype]
        assert rel(out[b], eo[b]) < tol, (b, n)


def test_decode_split_merges_to_full():
    """A sequence split between two tiers: merging the two partials gives the full result."""
    D, BS, n, cut = 128, 16, 1000, 384  # cut on a block boundary, as tiers are
    pool, bt, sl, q, _ = make(KVDtype.INT8, D, BS, [n], seed=3)
    scale = 1 / math.sqrt(D)
    full = decode_attention(pool, 0, q, bt, sl, scale, threads=2)
    a = decode_attention(pool, 0, q, bt, torch.tensor([cut]), scale, threads=2)
    b = decode_attention(pool, 0, q, bt[:, cut // BS:], torch.tensor([n - cut]), scale, threads=2)
    o, lse = merge_attention(a[0], a[1], b[0], b[1])
    assert rel(o, full[0]) < 1e-5
    assert (lse - full[1]).abs().max() < 1e-5


def test_decode_many_work_items_and_empty_sequence():
    """Long sequences are cut into several work items (one thread per item range); an
    empty sequence gets out 0 and lse -inf."""
    D, BS = 64, 16
    pool, bt, sl, q, _ = make(KVDtype.BF16, D, BS, [4097, 0, 300], seed=5)
    scale = 1 / math.sqrt(D)
    for threads in (1, 2):
        out, lse = decode_attention(pool, 0, q, bt, sl, scale, threads=threads)
        ro, rl = decode_attention_ref(pool, 0, q[[0, 2]], bt[[0, 2]], sl[[0, 2]], scale, torch.float64)
        assert rel(out[[0, 2]], ro) < 1e-4
        assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))


@pytest.mark.parametrize("n,hkv,threads", [(2048, 3, 2), (2049, 3, 2), (2048, 3, 3), (32768, 8, 16), (100, 3, 2)])
def test_work_split_is_even(n, hkv, threads):
    """One sequence's items: equal (but the last of each kv head, as items are block-aligned) and
    a count that is a multiple of the threads where the sequence is long enough to split, so
    Numba's static schedule (an equal count of consecutive items a thread) hands every thread
    the same tokens within a few percent."""
    import numpy as np

    from cpu_attention.decode import _plan, chunk_tokens

    sl = np.array([n])
    items, _ = _plan(sl, hkv, chunk_tokens(sl, hkv, 32, threads))
    sizes = items[:, 3] - items[:, 2]
    assert sizes.sum() == n * hkv
    if n >= 1024:
        assert len(items) % threads == 0
        per_thread = sizes.reshape(threads, -1).sum(1)
        assert per_thread.max() <= 1.05 * n * hkv / threads, per_thread


@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.INT4])
def test_prefill_matches_reference(dtype):
    D, BS, n = 128, 16, 2600
    pool, bt, _, _, _ = make(dtype, D, BS, [n], seed=7)
    gen = torch.Generator().manual_seed(1)
    T = 37
    q = torch.randn(T, HKV * G, D, generator=gen)
    scale = 1 / math.sqrt(D)
    # tier holds positions 100..2699; queries at 2580..2616 see part of it; then a chunk
    # that starts before the tier (its first queries see nothing)
    for q_pos0, kv_pos0 in ((2580, 100), (80, 100)):
        out, lse = prefill_attention(pool, 0, q, bt[0], n, q_pos0, scale, kv_pos0=kv_pos0, threads=2)
        ro, rl = prefill_attention_ref(pool, 0, q, bt[0], n, q_pos0, scale, kv_pos0=kv_pos0,
                                       dtype=torch.float64)
        assert rel(out, ro) < 1e-4
        seen = torch.isfinite(rl)
        assert torch.equal(torch.isfinite(lse), seen)
        assert (lse[seen].double() - rl[seen]).abs().max() < 1e-4
        assert torch.all(out[~seen.all(-1)] == 0)


def test_kernel_releases_the_gil():
    """While a kernel runs in a worker thread, the main thread keeps executing Python."""
    D, BS = 128, 16
    pool, bt, sl, q, _ = make(KVDtype.BF16, D, BS, [4097] * 8, seed=9)
    decode_attention(pool, 0, q, bt, sl, 0.1, threads=1)  # compile / load outside the test
    counter = [0]
    during = []
    stop = threading.Event()

    def worker():
        for _ in range(5):
            c0 = counter[0]
            decode_attention(pool, 0, q, bt, sl, 0.1, threads=1)
            during.append(counter[0] - c0)
        stop.set()

    t = threading.Thread(target=worker)
    t.start()
    while not stop.is_set():
        counter[0] += 1
    t.join()
    # with the GIL held for a whole kernel the main thread could not count during it
    assert sum(during) > 1000, during


@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.INT8, KVDtype.INT4])
def test_numba_append_equals_torch_quantize(dtype):
    from cpu_attention.layout import quantize

    gen = torch.Generator().manual_seed(11)
    pool = HostKVPool(2, 5, 3, 16, 64, dtype)
    x = torch.randn(13, 3, 64, generator=gen) * 3
    x[0, 0, :32] = 0.5  # a constant int4 group
    slots = torch.randperm(80, generator=gen)[:13]
    pool.write(1, slots, x, -x)
    blk, off = slots // 16, slots % 16
    for name, src in (("k", x), ("v", -x)):
        data, scale, zero = quantize(src, dtype)
        assert torch.equal(getattr(pool, name)[1, blk, :, off], data)
        if scale is not None:
            assert torch.equal(getattr(pool, f"{name}_scale")[1, blk, :, off], scale)
        if zero is not None:
            assert torch.equal(getattr(pool, f"{name}_zero")[1, blk, :, off], zero)
    assert torch.all(getattr(pool, "k")[0] == 0)  # other layer untouched
