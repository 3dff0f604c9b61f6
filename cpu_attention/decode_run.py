"""Decode attention for a run of one sequence's rows: the KV before the run read once for all of them.

A speculative step verifies a sequence's last token and k drafts as k + 1 rows at consecutive
positions (offload/rows.py); row r attends to the n tokens before the run and to the run's own
tokens 0..r. Attending row by row would read the n tokens k + 1 times. Here the rows become extra
query heads of one row, as GQA's heads are (query head (r, h, g) of kv head h), so the kernels'
grouping reads each KV byte of the n tokens once for all of them; the run's own tokens (k + 1 at
most, read back from the pool as stored) are attended causally in a small float32 product, and the
two parts are merged by their log-sum-exp. The kernels take any number of heads per kv head, so
nothing in them changes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from cpu_attention.merge import merge_attention
from cpu_attention.pool import HostKVPool

if TYPE_CHECKING:
    from cpu_attention.decode import DecodeWork


def run_rows(bt: np.ndarray, lens: np.ndarray) -> int:
    """R ≥ 2 when the B = R rows are one run (one block table, lengths n + 1, n + 2, ...), else 0."""
    B = len(lens)
    if B < 2 or lens[0] < 1 or not np.array_equal(lens - lens[0], np.arange(B)):
        return 0
    return B if (bt == bt[:1]).all() else 0


def attend_run(work: DecodeWork, pool: HostKVPool, layer: int, q: np.ndarray, scale: float, on: np.ndarray,
               ln: np.ndarray) -> None:
    """`DecodeWork.run` for a run (module doc): q [R, Hq, D] → on [R, Hq, D], ln [R, Hq]."""
    R, Hq, D = q.shape
    Hkv = pool.num_kv_heads
    G = Hq // Hkv
    prior = int(work.lens[0]) - 1  # tokens before the run
    heads = torch.from_numpy(q).view(R, Hkv, G, D)
    if prior:
        qg = np.ascontiguousarray(q.reshape(R, Hkv, G, D).transpose(1, 0, 2, 3)).reshape(1, Hkv * R * G, D)
        o1, l1 = np.empty_like(qg), np.empty((1, Hkv * R * G), np.float32)
        work.kernel(pool, layer, qg, scale, o1, l1)
        o_prior = torch.from_numpy(o1).view(Hkv, R, G, D).transpose(0, 1)  # [R, Hkv, G, D]
        lse_prior = torch.from_numpy(l1).view(Hkv, R, G).transpose(0, 1)
    # the run's own tokens, as the pool holds them: positions prior .. prior + R - 1
    BS = pool.block_size
    first = prior // BS
    table = torch.from_numpy(work.bt[0, first: (prior + R - 1) // BS + 1].astype(np.int64))
    k, v = pool.gather(layer, table, prior + R - first * BS)
    k, v = k[:, -R:].float(), v[:, -R:].float()  # [Hkv, R, D]
    s = torch.einsum("rhgd,htd->rhgt", heads, k) * scale  # [R rows, Hkv, G, R tokens]
    causal = torch.ones(R, R, dtype=torch.bool).tril()  # row r sees the run's tokens 0..r
    s = s.masked_fill(~causal[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("rhgt,htd->rhgd", torch.exp(s - lse[..., None]), v)
    if prior:
        o, lse = merge_attention(o_prior, lse_prior, o, lse)
    torch.from_numpy(on).view(R, Hkv, G, D).copy_(o)
    torch.from_numpy(ln).view(R, Hkv, G).copy_(lse)
