"""Numba decode attention over the paged host KV pool (bf16, int8, int4), flash-decoding style:
`decode_attention`, and the work split its kernels share.

Work split: a work item is (sequence b, kv head h, token range [t0, t1)). Items of one
(b, h) are consecutive; long sequences are cut into several ranges so batch 1 × 32k keeps
every core busy, and each item leaves a partial (acc [G, D], running max m, sum l); the thread
that finishes the last item of a (b, h) merges its partials by log-sum-exp (an atomic count of
finished items per pair), so a call is one parallel region. All G = Hq / Hkv query heads of a
kv head are done together, so each K/V byte is read from DRAM once.

Schedule: a work queue, not Numba's static split. Each of the call's threads allocates its
scratch once, then claims the next unclaimed item (`_numba.claim`, one atomic add) until none
is left, so a thread that runs slow (a busy neighbour, a core that clocks lower, an item whose
blocks come late from DRAM) takes fewer items instead of holding up the call. Against the static
split of the same items (which also allocated each item's scratch), on the GPU host: bf16
1.2–1.3×, int8 1.0–1.2×, int4 1.05–1.2×. The `decode_*_any`
fallbacks (head dims that are not a multiple of the vector width) keep Numba's static split.

The kernels, one module a KV dtype, walk an item a tile of whole blocks at a time with the
steps of `decode_tiles` (scores, online softmax, value accumulation, the merge):
`decode_bf16`, `decode_int8` (integer scores and value sums; K and V are stored rotated, so
q is rotated once a pair as the threads start and the output back as its pair is merged) and
`decode_int4` (integer dot products over the 4-bit codes; V stored rotated). These take q as the
caller has it and do q × scale, the rotations and the merge on their own threads, in one parallel
region (before: Python's q × scale, a serial or parallel rotation of all of q, the kernel, a second
parallel region for the merge, the output's rotation): against that, on the GPU host, bf16 / int8
/ int4 read 1.04 / 1.07 / 1.07 × as fast at 1 × 32k.
Head dims that are not a multiple of the vector width go to the bf16 and int8 modules'
`decode_*_any`, which leave those steps to `DecodeWork.run`.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from cpu_attention import rotation
from cpu_attention._hadamard import rotate_rows, unrotate_rows
from cpu_attention._numba import resolve_threads
from cpu_attention._simd import VEC
from cpu_attention.decode_bf16 import decode_float, decode_float_any
from cpu_attention.decode_int4 import decode_int4
from cpu_attention.decode_run import attend_run, run_rows
from cpu_attention import decode_int8 as int8_mod  # its tile and prefetch settings are read per call
from cpu_attention.decode_tiles import rest_heads
from cpu_attention.pool import HostKVPool
from cpu_attention.layout import KVDtype
from cpu_attention.reference import decode_attention_ref

# equal-sized items per thread: the queue's last items end close together (8 against 4, GPU host: bf16
# 1 × 32k 1.05–1.09× with half-size items, int8 and int4 within ±4%, bench/RESULTS.md)
ITEMS_PER_THREAD = 8
MIN_CHUNK = 256  # tokens; below this the merge and per-item setup start to show
FINAL_PIECES = 4  # the queue's last `threads` items are cut in up to this many, handed out last (`final_wave`)
MIN_PIECE = 1024  # tokens: items are not cut smaller (512-token pieces cost int4 ~4% at 1 × 32k, GPU host)


@numba.njit(nogil=True, cache=True)
def _plan(seq_lens, num_kv_heads, chunk):
    """Work items [NI, 4] = (b, h, t0, t1) and the first item of each (b, h) pair."""
    B = seq_lens.shape[0]
    n_items = 0
    for b in range(B):
        n_items += num_kv_heads * ((seq_lens[b] + chunk - 1) // chunk)
    items = np.empty((n_items, 4), np.int64)
    pair_start = np.empty(B * num_kv_heads + 1, np.int64)
    i = 0
    for b in range(B):
        n = seq_lens[b]
        for h in range(num_kv_heads):
            pair_start[b * num_kv_heads + h] = i
            t0 = 0
            while t0 < n:
                t1 = min(t0 + chunk, n)
                items[i, 0] = b
                items[i, 1] = h
                items[i, 2] = t0
                items[i, 3] = t1
                i += 1
                t0 = t1
    pair_start[B * num_kv_heads] = i
    return items, pair_start


def _numpy(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """t as a C-contiguous numpy array of dtype (no copy when it is one already)."""
    if t.dtype != dtype or not t.is_contiguous() or t.requires_grad:
        t = t.detach().to(dtype).contiguous()
    return t.numpy()


@functools.lru_cache(maxsize=16)
def _work_items(seq_lens: tuple[int, ...], num_kv_heads: int, block_size: int, threads: int):
    """(items, pair_start, order) for these lengths (`_plan`, then `final_wave`), memoized: a decode
    step calls the kernel once per layer with the same lengths. The arrays are shared: read them only."""
    sl = np.array(seq_lens, np.int64)
    items, pair_start = _plan(sl, num_kv_heads, chunk_tokens(sl, num_kv_heads, block_size, threads))
    return final_wave(items, len(pair_start) - 1, num_kv_heads, block_size, threads, FINAL_PIECES)


def final_wave(items: np.ndarray, n_pairs: int, num_kv_heads: int, block_size: int, threads: int, pieces: int):
    """The work queue's order, with a last wave of small items: the last `threads` items are each
    cut into up to `pieces` block-aligned parts of at least MIN_PIECE tokens, which the queue hands
    out after all the others (order: item indices in claim order). With items of equal size a call
    ends when its slowest thread's last item does, up to an item after the others; small last items
    even that out (GPU host, against the queue without, 1 × 32k / 16 × 4k: int8 1.05 / 1.02, int4
    1.00 / 1.03; with pieces down to 512 tokens int4 lost 4% at 1 × 32k, bench/RESULTS.md). Items
    stay grouped by (sequence, kv head), as the merge reads them: → (items, pair_start, order)."""
    NI = items.shape[0]
    cut = NI >= 2 * threads and pieces > 1
    rows, big, small = [], [], []
    for i, (b, h, t0, t1) in enumerate(items.tolist()):
        if not cut or i < NI - threads:
            big.append(len(rows))
            rows.append((b, h, t0, t1))
            continue
        n = max(min(pieces, (t1 - t0) // MIN_PIECE), 1)
        step = -(-(t1 - t0) // (n * block_size)) * block_size
        for u in range(t0, t1, step):
            small.append(len(rows))
            rows.append((b, h, u, min(u + step, t1)))
    out = np.array(rows, np.int64).reshape(-1, 4)
    pair = out[:, 0] * num_kv_heads + out[:, 1]
    pair_start = np.zeros(n_pairs + 1, np.int64)
    np.cumsum(np.bincount(pair, minlength=n_pairs), out=pair_start[1:])
    return out, pair_start, np.array(big + small, np.int64)


def chunk_tokens(seq_lens: np.ndarray, num_kv_heads: int, block_size: int, threads: int) -> int:
    """Token range of one work item: ~ITEMS_PER_THREAD items a thread, block-aligned.

    The chunk is then shrunk (a few steps at most) until the longest sequence splits into equal
    pieces and the item count is a multiple of `threads`, so that on equal threads the work
    queue's rounds end together: 2048 tokens × 3 kv heads on 2 threads as 9 items of ≤ 768
    tokens leave one thread 3584 token-heads and the other 2560; 12 of 512 split evenly."""
    lens = seq_lens.tolist()
    total, longest = sum(lens) * num_kv_heads, max(lens, default=0)
    if longest == 0:
        return block_size
    chunk = max(-(-total // (ITEMS_PER_THREAD * threads)), MIN_CHUNK)
    p0 = max(-(-longest // chunk), 1)  # pieces of the longest sequence
    first = None
    for p in range(p0, p0 + threads):
        c = -(-(-(-longest // p)) // block_size) * block_size  # ceil(longest / p), block-aligned
        if p > p0 and c < MIN_CHUNK:
            break
        first = first or c
        if (num_kv_heads * sum(-(-n // c) for n in lens)) % threads == 0:
            return c
    return first


class DecodeWork:
    """What one decode step's host-tier attention needs besides q, computed once and reused by
    every layer: block tables and lengths as numpy, the work items, the thread count.

    Rows that are one run of a sequence (`decode_run`: its rows share a block table and row r sees
    r more tokens than row 0, as a speculative step's verification does) are attended as one row
    whose query heads are all the run's: the KV before the run is read once for all of them."""

    def __init__(self, pool: HostKVPool, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 threads: int | None = None, runs: bool = True):
        """runs: look for a run of one sequence's rows (False: attend row by row)."""
        self.threads = resolve_threads(threads)
        self.bt = block_tables.detach().to(torch.int32).contiguous().numpy()  # [B, max_blocks]
        self.lens = seq_lens.detach().to(torch.int64).contiguous().numpy()  # [B]
        self.run_rows = run_rows(self.bt, self.lens) if runs else 0  # ≥ 2: the rows are one run
        if self.run_rows:  # the run's two parts, each an ordinary work, cut at its first token's block
            n0 = (int(self.lens[0]) - 1) // pool.block_size * pool.block_size  # (`decode_run`)
            self.shared = DecodeWork(pool, block_tables[:1], torch.tensor([n0]), threads, runs=False) if n0 else None
            self.own = DecodeWork(pool, block_tables[:, n0 // pool.block_size:], seq_lens - n0, threads, runs=False)
            return
        self.items, self.pair_start, self.order = _work_items(
            tuple(self.lens.tolist()), pool.num_kv_heads, pool.block_size, self.threads)

    def run(self, pool: HostKVPool, layer: int, q: np.ndarray, scale: float, on: np.ndarray, ln: np.ndarray,
            scaled: np.ndarray | None = None) -> None:
        """The kernel call itself, numpy in and out: q [B, Hq, D] float32, C-contiguous (left as
        is); on [B, Hq, D], ln [B, Hq] float32 receive the output and the log-sum-exp; scaled: a
        buffer like q for q × scale on the any-shape paths (None: a new one). `decode_attention`
        without its checks and conversions, for a caller that calls it every layer with the same
        buffers."""
        if self.run_rows:
            attend_run(self, pool, layer, q, scale, on, ln)
            return
        resolve_threads(self.threads)  # thread counts are per calling thread in Numba
        if pool.dtype is KVDtype.F32:  # exact pools exist for checks: the twin is enough
            o, lse = decode_attention_ref(pool, layer, torch.from_numpy(q), torch.from_numpy(self.bt),
                                          torch.from_numpy(self.lens), scale)
            on[...], ln[...] = o.numpy(), lse.numpy()
            return
        D, G = q.shape[-1], q.shape[1] // pool.num_kv_heads
        bt, items, pair_start, order, a = self.bt, self.items, self.pair_start, self.order, pool.arrays
        sc = np.float32(scale)
        # the fast kernels take q as it is and write the merged output: q × scale, int8's rotation of q,
        # the merge and the output's rotation back all happen on the kernel's threads
        if pool.dtype is KVDtype.INT4:
            t = pool.tails.arrays
            decode_int4(a["k"][layer], a["v"][layer], a["k_scale"][layer], a["k_zero"][layer], a["v_scale"][layer],
                        a["v_zero"][layer], t["k"], t["v"], t["slot"][layer], q, sc, *rotation.numba_args(D), bt, items,
                        order, pair_start, on, ln, rest_heads(G), self.threads)
        elif pool.dtype is KVDtype.BF16 and D % VEC == 0:
            decode_float(a["k"][layer], a["v"][layer], q, sc, bt, items, order, pair_start, on, ln, rest_heads(G),
                         self.threads)
        elif pool.dtype is KVDtype.INT8 and D % int8_mod.W == 0 and pool.block_size % int8_mod.W == 0:
            int8_mod.decode_int8(a["k"][layer], a["v"][layer], a["k_scale"][layer], a["v_scale"][layer], q, sc,
                                 *rotation.numba_args(D), bt, items, order, pair_start, on, ln, int8_mod.INT8_TILE,
                                 int8_mod.PREFETCH_BLOCKS, rest_heads(G), self.threads,
                                 True if int8_mod.use_tiles(G, D, pool.block_size) else None)
        else:  # the any-shape fallbacks: q scaled (and rotated) before, the output rotated back after
            qn = np.multiply(q, sc, out=scaled)
            if pool.dtype is KVDtype.BF16:
                decode_float_any(a["k"][layer], a["v"][layer], qn, bt, items, pair_start, on, ln)
                return
            rot = rotation.numba_args(D)
            rotate_rows(qn.reshape(-1, D), *rot)
            int8_mod.decode_int8_any(a["k"][layer], a["v"][layer], a["k_scale"][layer], a["v_scale"][layer], qn, bt,
                                     items, pair_start, on, ln)
            unrotate_rows(on.reshape(-1, D), *rot)


def decode_attention(
    pool: HostKVPool,
    layer: int,
    q: torch.Tensor,  # [B, Hq, D]
    block_tables: torch.Tensor | None,  # [B, max_blocks] int32 (None: given by work)
    seq_lens: torch.Tensor | None,  # [B]
    scale: float,
    threads: int | None = None,
    work: DecodeWork | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per sequence over its host-tier tokens → (out [B,Hq,D] f32, lse [B,Hq] f32).

    work: the step's DecodeWork (tables, lengths, threads), so the layers of one step share it;
    out: float32 tensors [B, Hq, D], [B, Hq] to write into (e.g. pinned staging buffers).
    Safe to call from a worker thread: the kernel runs without the GIL.
    """
    B, Hq, D = q.shape
    Hkv = pool.num_kv_heads
    if D != pool.head_dim or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool (Hkv {Hkv}, D {pool.head_dim})")
    # numpy, not torch, between the caller and the kernel: this runs once per layer and
    # decode step, and each small torch op costs microseconds
    if work is None:
        work = DecodeWork(pool, block_tables, seq_lens, threads)
    if out is None:
        out = (torch.empty((B, Hq, D), dtype=torch.float32), torch.empty((B, Hq), dtype=torch.float32))
    work.run(pool, layer, _numpy(q, torch.float32), scale, out[0].numpy(), out[1].numpy())
    return out
