"""Speculative decoding at long context, as a user gets it: the planner's own placement.

    python3 -m bench.speculative [--ctx 32768] [--gpu-mem 6GiB] [--steps 128] [--drafts off,3/4,0/auto,ngram]
    python3 -m bench.speculative --shape smollm2-135m --device cpu --ctx 2048   # a quick check anywhere
    python3 -m bench.speculative --demo      # the demo model, real drafts: a quoting task and free chat
    python3 -m bench.speculative --demo --ngram 3:1,4:1,2:1,3:2   # prompt lookup's n-gram sizes (max:min)

Random weights of a real shape (default Llama-3-8B) built in memory, `hetero.load(model,
gpu_mem=B, ctx_size=C, parallel=1, draft=...)` and nothing else; the KV cache filled to the
context with random codes (attention's speed does not depend on the values, and a prefill of
32k tokens would take longer than the decode being measured), then decode steps through the
engine's scheduler, as `hetero chat --draft` runs them. Random weights draft nothing useful, so
the acceptance is fed in: "A/K" drafts K tokens a step and its verification keeps A of them
(`hetero.speculative.FedAcceptance`: the rows, their KV and the rollback are the real work);
"0/auto" drafts as many as the engine's adaptive length chooses and keeps none: what drafting
costs when nothing is kept; "ngram" is the real prompt-lookup drafter, which over random tokens
finds little to draft. Prints tok/s per mode with the plain run's figure and, for A/K, the
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

from bench.budget import fill, host_profile, trace  # noqa: E402
from hetero.app.bench import parse_draft  # noqa: E402
from hetero.app.scheduler import Scheduler  # noqa: E402
from planner.units import parse_size  # noqa: E402


def run(engine, mode: str, n0: int, steps: int, prompt: list[int], trace_to: Path | None = None) -> dict:
    """`steps` tokens decoded after a context of n0 random-code tokens → tok/s, acceptance, tokens;
    with trace_to, the decode's GPU kernels and CPU ops written there (`bench.budget.trace`)."""
    engine.drafter = parse_draft(mode, engine.cfg.vocab_size)
    sched = Scheduler(engine)
    s = engine.sequence(prompt, ignore_eos=True, max_new_tokens=steps + 1, temperature=0.0)
    torch.manual_seed(0)  # the same KV values for every mode
    fill(engine.cache, [s.id], n0 - 1)  # the prompt's tokens but its last: its KV
    sched.running.append(s)  # the prompt is "prefilled": the next step decodes
    if engine.runner.cuda:
        torch.cuda.synchronize()

    def decode() -> None:
        while not sched.idle:
            sched.step()

    t = time.perf_counter()
    trace(decode, trace_to) if trace_to is not None else decode()
    if engine.runner.cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    engine.cache.free(s.id)
    st = sched.stats
    return dict(mode=mode, tok_s=len(s.generated) / wall, tokens=len(s.generated), seconds=wall,
                drafted=st.drafted, kept=st.accepted, acceptance=st.acceptance)


DOC = Path(__file__).resolve().parents[1] / "docs" / "design.md"
TASKS = {  # name → (context, question): one whose answer repeats its context, one whose answer is new text
    "quote": ("{doc}", "Copy the first paragraph of the section 'One decode step' above, word for word."),
    "free": ("", "Write a story about a lighthouse keeper who finds a message in a bottle."),
}


def demo(ctx_tokens: int, new_tokens: int, reps: int, ngrams: list[tuple[int, int]]) -> None:
    """The demo model with `--draft ngram` (n-gram sizes max:min each of `ngrams`) and without,
    greedy: the answers must be the same; → decode tok/s, drafts kept, on each task."""
    import hetero
    from hetero.speculative import NgramDrafter

    plain = hetero.load(parallel=1, ctx_size=ctx_tokens + new_tokens + 64)
    spec = hetero.load(parallel=1, ctx_size=ctx_tokens + new_tokens + 64, draft="ngram")
    tok = plain.tok
    doc = tok.decode(tok.encode(DOC.read_text())[: ctx_tokens - 64])

    def best_of(e, msgs):
        rates = []
        for _ in range(reps + 1):  # the first run warms the kernels and the cost estimate
            answer = [c.token for c in e.chat(msgs, max_new_tokens=new_tokens, temperature=0)]
            rates.append(e.last_stats.gen_tps)
            st = e.last_stats
            e.reset_chat()
        return max(rates[1:]), answer, st

    print(f"demo model, CPU, {ctx_tokens}-token budget for the context, {new_tokens} new tokens, greedy, best of {reps}")
    print(f"{'task':6} {'prompt':>7} {'n-grams':>7} {'plain tok/s':>12} {'ngram tok/s':>12} {'speed-up':>9} "
          f"{'kept':>10} same")
    for name, (context, question) in TASKS.items():
        msgs = [{"role": "user", "content": (context.format(doc=doc) + "\n\n" if context else "") + question}]
        p_rate, p_ans, p_st = best_of(plain, msgs)
        for hi, lo in ngrams:
            spec.drafter = NgramDrafter(hi, lo)
            s_rate, s_ans, s_st = best_of(spec, msgs)
            print(f"{name:6} {p_st.prompt_tokens:7d} {f'{hi}:{lo}':>7} {p_rate:12.1f} {s_rate:12.1f} "
                  f"{s_rate / p_rate:8.2f}x {s_st.accepted:4d}/{s_st.drafted:<5d} {'yes' if s_ans == p_ans else 'NO'}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--gpu-mem", default="6GiB")
    ap.add_argument("--steps", type=int, default=128, help="tokens generated a run")
    ap.add_argument("--drafts", default="off,3/4,0/auto,ngram")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--trace", type=Path, help="write each mode's GPU kernels and CPU ops of one more run to TRACE.MODE.txt")
    ap.add_argument("--cprofile", type=Path, help="write the host's Python time of one more run of each mode (cProfile) there")
    ap.add_argument("--demo", action="store_true", help="the demo model with real drafts (TASKS), CPU")
    ap.add_argument("--ngram", default="3:1", help="with --demo: prompt lookup's n-gram sizes max:min, comma-separated")
    a = ap.parse_args()
    if a.demo:
        ngrams = [tuple(int(x) for x in s.split(":")) for s in a.ngram.split(",")]
        demo(ctx_tokens=min(a.ctx, 2048), new_tokens=a.steps * 4, reps=a.reps, ngrams=ngrams)
        return
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
    if a.cprofile:
        host_profile(lambda: [run(engine, m, n0, a.steps, prompt) for m in modes], a.cprofile)
    if a.trace:
        for mode in modes:
            run(engine, mode, n0, a.steps, prompt, trace_to=a.trace.with_suffix(f".{mode.replace('/', 'of')}.txt"))


if __name__ == "__main__":
    main()
