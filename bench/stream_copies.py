"""A decode layer's streamed host KV going up, by each way the engine could send it, GB/s:

    python3 -m bench.stream_copies [--rows 16] [--layers 8]

The pieces are a batch's streamed blocks of one layer as `offload/stream.py` sends them: per row
one run of blocks for each of the int8 tier's four tensors (keys and values 852 KB, their scales
26 KB: 26 blocks of 32 tokens, 8 kv heads of 128), each row's runs apart in the pool. Ways:

    one call each   cuMemcpyHtoDAsync a piece (`Driver.memcpy_up`)
    batched         one cuMemcpyBatchAsync for the layer's pieces (`Driver.memcpy_up_all`)
    kernel          one kernel reading the pinned pieces itself (zero-copy), one launch a layer: the
                    engine's (`gpu_ops.host_read.gather_pinned`)
    kernel, graph   the same kernel captured once a layer, each graph launched through the driver
                    (the main thread's cost without Triton's launch path)
    one copy        the same bytes as one contiguous copy: the bound

alone, then beside a 15-thread torch.sum over 2 GiB (the CPU's attention reading DRAM meanwhile);
each way also with the main thread's µs to issue a layer's copies (in a decode step that time is
on the step's serial path: the main thread issues them between the CPU's attention calls).
Last, what each way does to the compute stream's kernels meanwhile: a Llama-3-8B layer's o,
gate_up and down linears (4-bit, a row a sequence) queued just after a layer's copies start, µs
until they end, against the same linears alone (a kernel that holds the SMs delays them).
"""
from __future__ import annotations

import argparse
import threading
import time

import torch

SIZES = (851968, 851968, 26624, 26624)  # bytes a row's run: keys, values, their scales


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.stream_copies needs a CUDA device")
    from gpu_ops.host_read import WORD, HostPointer, gather_pinned
    from offload.driver import RAW_GRAPHS, driver, graph_handle

    dev, R, L = torch.device("cuda"), args.rows, args.layers
    host = [torch.ones(L * R * 3 * s // 8, dtype=torch.int64, pin_memory=True) for s in SIZES]  # rows 3 runs apart
    stage = [torch.empty(R * s // 8, dtype=torch.int64, device=dev) for s in SIZES]
    total = R * sum(SIZES)
    whole_src = torch.ones(total // 8, dtype=torch.int64, pin_memory=True)
    whole_dst = torch.empty_like(whole_src, device=dev)
    drv, st = driver(), torch.cuda.Stream()
    hs = st.cuda_stream

    def pieces(layer: int) -> list[tuple[int, int, int]]:
        return [(d.data_ptr() + r * s, h.data_ptr() + (layer * R * 3 + 3 * r) * s, s)
                for h, d, s in zip(host, stage, SIZES) for r in range(R)]

    # the engine's kernel (`offload/stream.py`): a piece's words from the lowest addresses, layer 0's
    # source plus the layer times its tensor's bytes a layer
    sb, db = (min(t.data_ptr() for t in ts) for ts in (host, stage))
    table = torch.tensor([[(h - sb) // WORD for _, h, _ in pieces(0)],
                          [R * 3 * s // WORD for s in SIZES for _ in range(R)],
                          [(d - db) // WORD for d, _, _ in pieces(0)], [0] * (4 * R),
                          [n // WORD for *_, n in pieces(0)]], dtype=torch.int64, device=dev)

    def kernel(layer: int) -> None:
        with torch.cuda.stream(st):
            gather_pinned(HostPointer.words(sb), HostPointer.words(db), table, layer, 0, 4 * R, max(SIZES) // WORD)

    graphs = []
    if RAW_GRAPHS:
        kernel(0)  # compiled outside the capture
        st.synchronize()
        for layer in range(L):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=st):
                gather_pinned(HostPointer.words(sb), HostPointer.words(db), table, layer, 0, 4 * R, max(SIZES) // WORD)
            graphs.append((g, graph_handle(g)))
    ways = {
        "one call each": lambda layer: [drv.memcpy_up(*c, hs) for c in pieces(layer)],
        "batched": lambda layer: drv.memcpy_up_all(pieces(layer), hs),
        "kernel": kernel,
        **({"kernel, graph": lambda layer: drv.launch(graphs[layer][1], hs)} if graphs else {}),
        "one copy": lambda layer: drv.memcpy_up(whole_dst.data_ptr(), whole_src.data_ptr(), total, hs),
    }
    for d in stage:
        d.zero_()
    kernel(0)
    st.synchronize()
    assert all(bool((d == 1).all()) for d in stage), "the kernel's pieces differ from the host's"

    def seconds(fn) -> tuple[float, float]:
        """(seconds a layer's copies take, seconds the main thread takes to issue them), best of 3."""
        best = issue = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for layer in range(L):
                fn(layer)
            issue = min(issue, (time.perf_counter() - t) / L)
            st.synchronize()
            best = min(best, (time.perf_counter() - t) / L)
        return best, issue

    def cpu_load(stop: threading.Event) -> None:
        a = torch.ones(2**29, dtype=torch.float32)
        while not stop.is_set():
            a.sum()

    print(f"{R} rows, {4 * R} pieces, {total / 1e6:.1f} MB a layer")
    for loaded in (False, True):
        stop, th = threading.Event(), None
        if loaded:
            torch.set_num_threads(15)
            th = threading.Thread(target=cpu_load, args=(stop,))
            th.start()
            time.sleep(0.5)
        for name, fn in ways.items():
            fn(0)
            st.synchronize()
            t, issue = seconds(fn)
            print(f"{'beside torch.sum' if loaded else 'alone':16} {name:14} {t * 1e3:7.3f} ms a layer  "
                  f"{total / t / 1e9:6.1f} GB/s  issued in {issue * 1e6:6.1f} µs")
        if th is not None:
            stop.set()
            th.join()
    beside(ways, R, st)


def beside(ways: dict, rows: int, st: torch.cuda.Stream) -> None:
    """µs from a layer's copies' start (on st) to the end of a layer's linears queued just after on
    the compute stream, for each way of copying, and with no copy."""
    from gpu_ops.nf4 import nf4_linear

    dev = torch.device("cuda")
    shapes = ((4096, 4096), (28672, 4096), (4096, 14336))  # o, gate_up, down
    lins = [(nf4_linear(torch.randn(n, k, device=dev) * 0.02, None, dev),
             torch.randn(rows, k, device=dev, dtype=torch.bfloat16)) for n, k in shapes]
    comp = torch.cuda.current_stream()
    for name, fn in {"no copy": lambda layer: None, **ways}.items():
        best = float("inf")
        for _ in range(3):
            [lin(x) for lin, x in lins]
            torch.cuda.synchronize()
            a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            a.record(st)
            fn(0)
            comp.wait_event(a)
            [lin(x) for lin, x in lins]
            b.record(comp)
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b) * 1e3)
        print(f"{'linears beside':16} {name:14} {best:7.1f} µs until a layer's o, gate_up, down at {rows} rows end")


if __name__ == "__main__":
    main()
