"""One split decode step of the lean loop (offload/inline.py) as a timeline: when each graph,
copy and CPU kernel ran, on the device's streams and on the host, per layer.

    python bench/step_timeline.py --workload "8k int8" --profile PROFILE.json

Graph launches and the streamer's copies get CUDA timing events around them (on their streams);
the host's event waits and kernel calls get perf_counter stamps. The two clocks are aligned at
the step's start (an event the host waits for), to a few microseconds. Prints layers 0-2 and a
middle one in full, then per-layer medians of the gaps that make up the step.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cpu_attention.decode import DecodeWork  # noqa: E402
from offload import driver as drv_mod  # noqa: E402
from offload.runner import Runner  # noqa: E402
from offload.stream import KVStreamer  # noqa: E402
from planner.profile import HardwareProfile  # noqa: E402

_spec = importlib.util.spec_from_file_location("offload_decode", Path(__file__).with_name("offload_decode.py"))
od = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(od)

TRACED_CALL = 6  # the decode call traced (3 warm-up steps come first)


class Trace:
    def __init__(self):
        self.on = False
        self.calls = 0
        self.gpu: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.host: list[tuple[str, float, float]] = []
        self.labels: dict[int, str] = {}
        self.pool: list[tuple[torch.cuda.Event, int]] = []

    def event(self, stream: int) -> torch.cuda.Event:
        if not self.pool:  # made outside the traced step
            raise RuntimeError("timeline event pool exhausted")
        e, h = self.pool.pop()
        drv_mod.driver().record(h, stream)
        return e


T = Trace()


def instrument() -> None:
    D = drv_mod.Driver
    launch, sync = D.launch, D.synchronize

    def traced_launch(self, graph, stream):
        if not T.on:
            return launch(self, graph, stream)
        a = T.event(stream)
        launch(self, graph, stream)
        T.gpu.append((T.labels.get(graph, "graph"), a, T.event(stream)))

    def traced_sync(self, event):
        t = time.perf_counter()
        sync(self, event)
        if T.on:
            T.host.append(("wait", t, time.perf_counter()))

    D.launch, D.synchronize = traced_launch, traced_sync
    copy = KVStreamer._driver_copy

    def traced_copy(self, layer, slot):
        if not T.on:
            return copy(self, layer, slot)
        h = self.stream.cuda_stream
        a = T.event(h)
        copy(self, layer, slot)
        T.gpu.append((f"copy{layer}", a, T.event(h)))

    KVStreamer._driver_copy = traced_copy
    run = DecodeWork.run

    def traced_run(self, *a, **k):
        t = time.perf_counter()
        run(self, *a, **k)
        if T.on:
            T.host.append(("kernel", t, time.perf_counter()))

    DecodeWork.run = traced_run
    decode = Runner.decode

    def traced_decode(self, *a, **k):
        T.calls += 1
        if T.calls != TRACED_CALL:
            return decode(self, *a, **k)
        for cap, il in self._inline.items():
            for name in ("pre", "attn", "post"):
                for i, g in enumerate(getattr(il, name)):
                    T.labels[g] = f"{name}{i}"
        stream = torch.cuda.current_stream()
        for _ in range(4000):
            e = torch.cuda.Event(enable_timing=True)
            T.pool.append((e, drv_mod.event_handle(e, stream)))
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        e0.synchronize()
        t0 = time.perf_counter()
        T.on = True
        try:
            out = decode(self, *a, **k)
        finally:
            T.on = False
        torch.cuda.synchronize()
        report(e0, t0, self.cfg.num_layers)
        return out

    Runner.decode = traced_decode


def report(e0, t0: float, L: int) -> None:
    gpu = {name: (e0.elapsed_time(a) * 1e3, e0.elapsed_time(b) * 1e3) for name, a, b in T.gpu}  # µs
    host = [(name, (a - t0) * 1e6, (b - t0) * 1e6) for name, a, b in T.host]
    waits = [h for h in host if h[0] == "wait"]
    kernels = [h for h in host if h[0] == "kernel"]
    print(f"step: {max(b for _, b in gpu.values()):.0f} µs on the device clock; {len(waits)} waits, {len(kernels)} kernels")
    rows = []
    for i in range(L):
        g = lambda n: gpu.get(f"{n}{i}", (float("nan"),) * 2)  # noqa: E731
        w = waits[i] if i < len(waits) else ("", float("nan"), float("nan"))
        k = kernels[i] if i < len(kernels) else ("", float("nan"), float("nan"))
        rows.append(dict(pre=g("pre"), attn=g("attn"), post=g("post"), copy=g("copy"), wait=w[1:], kernel=k[1:]))
    fmt = lambda se: f"{se[0]:8.0f}-{se[1]:<8.0f}"  # noqa: E731
    print(f"{'layer':>5} {'pre (dev)':>17} {'attn (dev)':>17} {'copy (dev)':>17} {'host wait':>17} "
          f"{'CPU kernel':>17} {'post (dev)':>17}")
    for i in (0, 1, 2, L // 2):
        r = rows[i]
        print(f"{i:5} " + " ".join(fmt(r[n]) for n in ("pre", "attn", "copy", "wait", "kernel", "post")))
    med = lambda xs: statistics.median([x for x in xs if x == x]) if any(x == x for x in xs) else float("nan")  # noqa: E731
    mid = rows[2:L - 1]
    parts = {
        "pre on the device": med([r["pre"][1] - r["pre"][0] for r in mid]),
        "attn on the device": med([r["attn"][1] - r["attn"][0] for r in mid]),
        "post on the device": med([r["post"][1] - r["post"][0] for r in mid]),
        "copy of a layer's streamed blocks": med([r["copy"][1] - r["copy"][0] for r in mid]),
        "host: wait for q (sync)": med([r["wait"][1] - r["wait"][0] for r in mid]),
        "host: CPU kernel (append + attention)": med([r["kernel"][1] - r["kernel"][0] for r in mid]),
        "pre end → host wait returns": med([r["wait"][1] - r["pre"][1] for r in mid]),
        "CPU kernel end → post starts (dev)": med([r["post"][0] - r["kernel"][1] for r in mid]),
        "attn end → post starts (dev)": med([r["post"][0] - r["attn"][1] for r in mid]),
        "pre start → attn start (dev)": med([r["attn"][0] - r["pre"][0] for r in mid]),
        "post end → next pre start (dev)": med([rows[i + 1]["pre"][0] - rows[i]["post"][1] for i in range(2, L - 1)]),
        "layer period (pre start to pre start)": med([rows[i + 1]["pre"][0] - rows[i]["pre"][0] for i in range(2, L - 1)]),
    }
    for k, v in parts.items():
        print(f"  {k:42} {v:8.1f} µs")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="8k int8")
    ap.add_argument("--profile", type=Path, required=True)
    args = ap.parse_args()
    instrument()
    prof = HardwareProfile.from_json(args.profile.read_text())
    name, ctx, batch, kv, mem, gpu_tok, sb, stream = next(w for w in od.WORKLOADS if w[0] == args.workload)
    model = od._gpu_decode_bench().build_model(od.LLAMA3_8B)
    row = od.run_workload(model, prof, name, ctx, batch, kv, mem, gpu_tok, steps=6, sub_batches=sb,
                          stream_tokens=stream)
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
           if k in ("name", "tok_s", "step_ms", "gpu_ms", "cpu_attn_ms", "transfer_ms", "streamed_tokens")})


if __name__ == "__main__":
    main()
