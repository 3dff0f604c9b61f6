"""Speculative decoding at long context, as a user gets it: the planner's own placement.

    python3 -m bench.speculative [--ctx 32768] [--gpu-mem 6GiB] [--steps 48] [--drafts off,3/4,0/4,ngram]
    python3 -m bench.speculative --shape smollm2-135m --device cpu --ctx 2048   # a quick check anywhere

Random weights of a real shape (default Llama-3-8B) built in memory, `hetero.load(model,
gpu_mem=B, ctx_size=C, parallel=1, draft=...)` and nothing else; the KV cache filled to the
context with random codes (attention's speed does not depend on the values, and a prefill of
32k tokens would take longer than the decode being measured), then decode steps through the
engine's scheduler, as `hetero chat --draft` runs them. Random weights draft nothing useful, so
the acceptance is fed in: "A/K" drafts K tokens a step and its verification keeps A of them
(`hetero.speculative.FedAcceptance`: the rows, their KV and the rollback are the real work);
"ngram" is the real prompt-lookup drafter, which over random tokens finds little: what drafting
costs when nothing is kept. Prints tok/s per mode with the plain run's figure and, for A/K, the
bound: A + 1 tokens a step at a plain step's cost.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts
import torch  # noqa: E402

from bench.budget import fill  # noqa: E402
from hetero.app.bench import parse_draft  # noqa: E402
from hetero.app.scheduler import Scheduler  # noqa: E402
from planner.units import parse_size  # noqa: E402


def run(engine, mode: str, n0: int, steps: int, prompt: list[int]) -> dict:
    """`steps` tokens decoded after a context of n0 random-code tokens → tok/s, acceptance, tokens."""
    engine.drafter = parse_draft(mode, engine.cfg.vocab_size)
    sched = Scheduler(engine)
    s = engine.sequence(prompt, ignore_eos=True, max_new_tokens=steps + 1, temperature=0.0)
    torch.manual_seed(0)  # the same KV values for every mode
    fill(engine.cache, [s.id], n0 - 1)  # the prompt's tokens but its last: its KV
    sched.running.append(s)  # the prompt is "prefilled": the next step decodes
    if engine.runner.cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    while not sched.idle:
        sched.step()
    if engine.runner.cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    engine.cache.free(s.id)
    st = sched.stats
    return dict(mode=mode, tok_s=len(s.generated) / wall, tokens=len(s.generated), seconds=wall,
                drafted=st.drafted, kept=st.accepted, acceptance=st.acceptance)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--gpu-mem", default="6GiB")
    ap.add_argument("--steps", type=int, default=48, help="tokens generated a run")
    ap.add_argument("--drafts", default="off,3/4,0/4,ngram")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import hetero
    from hetero.random_weights import RandomCheckpoint, random_shape

    cfg = random_shape(a.shape)
    engine = hetero.load(RandomCheckpoint(cfg, a.device), device=a.device, ctx_size=a.ctx, parallel=1,
                         gpu_mem=parse_size(a.gpu_mem) if a.device == "cuda" else None)
    print(f"plan: {engine.info['plan']}")
    n0 = a.ctx - a.steps - 16
    prompt = torch.randint(0, engine.cfg.vocab_size, (n0,), generator=torch.Generator().manual_seed(1)).tolist()
    modes = a.drafts.split(",")
    for mode in modes:  # warm-up: compiles, graph captures of each run length
        run(engine, mode, n0, 12, prompt)
    results: dict[str, list[dict]] = {}
    for rep in range(a.reps):
        for mode in modes:
            r = run(engine, mode, n0, a.steps, prompt)
            results.setdefault(mode, []).append(r)
            print(f"rep {rep} {mode:6} {r['tok_s']:8.1f} tok/s  {r['tokens']} tokens in {r['seconds']:.2f} s, "
                  f"drafts kept {r['kept']}/{r['drafted']}", flush=True)
    plain = max(r["tok_s"] for r in results.get("off", [])) if "off" in results else None
    print(f"\n{a.shape} at {a.ctx} context, --gpu-mem {a.gpu_mem}, {a.device}: best of {a.reps}")
    print(f"{'draft':8} {'tok/s':>8} {'vs plain':>9} {'kept':>6} {'bound':>8}")
    for mode, rs in results.items():
        best = max(rs, key=lambda r: r["tok_s"])
        ratio = f"{best['tok_s'] / plain:8.2f}x" if plain else ""
        bound = ""
        if "/" in mode and plain:  # A + 1 tokens a step, each step at the plain step's cost at best
            kept = int(mode.split("/")[0])
            bound = f"{plain * (kept + 1):8.1f}"
        print(f"{mode:8} {best['tok_s']:8.1f} {ratio:>9} {best['acceptance']:6.0%} {bound:>8}")
    if a.out:
        a.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
