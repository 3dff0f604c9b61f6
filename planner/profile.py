"""The hardware profile: what this machine can do, measured once and cached as JSON.

`measure()` takes under 30 s (on a fresh machine too: the CPU kernels compile in background
processes while the GPU is measured); `load_or_measure()` reuses the cached file (in
`$XDG_CACHE_HOME/hetero/profile.json`, default `~/.cache/hetero/`) and only re-reads the
figures that change from minute to minute (free memory).
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from cpu_attention import warm
from cpu_attention.layout import KVDtype
from hetero.paths import profile_path

log = logging.getLogger(__name__)

FORMAT = 7  # bump when fields change meaning or the stated constants change; an older cache is then re-measured
GIB = 1024**3

# Stated constants (not measured; bench/offload_decode.py prints predictions beside measurements).
# Per layer of a step the runtime runs in its lean loop (offload/inline.py: one sub-batch, driver
# calls), what a step costs beyond the GEMVs and the attention bytes: the GPU's small kernels
# (norms, RoPE, merge, the q/k/v and (o, lse) hops), the host's launch of the post segment after
# the CPU's kernel (~45 µs to its start on the device), the event wait. Fitted on the H100 host,
# 2026-11-23 (bench/offload_decode.py runs of 07:00–07:15 UTC, plans held fixed: 100 µs fits the
# bf16 rows, int8's CPU calls cost more than `CPU_ATTENTION_CALL_S` says). The general loop's is
# `planner.cost.GENERAL_LOOP_OVERHEAD_S`.
LAYER_OVERHEAD_S = 150e-6
POOL_BYTES = 512 * 2**20  # per KV dtype in the CPU attention timing: past the host's last-level cache (300 MiB on the H100 host)
# Per CPU attention call (one layer, one sub-batch), whatever its size: the append, the Python
# around the kernel, waking the Numba threads.
CPU_ATTENTION_CALL_S = 100e-6
HOST_KV_DTYPES = tuple(KVDtype(n) for n in warm.HOST_DTYPES)  # the host tier's, each measured
GPU_ATTN_OF_HBM = 0.5  # GPU attention's KV read rate as a share of the HBM copy rate, if unmeasured


@dataclass(frozen=True)
class AttnRate:
    """CPU decode attention: KV bytes read per second for one KV dtype at a thread count."""

    dtype: str
    threads: int
    gbps: float


@dataclass(frozen=True)
class HardwareProfile:
    created: str  # ISO date-time of the measurement
    versions: dict[str, str]
    host_total_bytes: int
    host_available_bytes: int
    physical_cores: int
    logical_cpus: int
    dram_read_gbps: float  # torch.sum over a large array, all physical cores
    cpu_gemv_gbps: float  # matrix-vector on the CPU (dtype: cpu_gemv_dtype), weight bytes / s
    cpu_gflops: float  # dense fp32 matmul on the CPU
    cpu_attention: tuple[AttnRate, ...] = ()
    cpu_gemv_dtype: str = "int8"  # hetero.cpu_linear's kernel; "bf16" when torch.mv measured it
    gpu_name: str | None = None
    gpu_total_bytes: int = 0
    gpu_free_bytes: int = 0
    pcie_h2d_gbps: float = 0.0  # pinned host → device
    pcie_d2h_gbps: float = 0.0  # device → pinned host
    pcie_latency_s: float = 0.0  # one small copy, launch to completion
    hbm_gbps: float = 0.0  # device copy, (read + write bytes) / s
    gpu_attention_gbps: float = 0.0  # decode attention over GPU-resident bf16 KV, KV bytes / s
    gpu_gemv_gbps: float = 0.0  # 4-bit (or bf16, see gpu_gemv_dtype) matrix-vector, weight bytes / s
    gpu_gemv_dtype: str = ""  # "nf4" when the engine's NF4 kernels measured it, else "bf16"
    gpu_gemm_gbps: float = 0.0  # the same weights times 32 rows (a decode batch), weight bytes / s; 0: as gemv
    gpu_tflops: float = 0.0  # dense bf16 matmul
    layer_overhead_s: float = LAYER_OVERHEAD_S
    cpu_attention_call_s: float = CPU_ATTENTION_CALL_S
    notes: tuple[str, ...] = ()

    @property
    def has_gpu(self) -> bool:
        return self.gpu_name is not None

    def cpu_attention_rate(self, dtype: KVDtype, threads: int) -> float:
        """GB/s of `dtype` KV the CPU reads with `threads` threads.

        Between measured thread counts the rate scales linearly from the nearest one below,
        capped by the DRAM read rate; an unmeasured dtype falls back to half the DRAM rate.
        """
        rates = sorted((r for r in self.cpu_attention if r.dtype == dtype.value), key=lambda r: r.threads)
        if not rates:
            return 0.5 * self.dram_read_gbps * min(1.0, threads / max(1, self.physical_cores))
        below = [r for r in rates if r.threads <= threads] or rates[:1]
        r = below[-1]
        return min(r.gbps * threads / r.threads, max(r.gbps, self.dram_read_gbps)) if threads > r.threads \
            else r.gbps * threads / r.threads

    def gpu_linear_gbps(self, rows: int) -> float:
        """Weight bytes / s of a GPU linear over `rows` rows: the GEMV rate up to 2 rows (the engine's
        matrix-vector kernel), the 32-row rate above (another kernel: bitsandbytes' dequantize + GEMM)."""
        return self.gpu_gemm_gbps if rows > 2 and self.gpu_gemm_gbps > 0 else self.gpu_gemv_gbps

    def best_threads(self) -> int:
        return self.physical_cores

    # JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_attention"] = [asdict(r) for r in self.cpu_attention]
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HardwareProfile":
        d = dict(d)
        d["cpu_attention"] = tuple(AttnRate(**r) for r in d.get("cpu_attention", ()))
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        return cls.from_dict(json.loads(text))

    @classmethod
    def synthetic(
        cls, gpu_gib: float | None, pcie_gbps: float = 25.0, dram_gbps: float = 60.0,
        host_gib: float = 64.0, cores: int = 8, hbm_gbps: float = 900.0, gpu_tflops: float = 80.0,
    ) -> "HardwareProfile":
        """A made-up machine for tests and what-if plans: the CPU attends at 80% of DRAM
        (bf16), 70% (int8), 50% (int4, unpacking costs); 4-bit GEMV at 70% of HBM."""
        attn = tuple(
            AttnRate(dt.value, t, dram_gbps * share * t / cores)
            for dt, share in ((KVDtype.BF16, 0.8), (KVDtype.INT8, 0.7), (KVDtype.INT4, 0.5))
            for t in (cores // 2, cores)
        )
        gpu = gpu_gib is not None
        return cls(
            created="synthetic", versions={"format": str(FORMAT)},
            host_total_bytes=int(host_gib * GIB), host_available_bytes=int(host_gib * 0.9 * GIB),
            physical_cores=cores, logical_cpus=2 * cores, dram_read_gbps=dram_gbps,
            cpu_gemv_gbps=0.5 * dram_gbps, cpu_gflops=50.0 * cores, cpu_attention=attn,
            gpu_name=f"synthetic {gpu_gib:g} GiB GPU" if gpu else None,
            gpu_total_bytes=int(gpu_gib * GIB) if gpu else 0,
            gpu_free_bytes=int((gpu_gib - 0.4) * GIB) if gpu else 0,
            pcie_h2d_gbps=pcie_gbps if gpu else 0.0, pcie_d2h_gbps=pcie_gbps if gpu else 0.0,
            pcie_latency_s=10e-6 if gpu else 0.0, hbm_gbps=hbm_gbps if gpu else 0.0,
            gpu_attention_gbps=GPU_ATTN_OF_HBM * hbm_gbps if gpu else 0.0,
            gpu_gemv_gbps=0.7 * hbm_gbps if gpu else 0.0, gpu_gemv_dtype="nf4" if gpu else "",
            gpu_tflops=gpu_tflops if gpu else 0.0,
        )


# ------------------------------------------------------------------------------- caching
def cache_path() -> Path:
    return profile_path()


def load_or_measure(refresh: bool = False, path: Path | None = None) -> HardwareProfile:
    """The cached profile with current free memory, or a fresh measurement (then cached)."""
    path = path or cache_path()
    if not refresh and path.is_file():
        try:
            prof = HardwareProfile.from_json(path.read_text())
            if prof.versions.get("format") == str(FORMAT):
                return current_memory(prof)
            log.info("profile %s is from an older format; measuring again", path)
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("cannot read the cached profile %s (%s); measuring again", path, e)
    prof = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.to_json())
    return prof


def current_memory(prof: HardwareProfile) -> HardwareProfile:
    """The same profile with free GPU and available host memory read now."""
    total, avail = host_memory()
    gpu_free = prof.gpu_free_bytes
    if prof.has_gpu and torch.cuda.is_available():
        gpu_free = torch.cuda.mem_get_info()[0]
    return replace(prof, host_total_bytes=total, host_available_bytes=avail, gpu_free_bytes=gpu_free)


# ------------------------------------------------------------------------------ measuring
def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kib = lambda k: int(info[k].split()[0]) * 1024  # noqa: E731
        return kib("MemTotal"), kib("MemAvailable")
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


def physical_cores() -> tuple[int, int]:
    """(physical cores, logical CPUs) this process may run on."""
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        pairs, phys = set(), None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                phys = line.split(":")[1].strip()
            elif line.startswith("core id"):
                pairs.add((phys, line.split(":")[1].strip()))
        cores = len(pairs) or logical
    except OSError:
        cores = logical
    return max(1, min(cores, logical)), logical


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

    out = {"format": str(FORMAT), "python": platform.python_version(), "torch": torch.__version__,
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
    return {"dram_read_gbps": dram, "cpu_gemv_gbps": gemv, "cpu_gemv_dtype": gemv_dtype, "cpu_gflops": gflops}


def _measure_dram(quick: bool) -> float:
    """GB/s of a streaming read of 512 MiB (torch's sum over the cores)."""
    n = (16 if quick else 512) * 2**20 // 4
    a = torch.ones(n, dtype=torch.float32)
    return n * 4 / _best(lambda: a.sum(), reps=3 if quick else 5) / 1e9


def _cpu_gemv_kernel() -> Callable | None:
    """hetero's int8 CPU GEMV (w [O, I] int8, scale [O] f32, x [N, I] f32, out [N, O] f32),
    compiled or loaded by a small call; None if it is missing."""
    try:
        from hetero.cpu_linear import _gemv_int8
    except ImportError:
        return None
    _gemv_int8(np.ones((8, 64), np.int8), np.ones(8, np.float32), np.ones((1, 64), np.float32),
               np.empty((1, 8), np.float32))
    return _gemv_int8


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
    return (rows * cols + 4 * rows) / _best(lambda: gemv(w, s, xn, out), reps=3 if quick else 5) / 1e9, "int8"


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
    batch-1 decode the host tier mostly serves; int8 read 53 GB/s there and 30 as 16 × 4k, bench
    RESULTS fifth session), with as many layers as make POOL_BYTES of each dtype.

    Each (dtype, thread count) is warmed up on its own, one pass over every layer: the first call
    of a dtype JIT-compiles or loads its kernels, the first at a thread count starts Numba's
    threads, the first touch of a layer faults its pages in. With a single warm-up per dtype the
    second thread count's timings caught that start-up and read bf16 at 3.7 GB/s where the
    engine's steps then ran it at 48–81 (bench/RESULTS.md, fourth session)."""
    import cpu_attention
    from cpu_attention.layout import HostKVPool, token_bytes

    B, T, H, D, BS = (1, 1024, 8, 128, 16) if quick else (1, 16384, 8, 128, 16)
    pool_bytes = (8 if quick else POOL_BYTES // 2**20) * 2**20
    nb = B * T // BS
    q = torch.randn(B, 4 * H, D)
    tables = torch.arange(nb, dtype=torch.int32).reshape(B, -1)
    lens = torch.full((B,), T, dtype=torch.int32)
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

            def call(n: int = n) -> None:
                layer[0] = (layer[0] + 1) % L
                cpu_attention.decode_attention(pool, layer[0], q, tables, lens, D**-0.5, threads=n)

            for _ in range(L):  # warm-up: compile or load, start the threads, touch every layer
                call()
            t = _best(call, reps=3 if quick else 12, budget_s=0.5 if quick else 1.5, warmup=False)
            out.append(AttnRate(dt.value, n, layer_bytes / t / 1e9))
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
    out.update(_measure_gemv(dev, notes, quick))
    s = 2048 if quick else 8192
    a, b = torch.randn(s, s, device=dev, dtype=torch.bfloat16), torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    out["gpu_tflops"] = 2 * s**3 / _best(lambda: a @ b, 5, sync) / 1e12
    del a, b
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    out.update(gpu_total_bytes=total, gpu_free_bytes=free)
    return out


def _measure_gemv(dev: torch.device, notes: list[str], quick: bool) -> dict[str, Any]:
    """A 14336 × 4096 projection (Llama-3-8B's MLP) at 1 and at 32 rows through the engine's own
    NF4 linear (`gpu_ops.nf4.NF4Linear`: our GEMV at ≤ 2 rows, bitsandbytes above), replayed in a
    CUDA graph as the decode step runs it; bf16 weights where bitsandbytes or Triton is missing."""
    from planner.tensors import WDtype

    sync = torch.cuda.synchronize
    rows, cols = (4096, 4096) if quick else (14336, 4096)
    loops = 20
    try:
        import bitsandbytes  # noqa: F401
        import triton  # noqa: F401

        from gpu_ops.nf4 import nf4_linear
        lins = [nf4_linear(torch.randn(rows, cols, device=dev) * 0.02, None, dev) for _ in range(4)]
        nbytes, dtype = WDtype.NF4.nbytes(rows * cols), "nf4"
    except (ImportError, RuntimeError) as e:  # no bitsandbytes / Triton, or no kernels for this GPU
        notes.append(f"NF4 kernels unavailable ({e!r:.80}): GPU linear rates measured in bf16")
        ws = [torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) for _ in range(4)]
        lins = [lambda x, w=w: x @ w.T for w in ws]
        nbytes, dtype = rows * cols * 2, "bf16"
    out = {"gpu_gemv_dtype": dtype}
    for key, m in (("gpu_gemv_gbps", 1), ("gpu_gemm_gbps", 32)):
        x = torch.randn(m, cols, device=dev, dtype=torch.bfloat16)
        run = lambda: [lins[i % 4](x) for i in range(loops)]  # noqa: E731  4 copies: not from L2
        t = _best(_graphed(run, dev), 3, sync)
        out[key] = nbytes * loops / t / 1e9
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