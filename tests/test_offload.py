"""The two-tier KV cache and the split-attention runner, with a CPU stand-in for the device tier.

Every path but the CUDA streams runs here: any split of a sequence's KV between the tiers and
any swap history must give the single-tier tokens, and logits within the tier dtypes' tolerance.
"""
import dataclasses
import math

import pytest
import torch

import hetero
from conftest import rel_err
from cpu_attention import HostKVPool, KVDtype, decode_attention_ref
from hetero.config import LLAMA3_8B
from offload.blocks import TierTable
from offload.kv_cache import TieredKVCache
from offload.stream import KVStreamer

PROMPT = [3, 17, 42, 99, 5, 150, 7, 8, 64, 33, 2, 11, 90, 91, 92, 93, 94, 95, 1, 2]


def _engine(folder, **kw):
    return hetero.load(folder, device="cpu", weights="f32", tokenizer=False, block_size=4, **kw)


def _greedy(engine, prompt=PROMPT, n=24):
    return [c.token for c in engine.generate(prompt, max_new_tokens=n, temperature=0.0)]


@pytest.fixture(scope="module")
def folder(tiny):
    return tiny("llama")[0]


@pytest.fixture(scope="module")
def single(folder):
    e = _engine(folder, kv_dtype="f32")
    return _greedy(e), e.logits(PROMPT)


@pytest.mark.parametrize("gpu_tokens", [1, 4, 7, 16, 20, 33, 1000])
def test_any_split_gives_single_tier_tokens(folder, single, gpu_tokens):
    e = _engine(folder, kv_dtype="f32", gpu_kv_tokens=gpu_tokens)
    tokens = _greedy(e)
    assert tokens == single[0]
    g, h = e.cache.tier_tokens()
    assert g == 0 and h == 0  # finished sequences freed both tiers
    assert rel_err(e.logits(PROMPT), single[1]) <= 1e-5


def test_split_really_uses_both_tiers(folder):
    e = _engine(folder, kv_dtype="f32", gpu_kv_tokens=8)
    seen = []
    for c in e.generate(PROMPT, max_new_tokens=4, temperature=0.0):
        seen.append(e.cache.tier_tokens())
    assert seen[0] == (8, len(PROMPT) - 8)
    assert seen[-2] == (8, len(PROMPT) - 8 + 2)  # each decode step appends on the host tier
    assert seen[-1] == (0, 0)  # the finished sequence has freed its blocks


@pytest.mark.parametrize("stream_tokens", [4, 8, 12, 1000])
@pytest.mark.parametrize("gpu_tokens", [0, 5])
def test_streamed_host_kv_gives_single_tier_tokens(folder, single, gpu_tokens, stream_tokens):
    """The device attends over the host tier's first blocks (copied up each step), the CPU over
    the rest, merged with the device tier: same tokens and logits as one tier."""
    e = _engine(folder, kv_dtype="f32", gpu_kv_tokens=gpu_tokens, stream_tokens=stream_tokens)
    tokens, streamed = [], []
    for c in e.generate(PROMPT, max_new_tokens=24, temperature=0.0):
        tokens.append(c.token)
        streamed.append(len(e.runner.streamer.blocks))
    assert tokens == single[0]
    # at most the plan's share, and never the host tier's last block (it takes the new token)
    host_blocks = -(-(len(PROMPT) + 23 - gpu_tokens) // 4)  # at the last step, the new token included
    assert max(streamed) == min(stream_tokens // 4, host_blocks - 1)


@pytest.mark.parametrize("kv", ["bf16", "int8", "int4"])
def test_streamed_quantized_host_kv_matches_cpu_attention(tiny, kv):
    """Streamed blocks are dequantized on the device: logits agree with the CPU kernels' within
    the bf16 staging's rounding."""
    folder = tiny("llama_hd32")[0]
    prompt = PROMPT * 3
    want = [c.token for c in _engine(folder, kv_dtype=kv).generate(prompt, max_new_tokens=16, temperature=0.0)]
    e = _engine(folder, kv_dtype=kv, stream_tokens=32)
    got = [c.token for c in e.generate(prompt, max_new_tokens=16, temperature=0.0)]
    assert got == want
    assert len(e.runner.streamer.blocks) == 8


@pytest.mark.parametrize("kv,gpu_tokens", [("f32", 0), ("f32", 6), ("int8", 0), ("int4", 4)])
@pytest.mark.parametrize("sub_batches", [1, 2])
def test_streamed_host_kv_of_a_batch_gives_unstreamed_tokens(tiny, kv, gpu_tokens, sub_batches):
    """A batch of sequences of different lengths in one sub-batch or two: each row's first host
    blocks are streamed (up to the plan's share a row; the second sub-batch's rows from the staging's
    middle row on), the CPU attends over the rest of each row: the tokens of the same batch without
    streaming."""
    folder = tiny("llama_hd32")[0]
    prompts = [PROMPT * 2, PROMPT[:7], PROMPT[3:] * 3, [5, 6, 7]]
    kw = dict(kv_dtype=kv, gpu_kv_tokens=gpu_tokens, sub_batches=sub_batches, parallel=4)
    out, rows = [], []
    for stream in (0, 12):
        e = _engine(folder, stream_tokens=stream, **kw)
        toks = [[] for _ in prompts]
        for c in e.generate(prompts, max_new_tokens=12, temperature=0.0):
            toks[c.index].append(c.token)
            if stream:
                rows.append((e.runner.streamer.lens > 0).tolist())
        out.append(toks)
    assert out[0] == out[1]
    assert max(map(sum, rows)) >= 3  # several rows streamed in one step
    assert any(r[2] or r[3] for r in rows) and any(r[0] or r[1] for r in rows)  # from both halves of the staging


@pytest.mark.parametrize("kv,BS", [(KVDtype.INT8, 8), (KVDtype.INT8, 6), (KVDtype.INT4, 8), (KVDtype.INT4, 6)])
def test_streamer_attends_like_the_cpu_kernel(kv, BS):
    """The streamer copies the host blocks' bytes up as they are and the device attends over them
    (int8: keys and values stored rotated; int4: keys per channel and block, values rotated), on
    the CPU stand-in: the float64 twin's result over the same complete blocks; int4: a block
    still being filled is refused."""
    gen = torch.Generator().manual_seed(4)
    L, H, D = 2, 2, 64
    host = HostKVPool(L, 6, H, BS, D, kv)
    n = 3 * BS + 5  # three complete blocks and one being filled
    k = torch.randn(n, H, D, generator=gen) + 3 * torch.randn(D, generator=gen)  # channel offsets
    v = torch.randn(n, H, D, generator=gen)
    blocks = torch.tensor([4, 1, 2, 5])
    slots = blocks[torch.arange(n) // BS] * BS + torch.arange(n) % BS
    for layer in range(L):
        host.write(layer, slots, k * (layer + 1), v)
    sv = KVStreamer(host, 3 * BS, torch.device("cpu"))
    sv.begin([[4, 1, 2]])
    q = torch.randn(1, 3 * H, D, generator=gen)
    for layer in range(L):
        sv.prefetch(layer)
        o, lse = sv.attend(layer, q, 1 / math.sqrt(D))
        ro, rl = decode_attention_ref(host, layer, q, blocks[None, :3].int(), torch.tensor([3 * BS]), 1 / math.sqrt(D))
        assert rel_err(o, ro) < 1e-2 and (lse - rl).abs().max() < 5e-2
    if kv is KVDtype.INT4:
        with pytest.raises(ValueError, match="being filled"):
            sv.begin([[4, 5]])


def test_two_sub_batches_stream_into_fixed_staging_rows():
    """Two sub-batches' rows go to staging rows 0.. and half.. (the rows each one's captured
    attention reads), every row's length set, padding rows empty; sizes that do not fit stream
    nothing; each sub-batch's host tables lose exactly the streamed blocks."""
    host = HostKVPool(1, 40, 2, 4, 32, KVDtype.INT8)
    sv = KVStreamer(host, 8, torch.device("cpu"), max_rows=5)  # up to 2 blocks a row
    assert sv.half == 3 and sv.first_rows([2, 2]) == [0, 3] and sv.first_rows([3, 2]) == [0, 3]
    assert sv.first_rows([4, 1]) is None and sv.first_rows([3, 3]) is None and sv.first_rows([5]) == [0]
    a = [[0, 1, 2, 3], [4]]  # row 0: three full blocks before its last; row 1: only its last
    b = [[5, 6], [7, 8, 9]]
    tables = [(torch.tensor([[0, 1, 2, 3], [4, 0, 0, 0]], dtype=torch.int32), torch.tensor([15, 2])),
              (torch.tensor([[5, 6, 0], [7, 8, 9]], dtype=torch.int32), torch.tensor([5, 10]))]
    got = sv.take([(a, tables[0]), (b, tables[1])], [0, 3])
    assert sv.lens.tolist() == [8, 0, 0, 4, 8]  # 2 blocks; none; padding; 1; 2 (4 tokens a block)
    assert sv.blocks == [0, 1, 5, 7, 8]
    (bt0, n0), (bt1, n1) = got
    assert n0.tolist() == [7, 2] and bt0[0, :2].tolist() == [2, 3] and bt0[1, 0] == 4
    assert n1.tolist() == [1, 2] and bt1[0, 0] == 6 and bt1[1, 0] == 9
    assert sv.take([None, (b, tables[1])], [0, 3])[0] is None and sv.lens.tolist() == [0, 0, 0, 4, 8]


@pytest.mark.parametrize("kv", [KVDtype.BF16, KVDtype.INT8, KVDtype.INT4])
def test_swap_in_copies_what_the_host_tier_reads(kv):
    """Blocks swapped in from a quantized host tier hold what the host's own readers dequantize
    (int4: keys per channel and block, values rotated back), rounded to the device dtype; the
    sequence's partly filled last block stays on the host."""
    cfg = dataclasses.replace(LLAMA3_8B, num_layers=2)
    BS = 4
    cache = TieredKVCache(cfg, host_tokens=64, gpu_tokens=64, host_dtype=kv, gpu_tokens_per_seq=0, block_size=BS)
    gen = torch.Generator().manual_seed(6)
    n = 3 * BS + 2
    slots = cache.reserve(0, n)
    for layer in range(cfg.num_layers):
        k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen) + 2 * torch.randn(cfg.head_dim, generator=gen)
        cache.write(layer, slots, k, torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen))
    host_blocks = list(cache.seqs[0].host.blocks)
    want = [cache.host.gather(layer, torch.tensor(host_blocks[:3]), 3 * BS) for layer in range(cfg.num_layers)]
    assert cache.swap_in(0, 10) == 3
    gpu_blocks = cache.seqs[0].gpu.blocks
    for layer, (k, v) in enumerate(want):  # [Hkv, 3 * BS, D]
        gk, gv = cache.gpu.gather(layer, torch.tensor([gpu_blocks]))  # [1, Hkv, 3 * BS, D]
        assert torch.equal(gk[0], k.to(torch.bfloat16)) and torch.equal(gv[0], v.to(torch.bfloat16))
    assert cache.seqs[0].host.blocks == host_blocks[3:]


def test_int4_tails_go_back_with_their_blocks(tiny):
    """Sequences finished mid-block free their int4 tails along with their host blocks."""
    e = _engine(tiny("llama_hd32")[0], kv_dtype="int4")
    list(e.generate([PROMPT, PROMPT[:7]], max_new_tokens=6, temperature=0.0))
    t = e.cache.host.tails
    assert t.k.shape[0] > 0 and int(t.n_free[0]) == t.k.shape[0]
    assert bool((t.slot < 0).all())


@pytest.mark.parametrize("kv", ["bf16", "int8", "int4"])
def test_split_with_quantized_host_tier_logits_within_tolerance(tiny, kv):  # noqa: D103
    folder = tiny("llama_hd32")[0]
    want = _engine(folder, kv_dtype="f32").logits(PROMPT)
    tol = {"bf16": 1e-2, "int8": 3e-2, "int4": 1.5e-1}[kv]
    e = _engine(folder, kv_dtype=kv, gpu_kv_tokens=8)
    assert rel_err(e.logits(PROMPT), want) <= tol
    # decode reads the quantized tier too: compare the logits of a continuation
    list(e.generate(PROMPT, max_new_tokens=1, temperature=0.0))


def test_swap_history_changes_no_token(folder, single):
    """A device tier too small for two sequences: the second's growth swaps the first's blocks out;
    swapping them back in mid-generation changes nothing either."""
    ref = _engine(folder, kv_dtype="f32")
    prompts = [PROMPT, PROMPT[::-1]]
    want = [[], []]
    for c in ref.generate(prompts, max_new_tokens=16, temperature=0.0):
        want[c.index].append(c.token)

    e = hetero.load(folder, device="cpu", weights="f32", tokenizer=False, block_size=4, kv_dtype="f32",
                    gpu_kv_tokens=24, parallel=1)  # device pool: 24 tokens for both sequences
    got = [[], []]
    swapped_in = False
    for c in e.generate(prompts, max_new_tokens=16, temperature=0.0):
        got[c.index].append(c.token)
        if e.cache.swapped_out_blocks and not swapped_in:
            seq = next(iter(e.cache.seqs))
            e.cache.swap_out(seq, 2)
            e.cache.swap_in(seq, 1)
            swapped_in = True
    assert e.cache.swapped_out_blocks > 0 and e.cache.swapped_in_blocks > 0
    assert got == want


def test_two_sub_batches_match_one(folder):
    prompts = [PROMPT, PROMPT[:7], PROMPT[5:], [5, 6, 7]]
    out = {}
    for sb in (1, 2):
        e = _engine(folder, kv_dtype="f32", gpu_kv_tokens=6, sub_batches=sb)
        toks = [[] for _ in prompts]
        for c in e.generate(prompts, max_new_tokens=10, temperature=0.0):
            toks[c.index].append(c.token)
        out[sb] = toks
    assert out[1] == out[2]


def test_metrics_count_tokens_and_tiers(folder):
    e = _engine(folder, kv_dtype="bf16", gpu_kv_tokens=8)
    list(e.generate(PROMPT, max_new_tokens=6, temperature=0.0))
    m = e.metrics
    assert m.steps == 5 and m.total.tokens == 5  # the first token came from the prefill
    assert m.total.cpu_attention > 0 and m.total.wall >= m.total.cpu_attention


def test_tier_table_moves_whole_blocks():
    t = TierTable(block_size=4, num_tokens=10, blocks=[7, 8, 9])
    assert t.take_full_blocks(5) == [7, 8] and t.num_tokens == 2 and t.blocks == [9]
    t.add_full_blocks([1])
    assert t.blocks == [1, 9] and t.num_tokens == 6
    assert t.slots(5, 1) == [9 * 4 + 1]


@pytest.mark.parametrize("gpu_tokens, prior_piece", [(5, 4096), (5, 4), (13, 4)])
def test_prefill_in_pieces_matches_one_pass(folder, single, monkeypatch, gpu_tokens, prior_piece):
    """A long prompt is prefilled piece by piece, each attending to the tiers' earlier tokens (each
    tier's read back a block at a time where prior_piece is one block)."""
    import offload.prefill

    monkeypatch.setattr(offload.prefill, "PREFILL_PIECE", 7)
    monkeypatch.setattr(offload.prefill, "PRIOR_PIECE", prior_piece)
    e = _engine(folder, kv_dtype="f32", gpu_kv_tokens=gpu_tokens)
    assert rel_err(e.logits(PROMPT), single[1]) <= 1e-5
    assert _greedy(e) == single[0]


LONG = [(7 * i + 3) % 160 for i in range(480)]  # finishes first: it reaches the context (512) after 32 tokens


def test_swapped_blocks_come_back_when_room_frees(folder):
    """Three sequences share a device tier sized for two: the third's prefill swaps blocks out; when
    the long one finishes (it reaches the context), the next step swaps them back in by itself.
    The tokens are the single-tier run's."""
    prompts = [PROMPT, PROMPT[::-1], LONG]
    want = [[] for _ in prompts]
    for c in _engine(folder, kv_dtype="f32").generate(prompts, max_new_tokens=40, temperature=0.0):
        want[c.index].append(c.token)

    e = _engine(folder, kv_dtype="f32", gpu_kv_tokens=24, parallel=2)  # device tier: 48 tokens
    got = [[] for _ in prompts]
    at_finish = None
    for c in e.generate(prompts, max_new_tokens=40, temperature=0.0):
        got[c.index].append(c.token)
        if c.index == 2 and c.finish_reason:
            at_finish = (e.cache.swapped_out_blocks, e.cache.swapped_in_blocks, len(got[0]))
    assert got == want
    assert len(got[2]) == 32 and len(got[0]) == 40
    out_before, in_before, step = at_finish
    assert out_before > 0 and in_before == 0  # nothing came back while the device tier was full
    assert e.cache.swapped_in_blocks > 0 and e.metrics.swapped_in_blocks == e.cache.swapped_in_blocks
    assert step < 40


def test_swap_in_keeps_the_plans_host_blocks(folder):
    """Only blocks a swap took off the device come back, and never past what the next step needs."""
    e = _engine(folder, kv_dtype="f32", gpu_kv_tokens=8, parallel=2)  # device tier: 16 tokens, 4 blocks
    c = e.cache
    c.reserve(0, 20)  # 8 on the device (the plan's share), 12 on the host by plan
    assert c.swap_in_free_room() == 0 and c.seqs[0].host.num_tokens == 12
    c.reserve(1, 8)
    c.reserve(2, 8)  # the device tier is full: 2 blocks of sequence 0 (the largest) swap out
    assert c.seqs[0].swapped == 2 and c.seqs[0].gpu.num_tokens == 0
    c.free(1)  # 2 device blocks free again
    assert c.swap_in_free_room(keep_free=1) == 1  # the next step needs one of them
    assert c.swap_in_free_room() == 1 and c.seqs[0].swapped == 0
    assert c.seqs[0].gpu.num_tokens == 8 and c.seqs[0].host.num_tokens == 12  # the plan's split again
    assert c.swap_in_free_room() == 0


def test_the_worker_keeps_one_openmp_pool_live_where_the_kernels_move():
    """A thread's pool counts beside the kernel thread's and makes its regions wake sleeping workers
    (cpu_attention._numba): the worker frees the pool of the thread the kernels leave."""
    import os

    import numba
    import numpy as np

    from cpu_attention import _numba
    from offload.worker import ELSEWHERE, MAIN, WORKER, CpuWorker

    _numba.configure()

    @numba.njit(parallel=True, cache=False)
    def touch(a):
        for i in numba.prange(a.shape[0]):
            a[i] += 1.0

    def region():
        numba.set_num_threads(2)
        touch(np.zeros(64))

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread: no pool")
    region()
    if numba.threading_layer() != "omp":
        pytest.skip("not the OpenMP threading layer")
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    w = CpuWorker()
    try:
        w.kernels_on(WORKER)  # frees the main thread's pool
        base = threads()
        w.submit(region).wait()
        assert threads() == base + 2  # the worker thread and its pool's second thread
        w.kernels_on(WORKER)
        assert threads() == base + 2  # staying put frees nothing
        w.kernels_on(MAIN)
        assert threads() == base + 1
        region()
        assert threads() == base + 2
        w.kernels_on(ELSEWHERE)
        assert threads() == base + 1
        assert not _numba.release_pool() or threads() == base + 1  # nothing left to free here
    finally:
        w.close()
