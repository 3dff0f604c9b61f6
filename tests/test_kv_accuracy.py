"""End to end on the real SmolLM2: quantized host KV keeps the greedy choice (issue 3).

Teacher-forced through the decode path (every step attends over the cache as stored), over a
fixed text of 256+ tokens, int8 weights (the CPU default).
"""
import pytest
import torch

import hetero
from hetero.evaluate import perplexity, teacher_forced_logits
from kv_text import TEXT


@pytest.fixture(scope="module")
def scored():
    out = {}
    for kv in ("bf16", "int8", "int4"):
        e = hetero.load(kv_dtype=kv)
        ids = e.tok.encode(TEXT)[:260]
        assert len(ids) >= 256
        out[kv] = teacher_forced_logits(e, ids), ids
    return out


# Logits by which bf16 KV's own best may beat int8 KV's choice and still count as the same
# greedy choice: a tie the reference cannot settle. Scaling the attention outputs by 1 + 1e-6
# noise alone moves these logits by up to 0.06 (int8 weights quantize the activations, so tiny
# changes flip their rounding) and changes 1-3 of the 259 exact argmax matches between int8 and
# bf16 KV (measured on the 2-core CI machine); so does a new summation order in the bf16 kernel.
# The flips sit at gaps of 0.05-0.12, while the distributions stay as close as before (KL of
# int8 from bf16 KV 5.5e-4 to 6.1e-4 in every such variant).
TIE = 0.1


def test_int8_kv_keeps_the_greedy_choice(scored):
    ref, ids = scored["bf16"]
    got, _ = scored["int8"]
    pick = got.argmax(-1)
    gap = ref.max(-1).values - ref.gather(-1, pick[:, None])[:, 0]  # bf16's best minus bf16's logit of int8's pick
    assert float((gap <= TIE).float().mean()) >= 0.99
    assert perplexity(got, ids) < 1.02 * perplexity(ref, ids)


def test_int4_kv_keeps_the_greedy_choice(scored):
    """int4: values rotated, per token and group of 32; keys per channel and block; the block
    being filled in bf16 (cpu_attention/int4.py). Measured 0.973-0.985 here over three
    rotation seeds."""
    ref, ids = scored["bf16"]
    got, _ = scored["int4"]
    assert float((ref.argmax(-1) == got.argmax(-1)).float().mean()) >= 0.95
    assert perplexity(got, ids) < 1.02 * perplexity(ref, ids)


def test_teacher_forced_matches_a_single_prefill():
    """The decode path and the prefill path agree at full precision."""
    e = hetero.load(kv_dtype="f32", weights="f32")
    ids = e.tok.encode(TEXT)[:40]
    a = teacher_forced_logits(e, ids)
    b = e.logits(ids)[:-1]
    assert torch.allclose(a, b, rtol=1e-3, atol=1e-3)
