"""CPU-only decode of the embedded demo model: tokens/s, weight and KV bytes read per second.

    PYTHONUNBUFFERED=1 python3 -m bench.cpu_decode --threads 2 --out DIR

Loads the demo model (SmolLM2-135M-Instruct, GGUF Q4_1) with the default options (int8
weights, bf16 KV) and, for each context (empty, then 2048 tokens prefilled), times several
runs of --steps greedy decode steps through the engine's own step (`Engine._decode`, the
pass `generate` times, plus an argmax) and reports the median. Beside it: the DRAM read
bandwidth measured in the same run (a Numba parallel sum over 1 GiB), the weight bytes per
token (every linear layer and the lm_head once) and KV bytes per token (K and V of every
cached token in every layer), each × tokens/s, and where one token's time goes (the
model's phases timed with perf_counter around them). Prints the load average, because
other work on the machine's few cores changes everything here. Reports; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numba
import numpy as np
import torch

import cpu_attention
import hetero
from cpu_attention import dram_read_gbps
from hetero.app.engine import Engine, Sequence

LOG: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


def weight_bytes(eng: Engine) -> int:
    """Weight bytes one decode token reads: every projection of every layer and the lm_head."""
    m = eng.model
    lins = [m.lm_head] + [lin for lw in m.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    return sum(lin.nbytes for lin in lins) + m.cfg.hidden_size * m.embed_w.element_size()  # + one embedding row


def kv_bytes_per_token(eng: Engine) -> float:
    """KV bytes attention reads per cached token: K and V of every layer, scales included."""
    return eng.cache.host.bytes_per_token


class PhaseTimer:
    """perf_counter around the model's phases, the host KV write and the attention kernel, summed per phase."""

    def __init__(self, eng: Engine):
        self.t: dict[str, float] = defaultdict(float)
        for name in ("embed", "pre_attention", "post_attention", "logits"):
            setattr(eng.model, name, self._wrap(getattr(eng.model, name), name))
        eng.cache.host.write = self._wrap(eng.cache.host.write, "kv_write")
        cpu_attention.decode_attention = self._wrap(cpu_attention.decode_attention, "attention")

    def _wrap(self, f, key):
        def timed(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            self.t[key] += time.perf_counter() - t
            return r
        return timed


def decode_runs(eng: Engine, ctx: int, steps: int, runs: int, timer: PhaseTimer, vocab: int) -> dict:
    """Prefill `ctx` tokens (once), then `runs` × `steps` greedy decode steps, each run from the same context."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, vocab - 100, size=max(ctx, 1)).tolist()
    seq_id = 10**6 + ctx
    t = time.perf_counter()
    eng._prefill(seq_id, prompt, 0)
    prefill_s = time.perf_counter() - t
    rates, phases = [], []
    for r in range(runs + 1):  # run 0 warms up (JIT, caches) and is not counted
        eng.cache.truncate(seq_id, len(prompt))
        s = Sequence(seq_id, list(prompt), eng.defaults)
        timer.t.clear()
        t = time.perf_counter()
        for _ in range(steps):
            s.tokens.append(int(eng._decode([s])[0].argmax()))
        dt = time.perf_counter() - t
        if r:
            rates.append(steps / dt)
            phases.append({k: v / steps * 1e3 for k, v in timer.t.items()} | {"total": dt / steps * 1e3})
    eng.cache.free(seq_id)
    med = sorted(range(runs), key=lambda i: rates[i])[runs // 2]
    return {"ctx": ctx if ctx else 0, "prefill_tps": len(prompt) / prefill_s, "tps_runs": rates,
            "tps": statistics.median(rates), "ms_per_token": phases[med],
            "mean_kv_tokens": (ctx if ctx else 1) + steps / 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="threads for the kernels (default: all cores)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per run")
    ap.add_argument("--runs", type=int, default=5, help="runs per context; the median is reported")
    ap.add_argument("--ctx", type=int, nargs="*", default=[0, 2048], help="context lengths to decode after")
    ap.add_argument("--out", type=Path, default=None, help="folder for the full log and results.json")
    a = ap.parse_args()

    threads = a.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    log(f"hetero CPU decode bench | {os.uname().machine}, {len(os.sched_getaffinity(0))} cpus, threads {threads}, "
        f"torch {torch.__version__}, numba {numba.__version__} ({numba.config.THREADING_LAYER} layer)")
    log(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    dram = dram_read_gbps(2**30, threads)  # also sets Numba's threads
    log(f"DRAM read: {dram:.1f} GB/s (Numba parallel sum over 1 GiB)")

    t = time.perf_counter()
    eng = hetero.load(threads=a.threads, ctx_size=max(a.ctx) + a.steps + 1, parallel=1)
    log(f"loaded {Path(eng.info['model']).name} in {time.perf_counter() - t:.1f} s: {eng.info['weights']} weights, "
        f"{eng.info['kv_dtype']} KV")
    wb, kvb = weight_bytes(eng), kv_bytes_per_token(eng)
    log(f"weight bytes per token {wb / 1e6:.1f} MB; KV bytes per cached token {kvb / 1e3:.1f} kB")
    timer = PhaseTimer(eng)

    results = []
    with torch.inference_mode():
        for ctx in a.ctx:
            r = decode_runs(eng, ctx, a.steps, a.runs, timer, eng.cfg.vocab_size)
            r["weight_gbps"] = wb * r["tps"] / 1e9
            r["kv_gbps"] = kvb * r["mean_kv_tokens"] * r["tps"] / 1e9
            results.append(r)
            ms = r["ms_per_token"]
            log(f"\ncontext {ctx}: prefill {r['prefill_tps']:.0f} tok/s; decode runs "
                f"{', '.join(f'{x:.1f}' for x in r['tps_runs'])} tok/s → median {r['tps']:.1f}")
            log("  ms per token (median run): " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
            log(f"  other (argmax, engine step, Python): {ms['total'] - sum(v for k, v in ms.items() if k != 'total'):.2f}")
    load_after = os.getloadavg()
    log(f"\nload average after: {' '.join(f'{x:.2f}' for x in load_after)}")

    log(f"\n{'context':>8} {'tok/s':>7} {'ms/tok':>7} {'weights GB/s':>13} {'KV GB/s':>8} {'DRAM GB/s':>10}")
    for r in results:
        log(f"{r['ctx']:>8} {r['tps']:>7.1f} {1e3 / r['tps']:>7.2f} {r['weight_gbps']:>13.2f} {r['kv_gbps']:>8.2f} "
            f"{dram:>10.1f}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "log.txt").write_text("\n".join(LOG) + "\n")
        (a.out / "results.json").write_text(json.dumps({
            "threads": threads, "dram_gbps": dram, "weight_bytes_per_token": wb, "kv_bytes_per_cached_token": kvb,
            "load_after": load_after, "results": results}, indent=1))


if __name__ == "__main__":
    main()
