"""Decode attention for a run of one sequence's rows: the KV before the run read once for all of them.

A speculative step verifies a sequence's last token and k drafts as k + 1 rows at consecutive
positions (offload/rows.py); row r attends to the n tokens before the run and to the run's own
tokens 0..r. Attending row by row would read the n tokens k + 1 times. Here the tokens are cut
at the start of the block that holds the run's first token, n0 = n - n % BS:
- the n0 tokens before the cut, which every row sees whole, are attended as one row whose query
  heads are all the run's (query head (r, h, g) of kv head h), as GQA's heads are, so the
  kernels' grouping reads each of their KV bytes once for all the rows;
- the tokens from the cut on (less than a block plus the run) are attended row by row by the same
  kernels, each row to its own length: the causal mask among the run's tokens;
and the two parts merge by their log-sum-exp. Nothing in the kernels changes: they take any
number of heads per kv head, and both parts are ordinary calls.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

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
    work.own.run(pool, layer, q, scale, on, ln)
    if work.shared is None:
        return
    qg = np.ascontiguousarray(q.reshape(R, Hkv, G, D).transpose(1, 0, 2, 3)).reshape(1, Hkv * R * G, D)
    o1, l1 = np.empty_like(qg), np.empty((1, Hkv * R * G), np.float32)
    work.shared.run(pool, layer, qg, scale, o1, l1)
    o1 = o1.reshape(Hkv, R, G, D).transpose(1, 0, 2, 3).reshape(R, Hq, D)
    l1 = l1.reshape(Hkv, R, G).transpose(1, 0, 2).reshape(R, Hq)
    m = np.maximum(l1, ln)  # both parts hold tokens: finite
    w1, w2 = np.exp(l1 - m), np.exp(ln - m)
    total = w1 + w2
    on[...] = (o1 * (w1 / total)[..., None] + on * (w2 / total)[..., None])
    ln[...] = m + np.log(total)
