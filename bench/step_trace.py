"""Where a split decode step's wall time goes, per call on the main thread: one workload of
bench/offload_decode.py, a few steps, then the host-side time of each runner call per layer.

    python bench/step_trace.py --workload "8k bf16" --profile PROFILE.json

A call that should only queue GPU work (graph replays, copies on streams) but takes long on
the host is blocking: that is what this looks for.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import importlib.util  # noqa: E402

import cpu_attention  # noqa: E402
import torch  # noqa: E402

# bench/ is not on the path (its cpu_attention.py would shadow the package): load the sibling by file
_spec = importlib.util.spec_from_file_location("offload_decode", Path(__file__).with_name("offload_decode.py"))
od = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(od)
from cpu_attention import HostKVPool  # noqa: E402
from cpu_attention import decode  # noqa: E402
from offload.runner import Runner  # noqa: E402
from offload.stream import KVStreamer  # noqa: E402
from planner.profile import HardwareProfile  # noqa: E402

TIMES: dict[str, list[float]] = collections.defaultdict(list)


def timed(owner, name: str) -> None:
    fn = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}".replace("cpu_attention.", "")
    if name in ("synchronize", "replay"):  # nested inside the runner's calls: marked apart
        label = "  (inside) " + label

    def wrap(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[label].append(time.perf_counter() - t)

    setattr(owner, name, wrap)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="8k bf16")
    ap.add_argument("--profile", type=Path, required=True)
    args = ap.parse_args()
    for cls, names in ((Runner, ("_start", "_finish", "_send_down", "_host_job", "_begin_stream", "_part")),
                       (KVStreamer, ("prefetch", "attend", "begin", "ready", "release")), (HostKVPool, ("write",)),
                       # graph launches, and the host waiting for the device (the CPU share waits for q)
                       (torch.cuda.CUDAGraph, ("replay",)), (torch.cuda.Event, ("synchronize",)),
                       (decode, ("decode_float", "decode_int8", "decode_attention", "_plan"))):
        for n in names:
            timed(cls, n)
    cpu_attention.decode_attention = decode.decode_attention  # the runner calls it through the package
    init = KVStreamer.__init__

    def init_and_tell(self, host, *a, **k):
        print(f"streamer: host pool pinned {host.k.is_pinned()}, {host.k.shape}")
        init(self, host, *a, **k)

    KVStreamer.__init__ = init_and_tell
    prof = HardwareProfile.from_json(args.profile.read_text())
    name, ctx, batch, kv, mem, gpu_tok, sb, stream = next(w for w in od.WORKLOADS if w[0] == args.workload)
    model = od._gpu_decode_bench().build_model(od.LLAMA3_8B)
    row = od.run_workload(model, prof, name, ctx, batch, kv, mem, gpu_tok, steps=6, sub_batches=sb,
                          stream_tokens=stream)
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()})
    steps = 9  # 3 warm-up + 6 timed
    print(f"{'call':28} {'n/step':>7} {'median us':>10} {'sum ms/step':>12}")
    for k, v in sorted(TIMES.items(), key=lambda kv_: -sum(kv_[1])):
        print(f"{k:28} {len(v) / steps:7.1f} {statistics.median(v) * 1e6:10.1f} {sum(v) / steps * 1e3:12.2f}")


if __name__ == "__main__":
    main()
