"""Measuring the hardware profile (`planner.profile`): this machine's host, CPU attention, GPU
and PCIe rates, under 30 s on a fresh machine too (the CPU kernels compile in background
processes while the GPU is measured). `planner.profile.measure` calls `measure` here.
"""
from __future__ import annotations

import ctypes

import datetime as _dt
import platform
import time
from typing import Any, Callable

import numpy as np
import torch

from cpu_attention import warm
from cpu_attention import configure
from planner.hardware import (
    BATCH_SEQS, FORMAT, HOST_KV_DTYPES, KV_BLOCK, POOL_BYTES, RUN_ROWS, AttnRate, HardwareProfile, host_memory, kernels_version, physical_cores,
)


def _best(fn: Callable[[], Any], reps: int = 3, sync: Callable[[], None] | None = None,
          budget_s: float = 2.0, warmup: bool = True) -> float:
    """Fastest of `reps` timed calls after one warm-up, in seconds; stops early once the timed
    calls have taken `budget_s` (slow kernels must not stretch the profile past 30 s)."""
    if warmup:
        fn()
    if sync:
        sync()
    best, start = float("inf"), time.perf_counter()
    for _ in range(reps):
        if best < float("inf") and time.perf_counter() - start > budget_s:
            break
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t)
    return best


def measure(quick: bool = False) -> HardwareProfile:
    """Measure this machine (< 30 s; `quick` uses small arrays, for tests).

    The CPU attention kernels of a fresh machine compile (15–40 s each, `cpu_attention.warm`)
    in background processes while the GPU is measured; the host is measured after they finish,
    on a quiet CPU."""
    t0 = time.perf_counter()
    configure()  # Numba's settings before this process compiles a kernel: the engine's
    compiles = warm.start(tuple(dt.value for dt in HOST_KV_DTYPES))  # or the ones the CLI started
    cores, logical = physical_cores()
    total, avail = host_memory()
    notes: list[str] = []
    gpu: dict[str, Any] = {}
    if torch.cuda.is_available():
        gpu = _measure_gpu(notes, quick)
    else:
        notes.append("no CUDA device: host figures only")
    t1 = time.perf_counter()
    _cpu_gemv_kernel()  # compiled here (or loaded) meanwhile
    notes += compiles.wait()
    t2 = time.perf_counter()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        host = _measure_host(cores, quick)
        t3 = time.perf_counter()
        attn = _measure_cpu_attention(cores, quick)
        t4 = time.perf_counter()
        # DRAM again, some seconds later: a busy neighbour during one reading must not set the plan
        again = _measure_dram(quick)
        first, host["dram_read_gbps"] = host["dram_read_gbps"], max(host["dram_read_gbps"], again)
        if min(first, again) < 0.75 * max(first, again):
            notes.append(f"DRAM read varied during the profile ({first:.1f} then {again:.1f} GB/s): the machine was "
                         "busy; the higher is kept, re-measure with --refresh when it is quiet")
    finally:
        torch.set_num_threads(threads_before)
    t5 = time.perf_counter()
    each = ", ".join(f"{k} {v:.1f}" for k, v in compiles.seconds.items())
    notes.append(f"measured in {t5 - t0:.1f} s (GPU {t1 - t0:.1f}, then waiting for the CPU kernels {t2 - t1:.1f}, "
                 f"host {t3 - t2:.1f}, CPU attention {t4 - t3:.1f}); the kernels compiled or loaded in background "
                 f"processes in s: {each}")
    return HardwareProfile(
        created=_dt.datetime.now().isoformat(timespec="seconds"),
        versions=_versions(), host_total_bytes=total, host_available_bytes=avail,
        physical_cores=cores, logical_cpus=logical, cpu_attention=attn, notes=tuple(notes),
        **host, **gpu,
    )


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"format": str(FORMAT), "kernels": kernels_version(), "python": platform.python_version(),
           "torch": torch.__version__,
           "cuda": str(torch.version.cuda), "cpu": platform.processor() or platform.machine()}
    for pkg in ("hetero", "numba", "bitsandbytes"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _measure_host(cores: int, quick: bool) -> dict[str, float]:
    dram = _measure_dram(quick)
    gemv, gemv_dtype = _measure_cpu_gemv(quick)
    m = 256 if quick else 1024
    a, b = torch.randn(m, m), torch.randn(m, m)
    gflops = 2 * m**3 / _best(lambda: a @ b) / 1e9
    return {"dram_read_gbps": dram, "cpu_gemv_gbps": gemv, "cpu_gemv_dtype": gemv_dtype, "cpu_gflops": gflops,
            "cpu_experts_gbps": _measure_cpu_experts(quick)}


def _measure_cpu_experts(quick: bool) -> float:
    """One token through 8 int4 experts of Qwen3-30B-A3B's shape (hidden 2048, expert FFN 768) with
    hetero's CPU expert kernel as the engine calls it beside a GPU (its C entry point, on its pool of
    threads: cpu_attention.experts_pool), cycling over layers' worth of experts past the last-level
    cache; 0.0 if the kernel is missing."""
    try:
        from cpu_attention.experts import Scratch, timing_layers
        from cpu_attention.experts_pool import ExpertsPool
    except ImportError:
        return 0.0
    H, Fi, k = 2048, 768, 8
    layers = 2 if quick else 24  # 24 × 8 experts × 2.65 MB: 500 MB
    threads = max(1, physical_cores()[0] - 1)  # as the engine runs them beside a GPU (offload/loader.py)
    sets = timing_layers(layers, k, H, Fi, k, threads)
    sc = Scratch(1, k, H, Fi, k)
    sc.pool = ExpertsPool(threads)
    x, ids, w = np.ones((1, H), np.float32), np.arange(k, dtype=np.int32)[None], np.ones((1, k), np.float32)
    out = np.empty((1, H), np.float32)
    call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ExpertsPool.entry_address())
    descriptors = [he.descriptor(x, ids, w, out, sc).ctypes.data for he in sets]
    try:
        call(descriptors[0])  # compiles the kernel

        def all_layers() -> None:
            for d in descriptors:
                call(d)

        return layers * sets[0].nbytes / _best(all_layers, reps=2 if quick else 3) / 1e9
    finally:
        sc.pool.close()


def _measure_dram(quick: bool) -> float:
    """GB/s of a streaming read of 512 MiB (torch's sum over the cores)."""
    n = (16 if quick else 512) * 2**20 // 4
    a = torch.ones(n, dtype=torch.float32)
    return n * 4 / _best(lambda: a.sum(), reps=3 if quick else 5) / 1e9


def _cpu_gemv_kernel() -> Callable | None:
    """hetero's int8 CPU GEMV (w [O, I] int8, scale [O] f32, x [N, I] f32, out [N, O] f32, groups
    of four rows), compiled or loaded by a small call; None if it is missing."""
    try:
        from cpu_attention.linear_kernels import gemv_int8
    except ImportError:
        return None
    gemv_int8(np.ones((8, 64), np.int8), np.ones(8, np.float32), np.ones((1, 64), np.float32),
              np.empty((1, 8), np.float32), 0)
    return gemv_int8


def _measure_cpu_gemv(quick: bool) -> tuple[float, str]:
    """One token through a 256 MiB (beyond any L3) int8 matrix with hetero's CPU kernel; torch's
    bf16 mv if that kernel is missing."""
    rows, cols = (1024, 2048) if quick else (16384, 16384)
    x = torch.randn(1, cols)
    gemv = _cpu_gemv_kernel()
    if gemv is None:
        w, xb = torch.ones(rows, cols, dtype=torch.bfloat16), x[0].to(torch.bfloat16)
        return rows * cols * 2 / _best(lambda: torch.mv(w, xb)) / 1e9, "bf16"
    # the values do not change the time: a constant matrix skips quantizing 256 MiB of noise
    w, s, out = np.ones((rows, cols), np.int8), np.ones(rows, np.float32), np.empty((1, rows), np.float32)
    xn = x.numpy()
    return (rows * cols + 4 * rows) / _best(lambda: gemv(w, s, xn, out, 0), reps=3 if quick else 5) / 1e9, "int8"


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)
    try:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass


def _measure_cpu_attention(cores: int, quick: bool) -> tuple[AttnRate, ...]:
    """Time `cpu_attention.decode_attention` on a pool larger than the caches (layers are
    cycled so each call reads cold memory): one sequence of T tokens × 8 KV heads × D 128 (the
    batch-1 decode the host tier mostly serves; int8 read 53 GB/s there and 30 as 16 × 4k), with as many layers as make POOL_BYTES of each dtype.
    Then a run of RUN_ROWS rows of that sequence (a speculative step's verification), as a
    multiple of the one row's time (`AttnRate.run_cost`), and the same blocks as BATCH_SEQS
    sequences of T / BATCH_SEQS tokens: what a call costs beyond the bytes per (sequence, kv head)
    (`AttnRate.item_s`; on the GPU host's 16 cores 32 × 960 tokens read at the rate of 1 × 30720).

    Each (dtype, thread count) is warmed up on its own, one pass over every layer: the first call
    of a dtype JIT-compiles or loads its kernels, the first at a thread count starts Numba's
    threads, the first touch of a layer faults its pages in. With a single warm-up per dtype the
    second thread count's timings caught that start-up and read bf16 at 3.7 GB/s where the
    engine's steps then ran it at 48–81."""
    import cpu_attention
    from cpu_attention.pool import HostKVPool
    from cpu_attention.layout import token_bytes

    B, T, H, D, BS = (1, 1024, 8, 128, KV_BLOCK) if quick else (1, 16384, 8, 128, KV_BLOCK)
    pool_bytes = (8 if quick else POOL_BYTES // 2**20) * 2**20
    nb = B * T // BS
    q = torch.randn(B, 4 * H, D)
    tables = torch.arange(nb, dtype=torch.int32).reshape(B, -1)
    lens = torch.full((B,), T, dtype=torch.int32)
    shapes = [
        (q, tables, lens),  # one sequence
        (torch.randn(RUN_ROWS, 4 * H, D),  # a run: rows at tokens T − RUN_ROWS + 1 .. T of that sequence
         tables[:1].expand(RUN_ROWS, -1).contiguous(), torch.arange(T - RUN_ROWS + 1, T + 1, dtype=torch.int32)),
        (torch.randn(BATCH_SEQS, 4 * H, D), tables.reshape(BATCH_SEQS, -1),  # the same blocks as 32 sequences
         torch.full((BATCH_SEQS,), T // BATCH_SEQS, dtype=torch.int32)),
    ]
    threads = sorted({max(1, cores // 2), cores})
    out = []
    for dt in HOST_KV_DTYPES:
        layer_bytes = nb * BS * token_bytes(dt, H, D, BS)  # K and V of one layer, scales included
        L = max(2, int(-(-pool_bytes // layer_bytes)))
        pool = HostKVPool(L, nb, H, BS, D, dtype=dt)
        for t in (pool.k, pool.v):  # constants: the values do not change the time, and fill_ is quick
            t.fill_(0.5 if t.dtype == torch.bfloat16 else 3)
        for t in (pool.k_scale, pool.v_scale, pool.k_zero, pool.v_zero):
            if t is not None:
                t.fill_(0.01)
        layer = [0]

        for n in threads:
            _set_threads(n)

            def timer(qx, tx, lx, n: int = n) -> Callable[[], None]:
                def call() -> None:
                    layer[0] = (layer[0] + 1) % L
                    cpu_attention.decode_attention(pool, layer[0], qx, tx, lx, D**-0.5, threads=n)
                return call

            one, run, batch = (timer(*shape) for shape in shapes)
            for _ in range(L):  # warm-up: compile or load, start the threads, touch every layer
                one()
            t = _best(one, reps=3 if quick else 12, budget_s=0.5 if quick else 1.5, warmup=False)
            t_run, t_batch = (_best(f, reps=3 if quick else 6, budget_s=0.5 if quick else 1.5) for f in (run, batch))
            out.append(AttnRate(dt.value, n, layer_bytes / t / 1e9, run_cost=t_run / t,
                                item_s=max(0.0, t_batch - t) / ((BATCH_SEQS - 1) * H)))
        del pool
    _set_threads(cores)
    return tuple(out)


def _measure_gpu(notes: list[str], quick: bool) -> dict[str, Any]:
    import torch.nn.functional as F

    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    mib = 2**20
    out: dict[str, Any] = {"gpu_name": torch.cuda.get_device_name(dev)}
    n = (32 if quick else 256) * mib
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dbuf = torch.empty(n, dtype=torch.uint8, device=dev)
    out["pcie_h2d_gbps"] = n / _best(lambda: dbuf.copy_(host, non_blocking=True), 5, sync) / 1e9
    out["pcie_d2h_gbps"] = n / _best(lambda: host.copy_(dbuf, non_blocking=True), 5, sync) / 1e9
    small_h, small_d = host[:4096], dbuf[:4096]
    reps = 50
    out["pcie_latency_s"] = _best(lambda: [small_d.copy_(small_h, non_blocking=True) for _ in range(reps)],
                                  3, sync) / reps
    del host
    m = (64 if quick else 1024) * mib
    a, b = torch.empty(m, dtype=torch.uint8, device=dev), torch.empty(m, dtype=torch.uint8, device=dev)
    out["hbm_gbps"] = 2 * m / _best(lambda: b.copy_(a), 5, sync) / 1e9
    del a, b, dbuf
    # decode attention over GPU-resident KV: 4 sequences × 32k tokens × 8 KV heads, 32 q heads
    T = 4096 if quick else 32768
    q = torch.randn(4, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(4, 8, T, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    loops = 10
    t = _best(lambda: [F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for _ in range(loops)], 3, sync)
    out["gpu_attention_gbps"] = 2 * k.numel() * 2 * loops / t / 1e9
    del k, v
    out.update(_measure_quant_attention(dev, notes, quick))
    out.update(_measure_gemv(dev, notes, quick))
    s = 2048 if quick else 8192
    a, b = torch.randn(s, s, device=dev, dtype=torch.bfloat16), torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    out["gpu_tflops"] = 2 * s**3 / _best(lambda: a @ b, 5, sync) / 1e12
    del a, b
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    out.update(gpu_total_bytes=total, gpu_free_bytes=free)
    return out


def _measure_quant_attention(dev: torch.device, notes: list[str], quick: bool) -> dict[str, Any]:
    """The engine's paged decode attention over int8 and int4 device blocks (gpu_ops.attention_quant):
    4 sequences × 8k tokens, 8 KV heads of 128, 32 q heads, two layers in turn (past the L2)."""
    from cpu_attention.layout import KVDtype, token_bytes
    from gpu_ops.attention import decode_attention
    from gpu_ops.kv_pool import GpuKVPool

    B, T, H, D, BS, loops = 4, 2048 if quick else 8192, 8, 128, KV_BLOCK, 10
    nb = B * T // BS
    tables = torch.arange(nb, dtype=torch.int32, device=dev).reshape(B, -1)
    lens = torch.full((B,), T, dtype=torch.int32, device=dev)
    q = torch.randn(B, 4 * H, D, device=dev, dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    for dt in (KVDtype.INT8, KVDtype.INT4):
        try:
            pool = GpuKVPool(2, nb, H, BS, D, device=dev, kv_dtype=dt, max_tails=1)
            for part in pool.parts().values():
                if part.dtype in (torch.int8, torch.uint8):
                    part.view(torch.uint8).random_(0, 256)
                else:
                    part.fill_(0.01)
            # replayed in a CUDA graph, as the decode step runs it: eager calls leave the GPU idle
            # between kernels (int4 measured 238-292 GB/s eagerly, 460-580 in the engine's graphs)
            def calls() -> None:
                for i in range(loops):
                    decode_attention(pool, i % 2, q, tables, lens, D**-0.5)

            t = _best(_graphed(calls, dev), 3, torch.cuda.synchronize)
            out[f"gpu_attention_{dt.value}_gbps"] = B * T * token_bytes(dt, H, D, BS) * loops / t / 1e9
            del pool
        except (ImportError, RuntimeError) as e:  # no Triton, or no kernel for this GPU: the bf16 rate stands in
            notes.append(f"{dt.value} GPU attention not measured ({e!r:.80})")
    return out


def _measure_gemv(dev: torch.device, notes: list[str], quick: bool) -> dict[str, Any]:
    """A 14336 × 4096 projection (Llama-3-8B's MLP) at 1 and at 32 rows through the engine's own
    4-bit linear (`gpu_ops.nf4.NF4Linear`, the kernel it picks for the rows), in NF4 and in the
    linear q4 format, replayed in a CUDA graph as the decode step runs it; bf16 weights where
    bitsandbytes or Triton is missing."""
    from planner.tensors import WDtype

    rows, cols = (4096, 4096) if quick else (14336, 4096)
    try:
        import bitsandbytes  # noqa: F401
        import triton  # noqa: F401

        from gpu_ops.nf4 import Codes, nf4_linear
        w = torch.randn(rows, cols, device=dev) * 0.02
        lins = {c: [nf4_linear(w, None, dev, codes=c) for _ in range(4)] for c in (Codes.NF4, Codes.Q4)}
        del w
    except (ImportError, RuntimeError) as e:  # no bitsandbytes / Triton, or no kernels for this GPU
        notes.append(f"NF4 kernels unavailable ({e!r:.80}): GPU linear rates measured in bf16")
        ws = [torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) for _ in range(4)]
        return {"gpu_gemv_dtype": "bf16", **_linear_rates([lambda x, w=w: x @ w.T for w in ws], rows * cols * 2, cols, dev)}
    nbytes = WDtype.NF4.nbytes(rows * cols)  # q4: the same bytes
    out = {"gpu_gemv_dtype": "nf4", **_linear_rates(lins[Codes.NF4], nbytes, cols, dev)}
    try:
        q4 = _linear_rates(lins[Codes.Q4], nbytes, cols, dev)
        out.update(gpu_gemv_q4_gbps=q4["gpu_gemv_gbps"], gpu_gemm_q4_gbps=q4["gpu_gemm_gbps"])
    except Exception as e:  # noqa: BLE001  the q4 kernels failed to build or run here: the planner keeps NF4
        notes.append(f"q4 linear not measured ({e!r:.80})")
    return out


def _linear_rates(lins: list, nbytes: int, cols: int, dev: torch.device) -> dict[str, float]:
    """Weight bytes / s of the linears `lins` (4 copies: not from L2) at 1 row and at 32."""
    loops, out = 20, {}
    for key, m in (("gpu_gemv_gbps", 1), ("gpu_gemm_gbps", 32)):
        x = torch.randn(m, cols, device=dev, dtype=torch.bfloat16)
        run = lambda: [lins[i % 4](x) for i in range(loops)]  # noqa: E731
        out[key] = nbytes * loops / _best(_graphed(run, dev), 3, torch.cuda.synchronize) / 1e9
    return out


def _graphed(fn, dev: torch.device):
    """fn captured in a CUDA graph (after a warm-up call): its replay; fn itself if capture fails."""
    fn()
    torch.cuda.synchronize(dev)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    except RuntimeError:
        return fn
    return g.replay