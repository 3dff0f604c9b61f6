"""What choosing a token costs the host: the sampler a token, and the demo model's chat with it.

    python3 -m bench.sampling [--vocab 49152,128256,151936] [--tokens 128] [--reps 3]

Per vocabulary size and sampling setting: milliseconds a token of `hetero.sampling.Sampler` on
random logits (the median of 50 calls after 3), the host's share of every decode step. Then the
demo model (SmolLM2-135M, 49k vocabulary) answering one chat message with the chat's default
sampling (`hetero chat`'s path, `Engine.chat`), decode tok/s, best of --reps after a warm-up.
Bound for the sampler: nothing (the step's other work is the figure it adds to); for the chat:
the same chat greedy (the argmax, the least a token's choice can cost).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hetero.sampling import Sampler, SamplingParams

SETTINGS = {
    "greedy": SamplingParams(),
    "chat defaults": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "temperature 1": SamplingParams(temperature=1.0),
    "top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
}


def sampler_ms(vocab: int, params: SamplingParams) -> float:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 4  # a peaked row, as models give
    s, history = Sampler(params.update(seed=0)), list(range(64))
    for _ in range(3):
        s(logits, history)
    times = []
    for _ in range(50):
        t = time.perf_counter()
        s(logits, history)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def chat_tok_s(engine, params: SamplingParams, tokens: int, reps: int) -> float:
    msgs = [{"role": "user", "content": "Write a story about a lighthouse keeper who finds a message in a bottle."}]
    rates = []
    for _ in range(reps + 1):  # the first warms the kernels
        for _ in engine.chat(msgs, max_new_tokens=tokens, temperature=params.temperature, top_k=params.top_k,
                             top_p=params.top_p, min_p=params.min_p):
            pass
        rates.append(engine.last_stats.gen_tps)
        engine.reset_chat()
    return max(rates[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="49152,128256,151936")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    vocabs = [int(v) for v in a.vocab.split(",")]
    print(f"sampler, ms a token ({torch.get_num_threads()} threads)")
    print(f"{'setting':14} " + " ".join(f"{v:>9}" for v in vocabs))
    for name, params in SETTINGS.items():
        print(f"{name:14} " + " ".join(f"{sampler_ms(v, params):9.2f}" for v in vocabs), flush=True)
    import hetero

    engine = hetero.load(parallel=1)
    greedy = chat_tok_s(engine, SETTINGS["greedy"], a.tokens, a.reps)
    sampled = chat_tok_s(engine, SETTINGS["chat defaults"], a.tokens, a.reps)
    print(f"\ndemo model chat, {a.tokens} new tokens, best of {a.reps}: chat defaults {sampled:.1f} tok/s "
          f"(bound: greedy {greedy:.1f})")


if __name__ == "__main__":
    main()
