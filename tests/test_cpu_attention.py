"""Numba host attention kernels against float64 torch references (CPU, CI).

Data: keys and values are randn plus a fixed per-channel offset of each kv head (real
K/V activations have such channel means), queries randn, scale 1/sqrt(D).
"""
from __future__ import annotations

import functools
import math
import subprocess
import sys
import threading

import numba
import numpy as np
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
from cpu_attention import _amx, int4, rotation, warm
from cpu_attention import decode_int8 as int8_mod
from cpu_attention.layout import int8_rows, quantize

LENS = [1, 17, 1000, 4097]
HKV, G = 2, 3  # odd group size on purpose
# Against the dequantized pool every kernel must be exact to 1e-4 (int8, int4: KERNEL_TOL; the issue
# asks 1e-3 for bf16). Against the unquantized data: int8 2e-2 and int4 8e-2 as the issue asks; bf16's own
# storage rounding (2^-9 relative per element) alone gives ~1.5e-3 on a one-token sequence,
# so its bound there is 4e-3.
# int4 exception: a one-token sequence's output is one dequantized V row, and 16 levels over
# a gaussian group of 32 leave ~8% rms error per row (measured 7.5-8.4% here with the rotation
# and the clip search), so that single case gets 1e-1; every longer sequence must meet 8e-2.
QUANT_TOL = {KVDtype.BF16: 4e-3, KVDtype.INT8: 2e-2, KVDtype.INT4: 8e-2}
# int8 scores are integer dot products with q rounded to int16 (per head, 2^-16 of its largest
# element): that shifts all of a head's scores alike by about q's rounding error · the keys'
# channel means, which the output does not see (softmax) but its log-sum-exp does (measured
# up to 8e-5 here, vs the 1e-2 of int8 keys themselves)
LSE_TOL = {KVDtype.BF16: 1e-4, KVDtype.INT8: 3e-4, KVDtype.INT4: 1e-4}
INT4_ONE_ROW_TOL = 1e-1
# kernel against its float64 twin over the same stored KV: exact to 1e-4, but int8 and int4 round
# their value weights to one byte per tile and head (`decode_int8._softmax_split`,
# `_simd_int4_weights`: 3e-4–1.1e-3 measured on these cases, ten times below their own error
# against unquantized attention, which QUANT_TOL bounds)
KERNEL_TOL = {KVDtype.BF16: 1e-4, KVDtype.INT8: 3e-3, KVDtype.INT4: 3e-3}
CASES = [  # (head dim, block size): every head dim, several block sizes; 72 and 36 are not
    # multiples of every vector width, so they also run the kernels' fallbacks (`decode_*_any`)
    (64, 16), (80, 5), (96, 32), (128, 16), (256, 7), (72, 16), (36, 9),
]


def make(dtype: KVDtype, D: int, BS: int, lens: list[int], seed: int = 0, g: int = G, by_token: bool = False):
    """A pool holding len(lens) sequences in shuffled blocks, plus their exact K/V (float64),
    and queries for g query heads per kv head. Each sequence is written in one call, or
    (by_token) as decode fills a cache: its first 3 tokens in one call, then one token a call."""
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
        slots = bt[i, t // BS].long() * BS + t % BS
        cuts = [0, *range(min(n, 3), n + 1)] if by_token else [0, n]
        for a, b in zip(cuts, cuts[1:]):
            pool.write(0, slots[a:b], k[a:b], v[a:b])
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
    if dtype is KVDtype.INT4:  # each sequence's last block is partly filled, so in its bf16 tail
        assert int((pool.tails.slot[0] >= 0).sum()) == sum(n % BS != 0 for n in LENS)
    scale = 1 / math.sqrt(D)
    out, lse = decode_attention(pool, 0, q, bt, sl, scale, threads=2)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    # kernel exactness: the same dequantized pool in float64
    ro, rl = decode_attention_ref(pool, 0, q, bt, sl, scale, dtype=torch.float64)
    assert rel(out, ro) < KERNEL_TOL[dtype]
    assert (lse.double() - rl).abs().max() < LSE_TOL[dtype]
    # quantization error against the unquantized float64 attention, per sequence
    eo, el = exact_attention(q, raw, scale)
    for b, n in enumerate(LENS):
        tol = INT4_ONE_ROW_TOL if (dtype is KVDtype.INT4 and n == 1) else QUANT_TOL[dtype]
        assert rel(out[b], eo[b]) < tol, (b, n)


@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.INT8, KVDtype.INT4])
@pytest.mark.parametrize("g", [1, 2, 4, 5, 6, 7, 8, 24])
def test_decode_every_group_size(dtype, g):
    """The kernels do heads in groups of 4, then one group of 3, 2 or 1 (G = 3 is the main
    test's): every remainder and more than one full group, odd lengths (odd last tiles)."""
    D, BS, lens = 64, 16, [1, 17, 1000]
    _check_kernel(dtype, D, lens, *make(dtype, D, BS, lens, seed=g, g=g))


def _check_kernel(dtype, D, lens, pool, bt, sl, q, raw):
    """The kernel against its float64 reference over the same stored KV (1e-4), and against exact
    attention over the unquantized KV within the dtype's bound."""
    scale = 1 / math.sqrt(D)
    out, lse = decode_attention(pool, 0, q, bt, sl, scale, threads=2)
    ro, rl = decode_attention_ref(pool, 0, q, bt, sl, scale, dtype=torch.float64)
    assert rel(out, ro) < KERNEL_TOL[dtype]
    assert (lse.double() - rl).abs().max() < LSE_TOL[dtype]
    eo, _ = exact_attention(q, raw, scale)
    for b, n in enumerate(lens):
        tol = INT4_ONE_ROW_TOL if (dtype is KVDtype.INT4 and n == 1) else QUANT_TOL[dtype]
        assert rel(out[b], eo[b]) < tol, (b, n)


@pytest.mark.parametrize("D,BS", [c for c in CASES if c[0] % 32 == 0])
def test_int4_decode_after_token_by_token_appends(D, BS):
    """int4 filled as decode fills it, one token a call: every block but a sequence's last is
    quantized when its last token comes, the last stays in its bf16 tail; the kernel (tiles
    over quantized blocks and a tail) matches the reference and the accuracy bound holds."""
    _check_kernel(KVDtype.INT4, D, LENS, *make(KVDtype.INT4, D, BS, LENS, seed=D + BS + 1, by_token=True))


@pytest.mark.parametrize("D,BS,g", [(64, 16, 8), (128, 32, 32), (128, 64, 20), (64, 48, 4), (128, 16, 33)])
def test_int8_tile_products(D, BS, g, monkeypatch):
    """int8 decode through tile products (`_amx`: the AMX tiles where the CPU has them, else their
    plain twins): heads in one tile, two full tiles, groups that overlap (20: 10 + 10; 33: three
    of 11), block sizes 16 to 64, both head dims a tile takes. Within the kernel bound of the
    reference, and of the vector kernels' output."""
    lens = [1, 17, 1000]
    case = make(KVDtype.INT8, D, BS, lens, seed=g, g=g)
    pool, bt, sl, q, _ = case
    vector = decode_attention(pool, 0, q, bt, sl, 1 / math.sqrt(D), threads=2)
    monkeypatch.setattr(int8_mod, "TILE_MIN_HEADS", 1)
    assert int8_mod.use_tiles(g, D, BS)
    _check_kernel(KVDtype.INT8, D, lens, *case)
    tiled = decode_attention(pool, 0, q, bt, sl, 1 / math.sqrt(D), threads=2)
    assert rel(tiled[0], vector[0]) < KERNEL_TOL[KVDtype.INT8]
    assert (tiled[1] - vector[1]).abs().max() < 1e-5


@numba.njit
def _tiles_as_called(qp, k, kbase, ngroups, nb, BS, ci, wp, v, gbase, vi, rows):
    _amx.scores_tiles(qp, k, kbase, ngroups, BS, ci, rows)
    _amx.values_tiles(wp, v, gbase, nb, BS, vi, rows)
    _amx.release()


@pytest.mark.skipif(not _amx.TILES, reason="the CPU has no AMX tiles (or Linux did not grant them)")
@pytest.mark.parametrize("BS,G,rows", [(16, 16, 16), (32, 20, 10), (64, 33, 11), (16, 5, 5)])
def test_amx_tiles_equal_their_twins(BS, G, rows):
    """The tile intrinsics give the plain twins' integer sums to the bit (scattered blocks, an odd
    number of token groups, row groups that overlap)."""
    rng = np.random.default_rng(BS + G)
    D, NB, nb = 128, 12, 5
    k = rng.integers(-127, 128, (NB, 2, D // 4, BS, 4), dtype=np.int8)
    v = rng.integers(-127, 128, (NB, 2, BS // 4, D, 4), dtype=np.int8)
    qp = rng.integers(-128, 128, (2, G, D), dtype=np.int8)
    wp = rng.integers(0, 256, (G, nb * BS), dtype=np.uint8)
    blocks = rng.permutation(NB)[:nb] * 2 + 1  # (block, head 1)
    per = BS // 16  # token groups a block
    kbase = (np.repeat(blocks * D * BS, per) + np.tile(np.arange(per) * 64, nb)).astype(np.int64)
    gbase = (np.repeat(blocks * D * BS, BS // 4) + np.tile(np.arange(BS // 4) * 4 * D, nb)).astype(np.int64)
    ngroups = nb * per - (1 - nb * per % 2)  # an odd count: the last pair is one group
    outs = []
    for twin in (False, True):
        ci, vi = np.zeros((2, G, nb * BS), np.int32), np.zeros((G, D), np.int32)
        if twin:
            _amx.scores_twin(qp, k, kbase, ngroups, BS, ci, rows)
            _amx.values_twin(wp, v, gbase, nb, BS, vi, rows)
        else:
            _tiles_as_called(qp, k, kbase, ngroups, nb, BS, ci, wp, v, gbase, vi, rows)
        outs.append((ci, vi))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    assert (outs[1][0][:, :, :16 * ngroups] != 0).mean() > 0.99  # every score written
    assert not outs[1][0][:, :, 16 * ngroups:].any()


@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.INT8])
def test_decode_scores_far_apart(dtype):
    """A query 30x the usual size puts scores ~100 apart: whole tiles sit 70-87 below the
    running max (weights ~e^-80, whose int16 scale would leave float32's range) or further
    (weights 0). The output stays the reference's (int8's int16 rounding of q grows with q)."""
    D, BS, lens = 64, 16, [700, 33]
    pool, bt, sl, q, _ = make(dtype, D, BS, lens, seed=13)
    q = q * 30
    out, lse = decode_attention(pool, 0, q, bt, sl, 1 / math.sqrt(D), threads=2)
    ro, rl = decode_attention_ref(pool, 0, q, bt, sl, 1 / math.sqrt(D), dtype=torch.float64)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel(out, ro) < 1e-3
    assert (lse.double() - rl).abs().max() < 1e-2


@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.INT8])
def test_decode_split_merges_to_full(dtype):
    """A sequence split between two tiers: merging the two partials gives the full result (to
    1e-5; int8 to its weights' rounding, which depends on where a tile starts: KERNEL_TOL)."""
    D, BS, n, cut = 128, 16, 1000, 384  # cut on a block boundary, as tiers are
    pool, bt, sl, q, _ = make(dtype, D, BS, [n], seed=3)
    scale = 1 / math.sqrt(D)
    full = decode_attention(pool, 0, q, bt, sl, scale, threads=2)
    a = decode_attention(pool, 0, q, bt, torch.tensor([cut]), scale, threads=2)
    b = decode_attention(pool, 0, q, bt[:, cut // BS:], torch.tensor([n - cut]), scale, threads=2)
    o, lse = merge_attention(a[0], a[1], b[0], b[1])
    assert rel(o, full[0]) < (1e-5 if dtype is KVDtype.BF16 else KERNEL_TOL[dtype])
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


def test_final_wave_cuts_the_last_items_and_covers_every_token():
    """The work queue's order (`decode.final_wave`): the last `threads` items cut into block-aligned
    pieces of at least MIN_PIECE tokens, handed out after all the others; the items of each
    (sequence, kv head) consecutive and covering its tokens once, in order."""
    from cpu_attention import decode as dm

    lens, Hkv, BS, threads = [8192, 0, 3000], 2, 16, 2
    items, pair_start = dm._plan(np.array(lens, np.int64), Hkv, 4096)
    out, ps, order = dm.final_wave(items, len(pair_start) - 1, Hkv, BS, threads, 4)
    assert sorted(order.tolist()) == list(range(len(out)))
    assert len(out) == len(items) - threads + sum(
        max(min(4, (t1 - t0) // dm.MIN_PIECE), 1) for _, _, t0, t1 in items[-threads:].tolist())
    assert len(out) > len(items)  # something was cut
    last = out[order[-(len(out) - len(items) + threads):]]
    assert all((t1 - t0) >= dm.MIN_PIECE or t1 == lens[b] for b, _, t0, t1 in last.tolist())
    for p in range(len(ps) - 1):
        b, h = divmod(p, Hkv)
        rows = out[ps[p]:ps[p + 1]]
        assert (rows[:, 0] == b).all() and (rows[:, 1] == h).all()
        ends = [0] + rows[:, 3].tolist()
        assert rows[:, 2].tolist() == ends[:-1] and ends[-1] == lens[b]  # contiguous, complete
        assert all(t0 % BS == 0 for t0 in rows[:, 2].tolist())


@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.INT8, KVDtype.INT4])
def test_decode_with_small_last_items(dtype, monkeypatch):
    """Decode over a plan whose last wave is cut into pieces (MIN_PIECE lowered so the test's
    short sequences are cut too), an empty sequence among them: the merge of a pair's many items
    by whichever thread finishes its last one, against the float64 twin."""
    from cpu_attention import decode as dm

    monkeypatch.setattr(dm, "MIN_PIECE", 16)
    monkeypatch.setattr(dm, "_work_items", functools.lru_cache(dm._work_items.__wrapped__))  # its own plans
    D, BS, lens = 64, 16, [1000, 0, 4097]
    pool, bt, sl, q, _ = make(dtype, D, BS, lens, seed=7)
    work = dm.DecodeWork(pool, bt, sl, 2)
    chunk = dm.chunk_tokens(np.array(lens, np.int64), pool.num_kv_heads, BS, 2)
    assert len(work.items) > len(dm._plan(np.array(lens, np.int64), pool.num_kv_heads, chunk)[0])  # cut
    out, lse = decode_attention(pool, 0, q, None, None, 1 / math.sqrt(D), work=work)
    keep = [0, 2]
    ro, rl = decode_attention_ref(pool, 0, q[keep], bt[keep], sl[keep], 1 / math.sqrt(D), dtype=torch.float64)
    assert rel(out[keep], ro) < KERNEL_TOL[dtype]
    assert (lse[keep].double() - rl).abs().max() < LSE_TOL[dtype]
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))


def test_claim_hands_out_each_value_once():
    """The kernels' work queue (`_numba.claim`): threads claiming from one counter at once get
    every value below n exactly once between them, and the counter ends at n + threads."""
    import numba
    import numpy as np

    from cpu_attention._numba import claim

    @numba.njit(parallel=True)
    def take(n, threads):
        queue = np.zeros(16, np.int64)
        got = np.full((threads, n), -1, np.int64)  # row th: what thread th claimed, in order
        for th in numba.prange(threads):
            k = 0
            while True:
                i = claim(queue)
                if i >= n:
                    break
                got[th, k] = i
                k += 1
        return got, queue

    threads, n = 2 * numba.config.NUMBA_NUM_THREADS, 5000
    got, queue = take(n, threads)
    claimed = np.sort(got[got >= 0])
    assert np.array_equal(claimed, np.arange(n)) and queue[0] == n + threads


@pytest.mark.parametrize("n,hkv,threads", [(2048, 3, 2), (2049, 3, 2), (2048, 3, 3), (32768, 8, 16), (100, 3, 2)])
def test_work_split_is_even(n, hkv, threads):
    """One sequence's items: equal (but the last of each kv head, as items are block-aligned) and
    a count that is a multiple of the threads where the sequence is long enough to split, so
    equal threads claiming from the work queue take the same tokens within a few percent."""
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


def assert_same_int4(a: HostKVPool, b: HostKVPool) -> None:
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    ta, tb = a.tails, b.tails
    assert torch.equal(ta.slot, tb.slot) and torch.equal(ta.k, tb.k) and torch.equal(ta.v, tb.v)
    assert int(ta.n_free[0]) == int(tb.n_free[0]) and np.array_equal(ta.free, tb.free)


@pytest.mark.parametrize("n", [13, 4])
@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.INT8, KVDtype.INT4])
def test_numba_append_equals_torch_twins(dtype, n):
    """The Numba append stores exactly the torch twins' bits: `quantize` per token, and for
    int4 `int4.write` (here: blocks started, continued and completed in one call). n tokens of 3
    kv heads: int8 spreads 13 · 3 rows over its threads (`write_kv_int8_parallel`), 4 · 3 not."""
    gen = torch.Generator().manual_seed(11)
    pool = HostKVPool(2, 5, 3, 16, 64, dtype)
    x = torch.randn(13, 3, 64, generator=gen) * 3
    x[0, 0, :32] = 0.5  # a constant int4 group
    rest = torch.randperm(80, generator=gen)
    rest = rest[(rest != 16) & (rest != 31) & (rest != 79)]
    slots = torch.cat([torch.tensor([16, 31, 79]), rest[:10]])  # block 1 starts; blocks 1, 4 reach their end
    x, slots = x[:n], slots[:n]
    pool.write(1, slots, x, -x)
    if dtype is KVDtype.INT4:
        twin = HostKVPool(2, 5, 3, 16, 64, dtype)
        int4.write(twin, 1, slots // 16, slots % 16, x, -x)
        assert_same_int4(pool, twin)
        if n == 13:
            assert int(pool.tails.slot[1, 1]) < 0 and int(pool.tails.slot[1, 4]) < 0  # complete: quantized
        return
    blk, off = slots // 16, slots % 16
    stored = {"k": pool.k, "v": pool.v}
    if dtype is KVDtype.INT8:  # codes in token order
        stored["k"], stored["v"] = int8_rows(pool.k, pool.v, 16)
    for name, src in (("k", x), ("v", -x)):
        data, scale, zero = quantize(src, dtype)
        assert torch.equal(stored[name][1, blk, :, off], data)
        if scale is not None:
            assert torch.equal(getattr(pool, f"{name}_scale")[1, blk, :, off], scale)
        if zero is not None:
            assert torch.equal(getattr(pool, f"{name}_zero")[1, blk, :, off], zero)
    assert torch.all(getattr(pool, "k")[0] == 0)  # other layer untouched


def test_int4_appends_like_the_twin():
    """int4 filled as a cache fills it (a chunk, then one token a call over two layers, a block
    reused from offset 0, a finished block written again): Numba and `int4.write` agree bit
    for bit after every call; complete blocks hold int4 within half a step of the bf16 keys,
    incomplete ones their bf16 tail exactly."""
    gen = torch.Generator().manual_seed(12)
    BS, D, H = 8, 64, 2
    pool, twin = HostKVPool(2, 5, H, BS, D, KVDtype.INT4), HostKVPool(2, 5, H, BS, D, KVDtype.INT4)
    x = torch.randn(44, H, D, generator=gen) + 4 * torch.randn(D, generator=gen)  # channel offsets
    x[9, 1, 5] = 30.0  # an outlier mid-block
    table = torch.tensor([2, 0, 3, 1, 2, 4])  # block 2 again from token 32: restarted at offset 0
    slots = table[torch.arange(44) // BS] * BS + torch.arange(44) % BS
    calls = [(0, 5), *((i, i + 1) for i in range(5, 44)), (10, 12)]  # last: tokens 10, 11 again
    for a, b in calls:
        for layer in (0, 1):
            pool.write(layer, slots[a:b], x[a:b], x[a:b])
            int4.write(twin, layer, slots[a:b] // BS, slots[a:b] % BS, x[a:b], x[a:b])
        assert_same_int4(pool, twin)
    assert int(pool.tails.slot[0, 0]) >= 0  # block 0 (tokens 8..15) was reopened by the rewrite
    k, v = pool.gather(1, table[1:], 40)  # [H, 40, D]: tokens 8..47, the last 4 not written
    ref = x[8:44].transpose(0, 1).to(torch.bfloat16).float()
    step = pool.k_scale[1, table[3]].float()  # block 1: tokens 24..31, complete
    assert torch.all((k[:, 16:24] - ref[:, 16:24]).abs() <= step[:, None] / 2 * (1 + 2**-7))
    assert torch.equal(k[:, 32:36], ref[:, 32:36])  # block 4: tokens 40..43 in its tail


def test_int4_batch_appends_in_parallel_like_the_twin(monkeypatch):
    """A batch's decode steps, one token a sequence a call, staggered so that a call completes some
    blocks while it starts others, and a complete block written again mid-block (back into a tail):
    the parallel writer (`write_kv_int4_parallel`, where a block completes) stores the twin's
    bits; its tails may sit in other slots (it takes them all before freeing any), so they are
    compared block by block, up to the block's furthest token (a reused tail keeps stale rows past it)."""
    from cpu_attention import append_int4

    taken = []
    parallel = append_int4.write_kv_int4_parallel
    monkeypatch.setattr(append_int4, "write_kv_int4_parallel", lambda *a: taken.append(1) or parallel(*a))
    gen = torch.Generator().manual_seed(13)
    BS, D, H, seqs = 8, 64, 3, 5
    pool, twin = HostKVPool(1, 4 * seqs, H, BS, D, KVDtype.INT4), HostKVPool(1, 4 * seqs, H, BS, D, KVDtype.INT4)
    start = [0, 3, 5, 7, 7]  # offsets in a sequence's first block at the first call
    furthest: dict[int, int] = {}
    for step in range(2 * BS + 2):
        pos = torch.tensor([p + step for p in start])
        slots = torch.arange(seqs) * 4 * BS + pos  # sequence s: blocks 4s .. 4s + 3
        if step == BS + 1:
            slots[1] = 4 * BS + 2  # sequence 1 writes into its first block again (complete by now)
        x = torch.randn(seqs, H, D, generator=gen) * 2
        pool.write(0, slots, x, -x)
        int4.write(twin, 0, slots // BS, slots % BS, x, -x)
        for sl in slots.tolist():
            furthest[sl // BS] = max(furthest.get(sl // BS, 0), sl % BS)
        for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
            assert torch.equal(getattr(pool, name), getattr(twin, name)), (step, name)
        ta, tb = pool.tails, twin.tails
        assert torch.equal(ta.slot >= 0, tb.slot >= 0) and int(ta.n_free[0]) == int(tb.n_free[0])
        for b in torch.nonzero(ta.slot[0] >= 0).flatten().tolist():
            sa, sb, n = int(ta.slot[0, b]), int(tb.slot[0, b]), furthest[b] + 1
            assert torch.equal(ta.k[sa, :, :n], tb.k[sb, :, :n]) and torch.equal(ta.v[sa, :, :n], tb.v[sb, :, :n]), (step, b)
    assert len(taken) >= 3  # the calls that completed a block or reopened one


def test_int4_tail_slots_reserved_at_peak_and_released():
    """Whole blocks written in one call (a swap out, a prefill) borrow one tail slot at a time;
    blocks left incomplete keep one each until completed or released."""
    BS, D, H = 8, 32, 2
    pool = HostKVPool(1, 64, H, BS, D, KVDtype.INT4)
    t = pool.tails
    x = torch.randn(40 * BS, H, D)
    pool.write(0, torch.arange(40 * BS), x, x)  # 40 complete blocks
    assert t.k.shape[0] == 8 and int(t.n_free[0]) == 8  # the minimum growth, not 40 slots
    slots = torch.tensor([50 * BS, 50 * BS + 1, 51 * BS, 52 * BS + 3])  # 50, 51 open; 52 had no offset 0
    pool.write(0, slots, x[:4], x[:4])
    assert [int(t.slot[0, b]) >= 0 for b in (50, 51, 52)] == [True, True, True]
    assert int(t.n_free[0]) == 8 - 3
    pool.release([50, 52, 7])  # 7: a quantized block, nothing to free
    assert int(t.n_free[0]) == 8 - 1 and int(t.slot[0, 50]) < 0 and int(t.slot[0, 51]) >= 0


@pytest.mark.parametrize("N,D", [(1, 64), (9, 64), (33, 96), (70, 128), (5, 36)])
def test_numba_row_rotation_equals_torch(N, D):
    """The Numba transforms that int8 decode's any-shape path applies to q and its output
    (`_hadamard.rotate_rows`, `unrotate_rows`: ROWS rows at a time, then the rest):
    `rotation.rotate`'s bits, and `unrotate` (a matrix product in torch) to float32 rounding."""
    from cpu_attention._hadamard import rotate_rows, unrotate_rows

    x = torch.randn(N, D, generator=torch.Generator().manual_seed(N))
    y = x.numpy().copy()
    rotate_rows(y, *rotation.numba_args(D))
    assert torch.equal(torch.from_numpy(y), rotation.rotate(x))
    z = y.copy()
    unrotate_rows(z, *rotation.numba_args(D))
    assert torch.allclose(torch.from_numpy(z), rotation.unrotate(torch.from_numpy(y)), atol=1e-5)
    assert torch.allclose(torch.from_numpy(z), x, atol=1e-5)


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256, 72])
def test_hadamard_rows_equals_torch(D):
    """The fast kernels' rotation of one kv head's rows (`_hadamard.hadamard_rows`: 16-lane vector
    stages, `fwht16`, then whole 16-channel pieces; P % 16 != 0, as D 72's P 8, through
    `transform_rows`), forward and back, on rows 1 .. 4 of 6: `rotation.rotate` / `unrotate` to
    float32 rounding, the other rows untouched."""
    import numba

    from cpu_attention._hadamard import hadamard_rows

    @numba.njit
    def both(x, r0, n, signs, P, c, t):
        y = x.copy()
        hadamard_rows(y, r0, n, signs, P, c, False, t)
        z = y.copy()
        hadamard_rows(z, r0, n, signs, P, c, True, t)
        return y, z

    x = torch.randn(6, D, generator=torch.Generator().manual_seed(D))
    y, z = both(x.numpy(), 1, 4, *rotation.numba_args(D), np.empty((D, 4), np.float32))
    y, z = torch.from_numpy(y), torch.from_numpy(z)
    assert torch.allclose(y[1:5], rotation.rotate(x[1:5]), atol=1e-5)
    assert torch.allclose(z[1:5], x[1:5], atol=1e-5)
    assert torch.equal(y[[0, 5]], x[[0, 5]]) and torch.equal(z[[0, 5]], x[[0, 5]])


def test_rotation_is_orthonormal_and_inverted():
    for D in (64, 96, 128, 256):
        R = rotation.rotate(torch.eye(D))
        assert torch.allclose(R @ R.T, torch.eye(D), atol=1e-6)
        x = torch.randn(5, 3, D)
        assert torch.allclose(rotation.rotate(x), x @ R, atol=1e-5)
        assert torch.allclose(rotation.unrotate(rotation.rotate(x)), x, atol=1e-5)


def test_background_compile_fills_the_cache_a_new_process_loads(tmp_path, monkeypatch):
    """`warm.start` compiles a dtype's kernel in another process into Numba's cache; a process
    started afterwards loads it from there (a cache hit, no compile)."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))  # empty: the background process must compile
    assert warm.start(("bf16",)).wait() == []
    code = ("from cpu_attention.warm import compile_decode; from cpu_attention.layout import KVDtype; "
            "from cpu_attention.decode_bf16 import decode_float as k; compile_decode(KVDtype.BF16); "
            "print(sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    hits, misses = map(int, r.stdout.split())
    assert hits >= 1 and misses == 0


def test_cli_starts_the_compiles_only_for_a_command_that_measures(tmp_path, monkeypatch):
    """The CLI (`cli._start_compiles`): `hetero profile --refresh`, or profile / plan with no cached
    profile (plan: and no --profile FILE), start the background compiles; `start` takes them over."""
    import cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("HETERO_REFRESH", raising=False)
    monkeypatch.delenv("HETERO_PROFILE", raising=False)
    started = []

    class Fake:
        def __init__(self, dtypes):
            self.dtypes = tuple(dtypes)
            started.append(self)

    monkeypatch.setattr(warm, "Compiles", Fake)
    monkeypatch.setattr(warm, "_started", {})

    def starts(*args: str) -> bool:
        warm._started.clear()
        cli._start_compiles(list(args))
        return bool(warm._started)

    assert not starts("chat") and not starts() and not starts("--help")
    assert starts("profile") and starts("plan", "model") and not starts("plan", "model", "--profile", "p.json")
    assert not starts("plan", "--profile=p.json")
    (tmp_path / "hetero").mkdir()
    (tmp_path / "hetero" / "profile.json").write_text("{}")
    assert not starts("profile") and not starts("plan") and starts("profile", "--refresh")
    monkeypatch.setenv("HETERO_REFRESH", "1")
    assert starts("profile")
    early = warm._started[warm.HOST_DTYPES]
    assert warm.start() is early and not warm._started  # measure() takes over the CLI's compiles
    assert warm.start() is not early  # and starts its own next time
