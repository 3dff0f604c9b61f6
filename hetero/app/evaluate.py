"""Teacher-forced scoring through the decode path: every position's logits come from attention
over the KV cache as stored (quantized when the host tier is int8/int4), one token a step."""
from __future__ import annotations

import math

import torch

from hetero.app.engine import Engine


@torch.inference_mode()
def teacher_forced_logits(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits [len - 1, V]: row t predicts token t + 1 after tokens[: t + 1] went through decode."""
    seq = -1 - len(engine.cache.seqs)  # an id no generated sequence uses
    try:
        rows = [engine.runner.prefill(seq, token_ids[:1], 0).cpu()]
        for t in range(1, len(token_ids) - 1):
            rows.append(engine.runner.decode([seq], [token_ids[t]], [t]).cpu())
        return torch.cat(rows)
    finally:
        engine.cache.free(seq)


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(token_ids[1: 1 + logits.shape[0]]))
    return math.exp(float(nll))
