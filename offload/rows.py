"""Runs of rows: a decode step in which one sequence has several consecutive rows.

A speculative step verifies a sequence's last token and the k drafted tokens after it in one
decode step, as k + 1 consecutive rows of that sequence at consecutive positions. Their KV is
reserved and written together, and row j attends to the sequence's earlier tokens and to rows
0..j of its run (`Slots.later_*` tells the tables how many of the run's tokens to hide from it),
so the step's logits are those of k + 1 ordinary steps. Afterwards `rollback` drops the rows the
verification rejected.

Exact rollback: a quantized tier quantizes a block when it is complete, which is lossy, so a
block completed by draft rows and then cut short would no longer hold what it held. `draft_room`
caps the drafts so that they never complete a block of a quantized tier (the device tier's int8
and int4 blocks, the host tier's int4 ones) and a run that completes one with its first row takes
no drafts (it would need a second bf16 tail at once): rows that may be rejected stay in bf16 tails
or in per-token formats (bf16, the host's int8), where dropping them leaves exactly what a run
that never drafted holds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from cpu_attention import KVDtype
from offload.kv_cache import Slots

if TYPE_CHECKING:
    from offload.kv_cache import TieredKVCache


def runs(seqs: list[int]) -> list[tuple[int, int]]:
    """(sequence, rows) for each run of equal consecutive ids."""
    out: list[tuple[int, int]] = []
    for s in seqs:
        if out and out[-1][0] == s:
            out[-1] = (s, out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


def run_sizes(seqs: list[int]) -> list[int] | None:
    """The rows of each run in batch order (`gpu_ops.runs.run_codes`); None when every row is a
    sequence of its own."""
    step = runs(seqs)
    return None if len(step) == len(seqs) else [n for _, n in step]


def reserve(cache: TieredKVCache, seqs: list[int]) -> list[Slots]:
    """Room for one token a row; a run of one sequence's rows is reserved at once, one Slots a row."""
    out: list[Slots] = []
    step = runs(seqs)
    keep = frozenset(s for s, n in step if n > 1)  # a run's blocks stay where its rows go: `rollback`
    for s, n in step:
        sl = cache.reserve(s, n, keep)
        out += _split(sl, n) if n > 1 else [sl]
    return out


def _split(sl: Slots, n: int) -> list[Slots]:
    """A run's reservation → one Slots a row (row 0 of each), with the run's tokens after it on each tier."""
    assert not sl.whole_rows, "a run of rows fills no device block whole"
    rows = [Slots() for _ in range(n)]
    for r, slot in zip(sl.gpu_rows, sl.gpu_slots):
        rows[r].gpu_rows, rows[r].gpu_slots = [0], [slot]
    for r, slot in zip(sl.host_rows, sl.host_slots):
        rows[r].host_rows, rows[r].host_slots = [0], [slot]
    gpu, host = set(sl.gpu_rows), set(sl.host_rows)
    for j, row in enumerate(rows):
        row.later_gpu = sum(1 for r in range(j + 1, n) if r in gpu)
        row.later_host = sum(1 for r in range(j + 1, n) if r in host)
    return rows


def draft_room(cache: TieredKVCache, seq: int, want: int) -> int:
    """How many drafted tokens (≤ want) may follow `seq`'s next token in one step with an exact
    rollback (module doc)."""
    s = cache.seqs.get(seq)
    if s is None or want <= 0:
        return max(0, want)
    bs = cache.block_size
    gpu_q = cache.gpu is not None and cache.gpu.quantized
    host_q = cache.host.dtype is KVDtype.INT4
    if not (gpu_q or host_q):
        return want
    # the rows go to the device tier up to its share, unless it has no room left (then all to the host)
    room = want
    for to_gpu in {max(0, s.gpu_limit - s.gpu.num_tokens), 0}:
        for r in range(room + 1):  # row r of the run: its tier and offset in that tier's block
            on_gpu = r < to_gpu
            quantized = gpu_q if on_gpu else host_q
            at = s.gpu.num_tokens + r if on_gpu else s.host.num_tokens + r - min(to_gpu, r)
            if quantized and at % bs == bs - 1:  # row r completes a quantized block
                room = 0 if r == 0 else r - 1
                break
    return room


def rollback(cache: TieredKVCache, seq: int, n: int) -> None:
    """Drop the last n tokens of `seq`, all written by its latest reservation (the host's rows of
    it first, as that reservation put its last rows there)."""
    s = cache.seqs[seq]
    gpu_new, host_new = s.recent
    assert 0 <= n <= gpu_new + host_new, f"rolling back {n} tokens of a reservation of {gpu_new + host_new}"
    drop_host = min(n, host_new)
    for tier, alloc, d in ((s.host, cache.host_alloc, drop_host), (s.gpu, cache.gpu_alloc, n - drop_host)):
        if not d:
            continue
        tier.num_tokens -= d
        keep = -(-tier.num_tokens // cache.block_size)
        gone, tier.blocks[keep:] = tier.blocks[keep:], []
        alloc.free(gone)
        if tier is s.host:
            cache.host.release(gone)
        else:
            cache._drop_tails(gone)  # a quantized tier's tails go back, and nothing is sealed in them
    s.recent = (gpu_new - (n - drop_host), host_new - drop_host)
