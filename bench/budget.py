"""Decode at a GPU budget, as a user gets it: the planner's own choice, nothing forced.

    python3 -m bench.budget --out DIR [--quick] [--only NAME,...] [--profile profile.json] [--set KEY=VALUE ...]

(as a module from the repository root: run as a file, bench/cpu_attention.py would shadow the
package)

Llama-3-8B shape, random weights built in memory (`hetero.random_weights`). For each row: measure
the machine once (or load a profile; it becomes the cached profile `hetero.load` plans with), then
`hetero.load(model, device="cuda", gpu_mem=B, ctx_size=C, parallel=N)` and nothing else (the
planner's own choice; the budget fenced), fill the KV cache to the context (random codes:
attention's speed does not depend on the values), time decode steps.
Prints per row the plan (dtype and tokens per tier, streamed tokens, sub-batches), tok/s, the
planner's prediction, the bound (bytes a step must read over the measured bandwidths: weights
and device-tier KV over HBM, host KV over DRAM or PCIe, whichever is larger) and the peak GPU
memory against the budget, and the runner's own clocks a step (GPU, CPU attention, the main
thread waiting for the CPU; all of them in the JSON: what the prediction's terms are checked
against). Each row runs in a fresh process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch  # noqa: E402

from hetero.config import LLAMA3_8B  # noqa: E402
from planner.hardware import kernels_version  # noqa: E402
from planner.profile import HardwareProfile, cache_path, measure  # noqa: E402
from offload.build import on_own_thread  # noqa: E402
from offload.timers import StepTimes  # noqa: E402
from planner.tensors import Kind  # noqa: E402

GiB = 2**30

# name, context, batch, --gpu-mem GiB, target tok/s
ROWS = [
    ("1x8k@6GiB", 8192, 1, 6, 300),
    ("1x32k@6GiB", 32768, 1, 6, 200),
    ("1x64k@8GiB", 65536, 1, 8, 150),
    ("1x128k@6GiB", 131072, 1, 6, 25),
    ("16x8k@8GiB", 8192, 16, 8, 500),
    ("32x2k@6GiB", 2048, 32, 6, 1000),
]


def fill(cache, seqs: list[int], ctx: int) -> None:
    """Reserve ctx tokens a sequence; random codes and small scales in both pools. On a thread that
    ends with it, as `hetero.load` loads: torch's parallel CPU ops on the main thread would leave
    an OpenMP pool there that a user's process does not have (`bench.omp_pools`)."""
    on_own_thread(_fill, cache, seqs, ctx, name="bench-fill")


def _fill(cache, seqs: list[int], ctx: int) -> None:
    for s in seqs:
        cache.reserve(s, ctx)
    cache.seal_complete()
    pools = [cache.host] + ([cache.gpu] if cache.gpu is not None else [])
    for pool in pools:
        for name, t in pool.parts().items():
            if t.dtype in (torch.int8, torch.uint8):
                t.view(torch.uint8).random_(0, 256)
            elif name.endswith("_zero"):
                t.fill_(-0.05)
            elif name.endswith("_scale"):
                t.fill_(0.01)
            else:
                t.normal_(0, 0.5)
    if cache.gpu is not None and cache.gpu.quantized:
        cache.gpu.tail_k.normal_(0, 0.5)
        cache.gpu.tail_v.normal_(0, 0.5)


def bound_s(prof: HardwareProfile, weight_bytes: float, gpu_kv: float, cpu_kv: float, streamed_kv: float) -> float:
    """The fastest a step can be: device bytes over HBM read, host KV over DRAM (the CPU's share)
    and PCIe (the streamed share), each resource alone."""
    hbm = prof.hbm_gbps / 2 * 1e9  # the profile's HBM figure is a copy's read + write
    return max((weight_bytes + gpu_kv) / hbm, (cpu_kv + streamed_kv) / (prof.dram_read_gbps * 1e9),
               streamed_kv / (prof.pcie_h2d_gbps * 1e9))


def process_threads() -> int:
    """This process's threads now. OpenMP keeps a pool of threads for each thread that has run a
    parallel region (Numba's kernels, and torch's CPU ops where torch shares the libgomp); from a
    second pool on, the process holds more threads than cores, and libgomp then lets waiting
    workers sleep at once instead of spinning (`cpu_attention._numba`). A count above the cores
    plus a dozen is worth a look."""
    return len(os.listdir("/proc/self/task"))


def measured_ms(before: StepTimes, after: StepTimes, steps: int) -> dict[str, float]:
    """The runner's own clocks over the timed steps, ms a step (`offload.timers.StepTimes`): what
    the prediction's terms are checked against (a whole-step graph records its wall time only)."""
    per = lambda f: round((getattr(after, f) - getattr(before, f)) / steps * 1e3, 3)  # noqa: E731
    out = {f: per(f) for f in ("wall", "gpu", "cpu_attention", "cpu_experts", "wait", "transfer")}
    gone = dataclasses.replace(after, **{f: getattr(after, f) - getattr(before, f) for f in out})
    return dict(out, idle=round(gone.idle / steps * 1e3, 3))


def trace(work, path: Path) -> None:
    """The GPU kernels and CPU ops of work(), by GPU time, with its wall time, written to path."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t = time.perf_counter()
        work()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    table = p.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    timeline = path.with_suffix(".json")
    p.export_chrome_trace(str(timeline))
    path.write_text(f"wall {wall * 1e3:.2f} ms (profiled)\n" + table + "\n" + chain(timeline))


def chain(timeline: Path) -> str:
    """Each GPU kernel's share of its stream's time, from a profiler timeline: the time from the
    later of its start and the stream's previous end to its end (what the stream waited for it;
    a kernel that started early under PDL and waited is charged only past its predecessor), then
    the stream's idle gaps; by kernel name, largest first."""
    events = json.loads(timeline.read_text())["traceEvents"]
    by_stream: dict[int, list] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            by_stream.setdefault(e["args"].get("stream", 0), []).append(e)
    rows: dict[tuple[int, str], list[float]] = {}
    lines = []
    for stream, evs in sorted(by_stream.items()):
        evs.sort(key=lambda e: e["ts"])
        end = evs[0]["ts"]
        gaps = 0.0
        for e in evs:
            gaps += max(0.0, e["ts"] - end)
            own = e["ts"] + e["dur"] - max(e["ts"], end)
            end = max(end, e["ts"] + e["dur"])
            rows.setdefault((stream, e["name"][:60]), []).append(max(0.0, own))
        span = end - evs[0]["ts"]
        lines.append(f"stream {stream}: {len(evs)} kernels and copies over {span:.1f} µs, idle {gaps:.1f} µs")
    lines.append(f"{'stream':>6}  {'kernel':60}  {'calls':>5}  {'µs own':>8}  {'µs a call':>9}")
    for (stream, name), own in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{stream:>6}  {name:60}  {len(own):>5}  {sum(own):8.1f}  {sum(own) / len(own):9.2f}")
    return "\n".join(lines) + "\n"


def host_profile(work, path: Path) -> None:
    """The Python functions of work() by their own time, then by their time with callees, with its
    wall time (the device's queued work included), written to path."""
    import cProfile
    import io
    import pstats

    def whole() -> None:
        work()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.runcall(whole)
    wall = time.perf_counter() - t
    text = io.StringIO()
    for key in ("tottime", "cumtime"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
    path.write_text(f"wall {wall * 1e3:.2f} ms (profiled)\n" + text.getvalue())


def host_alone_ms(runner, cache, seqs: list[int]) -> dict[str, float]:
    """The host tier's kernel alone over this row's own pool and tables, every layer, ms a step (best
    of 3): on the main thread; there again right after an embedding lookup of the batch's tokens (as
    a step makes one); and on a fresh thread (no OpenMP pool beside Numba's). Against the runner's
    own clock for the same kernel inside the steps: what the step adds to it."""
    import numpy as np

    import cpu_attention

    bt, lens = cache.tables(seqs, "host")
    if not int(lens.sum()):
        return {}
    cfg, pool = runner.cfg, cache.host
    work = cpu_attention.DecodeWork(pool, bt, lens, runner.threads)
    q = np.random.default_rng(0).standard_normal((len(seqs), cfg.num_heads, cfg.head_dim), np.float32)
    o, lse = np.empty_like(q), np.empty(q.shape[:2], np.float32)
    ids = torch.ones(len(seqs), dtype=torch.long)

    def best(embed: bool = False) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            for i in range(cfg.num_layers):
                if embed and i == 0:
                    runner.model.embed(ids)
                work.run(pool, i, q, runner.model.scale, o, lse)
            times.append(time.perf_counter() - t)
        return round(min(times) * 1e3, 3)

    return dict(main=best(), main_after_embed=best(embed=True), own_thread=on_own_thread(best, name="bench-host"))


def run_row(prof: HardwareProfile, name: str, ctx: int, batch: int, gpu_gib: int, target: float, steps: int,
            trace_to: Path | None = None, weights: str = "auto", alone_host: bool = False,
            forced: dict | None = None, calls: bool = False) -> dict:
    """One row through `hetero.load`, as a user gets it: only the model, --gpu-mem, -c and --parallel
    (and --weights where the run names one: an A/B of the 4-bit formats; forced: `--set`'s options)."""
    import hetero
    from bench.offload_decode import model_bytes
    from hetero.random_weights import RandomCheckpoint
    from planner.cost import decode_step

    torch.cuda.reset_peak_memory_stats()
    engine = hetero.load(RandomCheckpoint(LLAMA3_8B, "cuda"), device="cuda", gpu_mem=gpu_gib * GiB,
                         ctx_size=ctx, parallel=batch, weights=weights, **(forced or {}))
    runner, cache, plan = engine.runner, engine.cache, engine.plan
    seqs = list(range(batch))
    n0 = ctx - steps - 8  # the steps end at the context's last token
    fill(cache, seqs, n0)
    toks, pos = [1] * batch, [n0] * batch
    for _ in range(3):  # warm-up: JIT, graph capture, Triton compiles
        runner.decode(seqs, toks, pos)
        pos = [p + 1 for p in pos]
    torch.cuda.synchronize()
    before = dataclasses.replace(runner.metrics.total)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.decode(seqs, toks, pos)
        times.append(time.perf_counter() - t)
        pos = [p + 1 for p in pos]
    step = statistics.median(times)
    measured = measured_ms(before, runner.metrics.total, steps)
    if trace_to is not None:  # the GPU kernels of two more steps, by time
        trace(lambda: [runner.decode(seqs, toks, pos) for _ in range(2)], trace_to)
    alone = host_alone_ms(runner, cache, seqs) if alone_host else {}
    found = {}
    if calls:  # the main thread's calls in four more steps (`bench.step_calls`)
        from bench.step_calls import per_step, timed_calls

        with timed_calls() as found:
            for _ in range(4):
                runner.decode(seqs, toks, pos)
                pos = [p + 1 for p in pos]
        found = per_step(found, 4)
    g_tok, h_tok = cache.tier_tokens()
    streamed = len(runner.streamer.blocks) * cache.block_size if runner.streamer is not None else 0
    gpu_kv = g_tok * cache.gpu.block_nbytes / cache.block_size if cache.gpu is not None else 0.0
    host_tok_bytes = cache.host.bytes_per_token
    wbytes = model_bytes(runner.model)
    b = bound_s(prof, wbytes, gpu_kv, (h_tok - streamed) * host_tok_bytes, streamed * host_tok_bytes)
    peak = torch.cuda.max_memory_allocated()
    kv = plan.kv
    # the plan's cost at the measured context (the plan itself was sized for the whole -c)
    pred = decode_step(LLAMA3_8B, prof, plan.placements, kv, batch, n0 + steps // 2, plan.threads, plan.sub_batches)
    out = dict(
        name=name, ctx=ctx, batch=batch, gpu_mem_gib=gpu_gib, target=target, weights=weights,
        plan=f"GPU {kv.gpu_tokens} {kv.gpu_dtype.value} / host {kv.host_tokens} {kv.host_dtype.value}, "
             f"streamed {kv.stream_tokens}, sub-batches {plan.sub_batches}, block {kv.block_size}, embed "
             f"{'GPU' if plan.placement(-1, Kind.EMBED).on_gpu else 'CPU'}",
        choices=[f"{c.setting}={c.value}: {c.reason}" for c in plan.choices],
        tok_s=batch / step, predicted_tok_s=batch / pred.seconds, bound_tok_s=batch / b,
        bottleneck=plan.prediction.bottleneck, step_ms=step * 1e3, step_ms_all=[round(t * 1e3, 2) for t in times],
        peak_gpu_gib=peak / GiB,
        within_budget=peak <= gpu_gib * GiB, gpu_kv_tokens=g_tok, host_kv_tokens=h_tok, streamed_tokens=streamed,
        graph=runner.graph_step is not None and runner.graph_step.decoder is not None, terms_ms={k: round(v * 1e3, 3) for k, v in pred.terms.items()},
        measured_ms=measured, host_alone_ms=alone, calls=found, process_threads=process_threads(),
    )
    runner.close()
    return out


def arguments(description: str) -> argparse.ArgumentParser:
    """The flags of a benchmark whose rows each run in a fresh process (this one, bench.moe)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--quick", action="store_true", help="a quick profile (less exact rates)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps a row")
    ap.add_argument("--only", default="", help="comma-separated row names")
    ap.add_argument("--profile", type=Path, help="a saved HardwareProfile JSON (default: measure now)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # child: run this row, print it
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a hetero.load option for every row (a forced placement, not the planner's own choice)")
    return ap


def forced_options(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """`--set`'s hetero.load options (whole numbers as ints), and the flags that pass them to a row's process."""
    forced = dict(kv.split("=", 1) for kv in args.set)
    return {k: int(v) if v.isdigit() else v for k, v in forced.items()}, [a for kv in args.set for a in ("--set", kv)]


def given_profile(path: Path) -> HardwareProfile:
    """The profile at path, stamped with the installed CPU kernels' digest: `hetero.load` measures
    the machine again where a cached profile's digest differs, so a profile saved before a kernel
    change would otherwise be replaced by each row's own measurement (and the rows' plans vary
    with the machine) while the bench reports the given one."""
    prof = HardwareProfile.from_json(path.read_text())
    now = kernels_version()
    if prof.versions.get("kernels") != now:
        print(f"{path}: measured with other CPU kernels than the installed ones; planning with its figures as they are",
              flush=True)
        prof = dataclasses.replace(prof, versions={**prof.versions, "kernels": now})
    return prof


def run_rows(module: str, args: argparse.Namespace, table: list[tuple], run_one: Callable[..., dict],
             extra: list[str] = ()) -> tuple[HardwareProfile, list[dict]] | None:
    """As a row's process (--one NAME): run_one(profile, *NAME's entry of `table`), printed as its ROW
    line → None. Otherwise the profile (--profile, or measured now), made the cached one `hetero.load`
    plans with in each row's process; then each row as `python3 -m MODULE --one NAME` in a fresh
    process (its output in OUT/NAME.log), its ROW line parsed (the error's tail where there is none);
    all of them written to OUT/<module's name>.json → (profile, rows)."""
    if args.one:
        prof = HardwareProfile.from_json(args.profile.read_text())
        print("ROW " + json.dumps(run_one(prof, *next(r for r in table if r[0] == args.one))), flush=True)
        return None
    names = [r[0] for r in table]
    prof = given_profile(args.profile) if args.profile else measure(quick=args.quick)
    prof_path = args.out / "profile.json"
    prof_path.write_text(prof.to_json())
    cache_path().parent.mkdir(parents=True, exist_ok=True)
    cache_path().write_text(prof.to_json())
    rows = []
    for name in args.only.split(",") if args.only else names:
        cmd = [sys.executable, "-m", module, "--one", name, "--profile", str(prof_path), "--out", str(args.out),
               "--steps", str(args.steps), *extra]
        r = subprocess.run(cmd, capture_output=True, text=True)
        (args.out / f"{name.replace('@', '_')}.log").write_text(r.stdout + r.stderr)
        found = [ln[4:] for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
        row = json.loads(found[0]) if found else dict(name=name, error=(r.stderr or r.stdout)[-3000:])
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = args.out / f"{module.rsplit('.', 1)[-1]}.json"
    out.write_text(json.dumps(dict(profile=prof.to_dict(), rows=rows), indent=1))
    return prof, rows


def main() -> None:
    # this benchmark's rows ran with expandable segments (set before CUDA starts), not for the
    # modules that import its helpers: bench.moe measures with torch's default allocator, as `hetero` runs
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    ap = arguments(__doc__.splitlines()[0])
    ap.add_argument("--trace", action="store_true", help="write each row's GPU kernel times (two decode steps)")
    ap.add_argument("--weights", default="auto", help="hetero.load's weights (auto: the planner's; q4: the linear "
                                                          "4-bit format, for an A/B)")
    ap.add_argument("--host-alone", action="store_true", help="also time the host tier's kernel alone over each "
                                                               "row's own pool (`host_alone_ms`)")
    ap.add_argument("--calls", action="store_true", help="also time the main thread's calls in four steps "
                                                          "(bench/step_calls.py)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    forced, set_flags = forced_options(args)

    def one(prof, name, *row):
        to = args.out / f"{name.replace('@', '_')}.trace.txt" if args.trace else None
        return run_row(prof, name, *row, steps=args.steps, trace_to=to, weights=args.weights, alone_host=args.host_alone,
                       forced=forced, calls=args.calls)

    flags = [f for f, on in (("--trace", args.trace), ("--host-alone", args.host_alone), ("--calls", args.calls)) if on]
    done = run_rows("bench.budget", args, ROWS, one, flags + set_flags + ["--weights", args.weights])
    if done is None:
        return
    prof, rows = done
    print(f"\nHBM {prof.hbm_gbps:.0f} GB/s (copy, r+w) · DRAM read {prof.dram_read_gbps:.1f} GB/s · "
          f"PCIe h2d {prof.pcie_h2d_gbps:.1f} GB/s · {prof.physical_cores} cores")
    print(f"{'row':14} {'tok/s':>7} {'target':>6} {'pred':>7} {'bound':>7} {'peak GiB':>8} "
          f"{'GPU/CPU attn/wait ms':>20}  plan")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:14} ERROR {r['error'][-300:]}")
            continue
        print(f"{r['name']:14} {r['tok_s']:7.1f} {r['target']:6.0f} {r['predicted_tok_s']:7.1f} {r['bound_tok_s']:7.1f} "
              f"{r['peak_gpu_gib']:5.2f}/{r['gpu_mem_gib']:<2} {clocks(r['measured_ms']):>20}  "
              f"{r['plan']}{' graph' if r['graph'] else ''}")
        for k, c in list(r.get("calls", {}).items())[:8]:
            print(f"{'':14} {k:26} {c['ms_a_step']:8.3f} ms a step, {c['calls_a_step']:6.1f} calls, {c['us_a_call']:7.1f} µs each")
        if r.get("host_alone_ms"):
            a = r["host_alone_ms"]
            print(f"{'':14} host kernel alone, ms a step: main thread {a['main']}, after an embedding lookup "
                  f"{a['main_after_embed']}, own thread {a['own_thread']} (in the steps: {r['measured_ms']['cpu_attention']})")


def clocks(m: dict[str, float]) -> str:
    """A row's measured GPU, CPU-attention and waiting time a step (ms), as the table prints them."""
    return f"{m['gpu']:.1f}/{m['cpu_attention']:.1f}/{m['wait']:.1f}"


if __name__ == "__main__":
    main()
