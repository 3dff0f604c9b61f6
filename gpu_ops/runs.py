"""Runs of rows in a decode batch: a speculative step's rows of one sequence (offload/rows.py), which
the GPU's attention kernels attend together (`gpu_ops.attention_triton`'s module doc)."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class RunRows:
    """Runs of a decode batch (a speculative step's rows of one sequence: offload/rows.py): codes
    [B] int32 on the attention's device (`run_codes`) and the longest run, `most`. The Triton
    kernels attend several rows of a run in one program, reading each KV block once for them;
    the torch path attends row by row (the same result)."""

    codes: torch.Tensor
    most: int


def run_codes(sizes: list[int]) -> list[int]:
    """The rows of runs of `sizes` rows each, in batch order → a code a row: its offset j in its run
    << 16 | the run's rows (a lone row: 1)."""
    return [j << 16 | n for n in sizes for j in range(n)]


ROWS = 16  # query rows a GPU attention program takes: the tensor cores' least, the quantized kernels' most


def programs_per_run(rows: int, G: int) -> int:
    """The GPU attention programs (each a read of the KV) a run of `rows` rows takes at G query
    heads a KV head: a program holds ROWS // G of its rows (one row where G ≥ ROWS)."""
    return -(-rows // max(1, ROWS // G))


def run_bucket(most: int) -> int:
    """The longest run's rows rounded up to a power of two: a captured graph per bucket."""
    return 1 << (most - 1).bit_length()
