"""Weight formats on the real SmolLM2: argmax agreement with bf16 weights, KL and perplexity.

    python3 -m bench.weight_accuracy [--weights 4bit,q4,int8] [--tokens N]

Teacher-forced through the decode path over tests/kv_text.py's text, on the CPU (the GPU's 4-bit
formats run there through their torch reference: the same codes the GPU kernels decode), bf16 KV.
The reference is the checkpoint in bf16 (its GGUF Q4_1 codes, dequantized). The weight cache is
bypassed (a temporary folder), so each format is quantized by the code under test. Reports;
asserts nothing.
"""
import argparse
import os
import tempfile
import time

import torch

import hetero
from hetero.app.evaluate import perplexity, teacher_forced_logits
from tests.kv_text import TEXT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="4bit,q4,int8", help="comma-separated --weights values to compare with bf16")
    ap.add_argument("--tokens", type=int, default=300, help="score the text's first N tokens")
    args = ap.parse_args()
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="hetero-weight-accuracy-")
    res, secs, ids = {}, {}, []
    for w in ["bf16", *args.weights.split(",")]:
        e = hetero.load(weights=w, device="cpu", kv_dtype="bf16")
        ids = e.tok.encode(TEXT)[: args.tokens]
        t0 = time.perf_counter()
        res[w] = teacher_forced_logits(e, ids).float()
        secs[w] = time.perf_counter() - t0
    ref = res["bf16"]
    print(f"{len(ids)} tokens, teacher-forced decode, SmolLM2-135M-Instruct (GGUF Q4_1), bf16 KV")
    print(f"{'weights':8} {'argmax = bf16':>14} {'KL(bf16 ‖ w)':>13} {'perplexity':>11} {'seconds':>8}")
    for w, logits in res.items():
        agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        kl = float(torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                              reduction="batchmean"))
        print(f"{w:8} {agree:14.4f} {kl:13.4f} {perplexity(logits, ids):11.2f} {secs[w]:8.1f}")


if __name__ == "__main__":
    main()
