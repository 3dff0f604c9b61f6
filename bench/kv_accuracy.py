"""Quantized host KV on the real SmolLM2: argmax agreement with bf16 KV and perplexity per dtype.

    python bench/kv_accuracy.py

Teacher-forced through the decode path over tests/kv_text.py's text (every step attends over
the cache as stored), int8 weights.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import hetero  # noqa: E402
from hetero.evaluate import perplexity, teacher_forced_logits  # noqa: E402
from kv_text import TEXT  # noqa: E402

res = {}
for kv in ("bf16", "int8", "int4"):
    e = hetero.load(kv_dtype=kv)
    ids = e.tok.encode(TEXT)
    res[kv] = teacher_forced_logits(e, ids)
print(f"{len(ids)} tokens, teacher-forced decode, SmolLM2-135M-Instruct (int8 weights)")
print(f"{'KV':6} {'argmax = bf16':>14} {'perplexity':>11}")
for kv, logits in res.items():
    agree = float((logits.argmax(-1) == res["bf16"].argmax(-1)).float().mean())
    print(f"{kv:6} {agree:14.4f} {perplexity(logits, ids):11.2f}")
