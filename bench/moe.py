"""Mixture-of-experts decode and prefill at a GPU budget, as a user gets them: the planner's own choice.

    python3 -m bench.moe --out DIR [--only NAME,...] [--profile profile.json] [--steps N] [--set KEY=VALUE ...]
                         [--host-alone] [--trace]

Random weights of a real shape built in memory (`hetero.random_weights`: Qwen3-30B-A3B, Mixtral-8x7B),
`hetero.load(model, device="cuda", gpu_mem=B, ctx_size=4096, parallel=N)` and nothing else. Per row:
the plan (experts a layer on the GPU, KV tiers), decode tok/s at a 4k context (the KV filled with
random codes), the prefill of a 512-token prompt, the planner's predictions, and the bound: a decode
step's GPU bytes (weights and the experts it routes to, expected over uniform routing, and KV) over
the HBM read rate, or its host experts' bytes over the DRAM read rate, whichever is longer (the same
for the prompt's tokens). Decode feeds a random token a step; "GB/exp." is the host experts' bytes a
step the CPU computed over (a (token, expert) pair an expert's bytes) against what uniform routing
expects. Each row runs in a fresh process. `--set` passes a `hetero.load` option to every row (e.g.
gpu_kv_dtype=int8, gpu_kv_tokens=4096): a forced placement, which the table marks, to find out why
the planner's own choice runs as it does. Each row also prints, where the plan has them, the host
KV tier's attention clock and the experts' pool's counters (calls a step, workers that joined a
call; the caller's time to pass 1's end, waiting at the passes' ends, and waiting after its own
share); `--host-alone` then times the layers' host experts
through the engine's own pool and arrays with the GPU idle (`experts_alone`), the in-step clock's
reference.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch  # torch's default allocator, as `hetero` runs with (expandable segments halved the prefill)

from bench.budget import arguments, fill, forced_options, host_profile, process_threads, run_rows, trace
from planner.profile import HardwareProfile
from planner.tensors import Kind

GiB = 2**30
CTX, PROMPT = 4096, 512

# name, shape, --gpu-mem GiB, batch, decode target tok/s, prefill target tok/s (0: none)
ROWS = [
    ("qwen3@8GiB", "qwen3-30b-a3b", 8, 1, 90, 2500),
    ("qwen3@14GiB", "qwen3-30b-a3b", 14, 1, 130, 0),
    ("qwen3@24GiB", "qwen3-30b-a3b", 24, 1, 300, 9000),
    ("qwen3x8@8GiB", "qwen3-30b-a3b", 8, 8, 0, 0),
    ("mixtral@24GiB", "mixtral-8x7b", 24, 1, 0, 0),
]


def bound_s(prof: HardwareProfile, nbytes: dict[str, float]) -> float:
    hbm = prof.hbm_gbps / 2 * 1e9  # the profile's HBM figure is a copy's read + write
    host = nbytes["cpu experts"] + nbytes["cpu weights"] + nbytes["cpu attention"]
    host += nbytes["pcie weights"]  # host experts copied up (a step of many rows) leave DRAM all the same
    return max((nbytes["gpu weights"] + nbytes["gpu attention"]) / hbm, host / (prof.dram_read_gbps * 1e9))


def _staging(model):
    """The model's host experts' shared staging (`offload.moe_host.HostStaging`), or None."""
    return next((lw.ffn.staging for lw in model.layers if getattr(lw.ffn, "staging", None) is not None), None)


def _host_calls(staging) -> str:
    """How the host experts' calls reach the CPU: "memory" (stream memory operations), "host
    functions", or "none" (no host experts)."""
    return "none" if staging is None else "memory" if staging.signals else "host functions"


def experts_alone(staging, rounds: int = 3) -> dict[str, float]:
    """The layers' host experts called from this thread through the engine's own pool and arrays,
    the GPU idle, a layer after another `rounds` times over (past the last-level cache, as a step
    reads them): one token routed to a layer's first host experts (k of them, or as many as it
    holds) → ms a call and GB/s of experts read (median over calls), against which a step's clock
    for the same calls shows what the step around them costs."""
    import numpy as np

    from cpu_attention.experts_pool import run_pooled

    sc, cfg = staging.scratch, staging.cfg
    k = cfg.num_experts_per_tok
    x = np.random.default_rng(0).standard_normal((1, cfg.hidden_size)).astype(np.float32)
    out = np.zeros((1, cfg.hidden_size), np.float32)
    w = np.full((1, k), 1.0 / k, np.float32)
    calls = []
    for he in staging.layers:
        n = min(len(he.experts), k)
        ids = np.full((1, k), -1, np.int32)
        ids[0, :n] = np.arange(n)
        calls.append((he.descriptor(x, ids, w, out, sc), n * he.nbytes / len(he.experts), ids))  # ids kept
    per_call, rates = [], []
    for r in range(rounds + 1):
        for d, nbytes, _ in calls:
            t = time.perf_counter()
            run_pooled(d)
            s = time.perf_counter() - t
            if r:  # the first round compiles and warms
                per_call.append(s)
                rates.append(nbytes / s / 1e9)
    sc.take_pairs()
    return dict(ms_a_call=statistics.median(per_call) * 1e3, gbps=statistics.median(rates), gbps_min=min(rates),
                gbps_max=max(rates), layers=len(calls))


def _pool_stats(staging) -> dict[str, int]:
    pool = staging.scratch.pool if staging is not None else None
    return pool.stats() if pool is not None else {}


def run_row(prof: HardwareProfile, name: str, shape: str, gpu_gib: int, batch: int, target: float,
            prefill_target: float, steps: int, trace_to: Path | None = None, forced: dict | None = None,
            host_alone: bool = False) -> dict:
    import hetero
    from hetero.random_weights import random_shape
    from hetero.random_weights import RandomCheckpoint
    from planner.cost import decode_step
    from planner.prefill_cost import prefill_seconds

    cfg = random_shape(shape)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = hetero.load(RandomCheckpoint(cfg, "cuda"), device="cuda", gpu_mem=gpu_gib * GiB, ctx_size=CTX,
                         parallel=batch, **(forced or {}))
    load_s = time.perf_counter() - t0
    runner, cache, plan = engine.runner, engine.cache, engine.plan
    gen = torch.Generator().manual_seed(0)
    # prefill: two warm-up prompts (the second of the timed size: its shapes compile, the allocator
    # grows), then the best of three (each into a sequence of its own, freed after)
    pre = []
    for n in (64, PROMPT, PROMPT, PROMPT, PROMPT):
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.prefill(0, ids, 0)
        torch.cuda.synchronize()
        pre.append(time.perf_counter() - t)
        cache.free(0)
    prefill_s = min(pre[2:])
    if trace_to is not None:  # the GPU kernels of one more prefill, by time
        trace(lambda: runner.prefill(0, ids, 0), trace_to.with_suffix(".prefill.txt"))
        cache.free(0)
        host_profile(lambda: runner.prefill(0, ids, 0), trace_to.with_suffix(".prefill.py.txt"))
        cache.free(0)
    # decode at the context's end
    seqs = list(range(batch))
    n0 = CTX - steps - 8
    fill(cache, seqs, n0)
    # a random token a step, as generated text varies (the same token each step routed much the
    # same way each step: a step's host share far from the uniform expectation the bound assumes)
    pos = [n0] * batch
    step_tokens = lambda: torch.randint(0, cfg.vocab_size, (batch,), generator=gen).tolist()  # noqa: E731
    for _ in range(3):  # warm-up: graph capture, Triton compiles
        runner.decode(seqs, step_tokens(), pos)
        pos = [p + 1 for p in pos]
    torch.cuda.synchronize()
    times = []
    experts0 = runner.metrics.total.cpu_experts
    attention0, wait0 = runner.metrics.total.cpu_attention, runner.metrics.total.wait
    staging = _staging(runner.model)
    scratch = staging.scratch if staging is not None else None
    if scratch is not None:
        scratch.take_pairs()
    stats0 = _pool_stats(staging)
    for _ in range(steps):
        toks = step_tokens()
        t = time.perf_counter()
        runner.decode(seqs, toks, pos)
        times.append(time.perf_counter() - t)
        pos = [p + 1 for p in pos]
    step = statistics.median(times)
    torch.cuda.synchronize()
    # what the last timed step's CPU experts added since it was recorded
    cpu_experts = (runner.metrics.total.cpu_experts - experts0 + (scratch.take_seconds() if scratch else 0.0)) / steps
    host = staging.layers[0] if staging is not None and staging.layers else None  # a pair's bytes: an expert's
    cpu_experts_gb = scratch.take_pairs() * host.nbytes / len(host.experts) / steps / 1e9 if host is not None else 0.0
    total = runner.metrics.total
    host_tier = dict(cpu_attention_ms=(total.cpu_attention - attention0) * 1e3 / steps,
                     wait_ms=(total.wait - wait0) * 1e3 / steps)
    pool = {k: v - stats0[k] for k, v in _pool_stats(staging).items()}
    if pool.get("calls"):  # the pool's calls in the timed steps: workers that joined a call, the caller's clocks
        from cpu_attention.experts import tsc_hz

        us = lambda k: pool[k] / tsc_hz() * 1e6 / steps  # noqa: E731  µs a step
        host_tier.update(pool_calls_a_step=pool["calls"] / steps, joined_a_call=pool["joins"] / pool["calls"],
                         pass1_us_a_step=us("pass1"), barriers_us_a_step=us("barriers"), finish_us_a_step=us("finish"))
    alone = experts_alone(staging) if host_alone and staging is not None else {}
    if trace_to is not None:  # the GPU kernels of two more steps, by time
        trace(lambda: [runner.decode(seqs, toks, pos) for _ in range(2)], trace_to)
    pred = decode_step(cfg, prof, plan.placements, plan.kv, batch, n0 + steps // 2, plan.threads, plan.sub_batches)
    prefill_cost = decode_step(cfg, prof, plan.placements, plan.kv, PROMPT, 0, plan.threads, 1)
    on_gpu = [len(x.experts) if x.experts is not None else cfg.num_experts
              for x in plan.placements if x.kind is Kind.EXPERTS and x.on_gpu]
    kv = plan.kv
    out = dict(
        name=name, shape=shape, gpu_mem_gib=gpu_gib, batch=batch, target=target, prefill_target=prefill_target,
        plan="".join(f"forced {k}={v}; " for k, v in (forced or {}).items()) +
             f"experts on the GPU a layer {min(on_gpu)}–{max(on_gpu)} of {cfg.num_experts}; KV GPU {kv.gpu_tokens} "
             f"{kv.gpu_dtype.value} / host {kv.host_tokens} {kv.host_dtype.value}; sub-batches {plan.sub_batches}",
        choices=[f"{c.setting}={c.value}: {c.reason}" for c in plan.choices],
        tok_s=batch / step, predicted_tok_s=batch / pred.seconds, bound_tok_s=batch / bound_s(prof, pred.nbytes),
        prefill_tok_s=PROMPT / prefill_s,
        predicted_prefill_tok_s=PROMPT / prefill_seconds(cfg, prof, plan.placements, plan.kv, PROMPT, plan.workload.ubatch,
                                                         plan.threads),
        prefill_bound_tok_s=PROMPT / bound_s(prof, prefill_cost.nbytes),
        bottleneck=plan.prediction.bottleneck, step_ms=step * 1e3, cpu_experts_ms=cpu_experts * 1e3,
        cpu_experts_gb=cpu_experts_gb, cpu_experts_gb_expected=pred.nbytes["cpu experts"] / 1e9,
        step_ms_all=[round(t * 1e3, 2) for t in times],
        terms_ms={k: round(v * 1e3, 3) for k, v in pred.terms.items()}, load_s=load_s,
        peak_gpu_gib=torch.cuda.max_memory_allocated() / GiB,
        graph=runner.graph_step is not None and getattr(runner.graph_step, "decoder", None) is not None,
        process_threads=process_threads(),
        host_calls=_host_calls(staging), experts_alone=alone, **host_tier,
    )
    runner.close()
    return out


def main() -> None:
    ap = arguments(__doc__.splitlines()[0])
    ap.add_argument("--trace", action="store_true", help="write each row's GPU kernel times (two decode steps)")
    ap.add_argument("--host-alone", action="store_true", help="also time each layer's host experts called "
                    "through the engine's pool with the GPU idle (`experts_alone`)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    forced, set_flags = forced_options(args)

    def one(prof, name, *row):
        to = args.out / f"{name.replace('@', '_')}.trace.txt" if args.trace else None
        return run_row(prof, name, *row, steps=args.steps, trace_to=to, forced=forced, host_alone=args.host_alone)

    extra = [f for f, on in (("--trace", args.trace), ("--host-alone", args.host_alone)) if on]
    extra += set_flags
    done = run_rows("bench.moe", args, ROWS, one, extra)
    if done is None:
        return
    prof, rows = done
    print(f"\nHBM {prof.hbm_gbps:.0f} GB/s (copy, r+w) · DRAM read {prof.dram_read_gbps:.1f} GB/s · CPU int4 experts "
          f"{prof.cpu_experts_gbps:.1f} GB/s · PCIe h2d {prof.pcie_h2d_gbps:.1f} GB/s · {prof.physical_cores} cores")
    print(f"{'row':14} {'decode':>7} {'target':>6} {'pred':>7} {'bound':>7} {'step ms':>7} {'CPU exp':>7} "
          f"{'GB/exp.':>11} {'prefill':>8} {'target':>6} {'pred':>7} {'bound':>7} {'peak GiB':>9}  plan")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:14} ERROR {r['error'][-400:]}")
            continue
        print(f"{r['name']:14} {r['tok_s']:7.1f} {r['target']:6.0f} {r['predicted_tok_s']:7.1f} {r['bound_tok_s']:7.1f} "
              f"{r['step_ms']:7.2f} {r['cpu_experts_ms']:7.2f} "
              f"{r.get('cpu_experts_gb', 0):5.2f}/{r.get('cpu_experts_gb_expected', 0):<5.2f} "
              f"{r['prefill_tok_s']:8.0f} {r['prefill_target']:6.0f} "
              f"{r['predicted_prefill_tok_s']:7.0f} "
              f"{r['prefill_bound_tok_s']:7.0f} {r['peak_gpu_gib']:5.2f}/{r['gpu_mem_gib']:<2}  {r['plan']}"
              f"{' graph' if r['graph'] else ''}; host calls {r.get('host_calls', '?')}")
        if r.get("cpu_attention_ms"):
            print(f"{'':14} host KV tier: CPU attention {r['cpu_attention_ms']:.2f} ms a step, main thread waited "
                  f"{r['wait_ms']:.2f}")
        if r.get("pool_calls_a_step"):
            print(f"{'':14} experts' pool: {r['pool_calls_a_step']:.1f} calls a step, {r['joined_a_call']:.1f} workers "
                  f"joined a call; the caller's µs a step: to pass 1's end {r['pass1_us_a_step']:.0f}, waiting at "
                  f"passes' ends {r['barriers_us_a_step']:.0f}, after its share {r['finish_us_a_step']:.0f}")
        if r.get("experts_alone"):
            a = r["experts_alone"]
            print(f"{'':14} host experts alone (GPU idle, {a['layers']} layers): {a['ms_a_call']:.3f} ms a call, "
                  f"{a['gbps']:.1f} GB/s ({a['gbps_min']:.1f}–{a['gbps_max']:.1f})")


if __name__ == "__main__":
    main()
