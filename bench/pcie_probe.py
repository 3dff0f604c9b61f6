"""Why streamed host KV was slow: host→device copy rates from a large pinned pool, alone and
beside the CPU attention kernels, and what a small upload waits behind a large one.

    python bench/pcie_probe.py [--pool-gib 4]

Prints GB/s for: 24 MB copies from one small pinned buffer (the profile's case); the same
sweeping a large pinned pool (many pages: IOMMU/TLB cost in a VM); the sweep while 16 Numba
threads run decode attention over another host pool (DRAM contention); and the latency of a
16 KB upload on a second stream while a 24 MB one is in flight, whole or in 2 MB pieces.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_attention import HostKVPool, KVDtype, decode_attention  # noqa: E402

MB = 2**20


def rate(fn, nbytes: int, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool-gib", type=float, default=4.0)
    args = ap.parse_args()
    chunk = 24 * MB
    dev = torch.device("cuda")
    small = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    pool = torch.empty(int(args.pool_gib * 2**30), dtype=torch.uint8, pin_memory=True)
    pool.fill_(1)
    dst = torch.empty(chunk, dtype=torch.uint8, device=dev)
    n = pool.numel() // chunk
    print(f"small pinned buffer, 24 MB copies: {rate(lambda: dst.copy_(small, non_blocking=True), chunk):.1f} GB/s")
    i = [0]

    def sweep():
        a = (i[0] % n) * chunk
        dst.copy_(pool[a:a + chunk], non_blocking=True)
        i[0] += 1

    print(f"sweeping a {args.pool_gib:.0f} GiB pinned pool: {rate(sweep, chunk, reps=n):.1f} GB/s")

    # the same beside the CPU kernels (bf16, 1 × 32k tokens, 8 kv heads, D 128: 134 MB a call)
    kv = HostKVPool(1, 2048, 8, 16, 128, KVDtype.BF16)
    kv.k.fill_(0.01)
    kv.v.fill_(0.01)
    q = torch.randn(1, 32, 128)
    bt = torch.arange(2048, dtype=torch.int32)[None]
    lens = torch.tensor([32768])
    decode_attention(kv, 0, q, bt, lens, 0.1)
    stop, calls = threading.Event(), [0]

    def cpu_load():
        while not stop.is_set():
            decode_attention(kv, 0, q, bt, lens, 0.1)
            calls[0] += 1

    t0 = time.perf_counter()
    for _ in range(10):
        decode_attention(kv, 0, q, bt, lens, 0.1)
    alone = 10 * 2 * kv.k.numel() * 2 / (time.perf_counter() - t0) / 1e9
    th = threading.Thread(target=cpu_load)
    th.start()
    t0 = time.perf_counter()
    busy = rate(sweep, chunk, reps=n)
    dt = time.perf_counter() - t0
    stop.set()
    th.join()
    cpu_busy = calls[0] * 2 * kv.k.numel() * 2 / dt / 1e9
    print(f"CPU attention alone: {alone:.1f} GB/s; beside the sweep: PCIe {busy:.1f} GB/s, CPU attention ~{cpu_busy:.1f} GB/s")

    # a small upload's latency behind a big one on another stream
    side = torch.cuda.Stream()
    tiny_src = torch.empty(16 * 1024, dtype=torch.uint8, pin_memory=True)
    tiny_dst = torch.empty(16 * 1024, dtype=torch.uint8, device=dev)

    def latency(pieces: int) -> float:
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            step = chunk // pieces
            for p in range(pieces):
                dst[p * step:(p + 1) * step].copy_(small[p * step:(p + 1) * step], non_blocking=True)
        time.sleep(50e-6)
        t = time.perf_counter()
        tiny_dst.copy_(tiny_src, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        out = time.perf_counter() - t
        torch.cuda.synchronize()
        return out * 1e6

    for pieces in (1, 12):
        ts = sorted(latency(pieces) for _ in range(20))
        print(f"16 KB upload behind a 24 MB one in {pieces} piece(s): median {ts[10]:.0f} us")
    torch.cuda.synchronize()
    tiny = sorted(rate(lambda: tiny_dst.copy_(tiny_src, non_blocking=True), 16 * 1024, 1) for _ in range(20))
    print(f"16 KB upload alone: ~{16 * 1024 / tiny[10] / 1e3:.0f} us")


if __name__ == "__main__":
    main()
