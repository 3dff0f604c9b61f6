"""Quantized host KV on the real SmolLM2: argmax agreement with bf16 KV and perplexity per dtype.

    python3 -m bench.kv_accuracy [--dtypes bf16,int8,int4] [--tokens N]

Teacher-forced through the decode path over tests/kv_text.py's text (every step attends over
the cache as stored), int8 weights. Reports; asserts nothing (tests/test_kv_accuracy.py does).
"""
import argparse
import time

import hetero
from hetero.app.evaluate import perplexity, teacher_forced_logits
from tests.kv_text import TEXT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bf16,int8,int4", help="comma-separated host KV dtypes (bf16 first: the reference)")
    ap.add_argument("--tokens", type=int, default=None, help="score only the text's first N tokens (default: all)")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    if dtypes[0] != "bf16":
        dtypes = ["bf16", *(d for d in dtypes if d != "bf16")]
    res, secs = {}, {}
    for kv in dtypes:
        e = hetero.load(kv_dtype=kv)
        ids = e.tok.encode(TEXT)[: args.tokens]
        t0 = time.perf_counter()
        res[kv] = teacher_forced_logits(e, ids)
        secs[kv] = time.perf_counter() - t0
    print(f"{len(ids)} tokens, teacher-forced decode, SmolLM2-135M-Instruct (int8 weights)")
    print(f"{'KV':6} {'argmax = bf16':>14} {'perplexity':>11} {'seconds':>8}")
    for kv, logits in res.items():
        agree = float((logits.argmax(-1) == res["bf16"].argmax(-1)).float().mean())
        print(f"{kv:6} {agree:14.4f} {perplexity(logits, ids):11.2f} {secs[kv]:8.1f}")


if __name__ == "__main__":
    main()
