"""The hardware profile's contents: what this machine can do (`HardwareProfile`), the stated
constants the cost model uses beside the measured rates, and the host facts read each time
(memory, cores). Measuring is `planner.measure`'s; caching is `planner.profile`'s."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch

from cpu_attention import warm
from cpu_attention.layout import KVDtype
from planner.plan import Budget, Choice
from planner.tensors import WDtype
from planner.units import format_size as fs

FORMAT = 12  # bump when fields change meaning or the stated constants change; an older cache is then re-measured
GIB = 1024**3
KV_BLOCK = 32  # tokens a KV block: the engine's default, and what the attention rates are measured at

# Stated constants (not measured; bench/offload_decode.py prints predictions beside measurements).
# Per layer of a step the runtime runs in its lean loop (offload/inline.py: one sub-batch, driver
# calls), what a step costs beyond the GEMVs and the attention bytes: the GPU's small kernels
# (norms, RoPE, merge, the q/k/v and (o, lse) hops), the host's launch of the post segment after
# the CPU's kernel (~45 µs to its start on the device), the event wait. Fitted on the H200 host,
# 2026-11-30: six runs of the batch rows 16 × 8k and 32 × 2k (bench/budget.py, three machines):
# the step less its weight GEMVs, the CPU's clock and the hops left 86–131 µs a layer, 115 on
# average (150 before the tiers' merge and the q, k, v copies down became a kernel each, fitted on
# the H100 host's batch-1 rows). The general loop's is `planner.cost.GENERAL_LOOP_OVERHEAD_S`.
LAYER_OVERHEAD_S = 120e-6
POOL_BYTES = 512 * 2**20  # per KV dtype in the CPU attention timing: past the host's last-level cache (300 MiB on the H100 host)
# Per CPU attention call (one layer, one sub-batch), whatever its size: the append, the Python
# around the kernel, waking the Numba threads.
CPU_ATTENTION_CALL_S = 100e-6
HOST_KV_DTYPES = tuple(KVDtype(n) for n in warm.HOST_DTYPES)  # the host tier's, each measured
GPU_ATTN_OF_HBM = 0.5  # GPU attention's KV read rate as a share of the HBM copy rate, if unmeasured


# A run of RUN_ROWS rows of one sequence (a speculative step) on the host tier, against one row,
# where unmeasured: the kernels read the KV once for the run, but its rows' arithmetic grows with
# them, and past a row or two it bounds the call (measured 2.0-3.9x on 2 cores, 3.5-5.8x on 16,
# bench/RESULTS.md "Verifying k rows over one read of the KV").
RUN_ROWS = 8
RUN_COST = 4.0
BATCH_SEQS = 32  # sequences a call in the profile's batch timing (AttnRate.item_s)


@dataclass(frozen=True)
class AttnRate:
    """CPU decode attention: KV bytes read per second for one KV dtype at a thread count, what a
    run of RUN_ROWS rows costs against one row, and seconds a call costs beyond its bytes for each
    (sequence, kv head) past one sequence's (0: not measured)."""

    dtype: str
    threads: int
    gbps: float
    run_cost: float = 0.0
    item_s: float = 0.0


GEMV_ROWS = 8  # rows the GPU's matrix-vector kernel takes at one row's cost (gpu_ops.nf4.GEMV_TC_ROWS)


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
    cpu_gemv_dtype: str = "int8"  # cpu_attention.linear's kernel; "bf16" when torch.mv measured it
    cpu_experts_gbps: float = 0.0  # int4 experts (cpu_attention.experts), weight bytes / s; 0: not measured
    gpu_name: str | None = None
    gpu_total_bytes: int = 0
    gpu_free_bytes: int = 0
    pcie_h2d_gbps: float = 0.0  # pinned host → device
    pcie_d2h_gbps: float = 0.0  # device → pinned host
    pcie_latency_s: float = 0.0  # one small copy, launch to completion
    hbm_gbps: float = 0.0  # device copy, (read + write bytes) / s
    gpu_attention_gbps: float = 0.0  # decode attention over GPU-resident bf16 KV, KV bytes / s
    gpu_attention_int8_gbps: float = 0.0  # the engine's paged kernel over int8 device blocks (0: not measured)
    gpu_attention_int4_gbps: float = 0.0  # ... over int4 device blocks
    gpu_gemv_gbps: float = 0.0  # 4-bit (or bf16, see gpu_gemv_dtype) matrix-vector, weight bytes / s
    gpu_gemv_dtype: str = ""  # "nf4" when the engine's NF4 kernels measured it, else "bf16"
    gpu_gemm_gbps: float = 0.0  # the same weights times 32 rows (a decode batch), weight bytes / s; 0: as gemv
    gpu_gemv_q4_gbps: float = 0.0  # the linear q4 format (gpu_ops.q4) at 1 row; 0: not measured (NF4's rates)
    gpu_gemm_q4_gbps: float = 0.0  # ... at 32 rows
    gpu_tflops: float = 0.0  # dense bf16 matmul
    layer_overhead_s: float = LAYER_OVERHEAD_S
    cpu_attention_call_s: float = CPU_ATTENTION_CALL_S
    notes: tuple[str, ...] = ()

    @property
    def has_gpu(self) -> bool:
        return self.gpu_name is not None

    def cpu_run_cost(self, dtype: KVDtype, threads: int, rows: int) -> float:
        """A run of `rows` rows of one sequence on the host tier against one row's time: linear
        between one row and the RUN_ROWS measured (at the nearest thread count below)."""
        if rows <= 1:
            return 1.0
        r = self._attn_at(dtype, threads)
        r8 = (r.run_cost if r else 0.0) or RUN_COST
        return 1.0 + (rows - 1) * (r8 - 1.0) / (RUN_ROWS - 1)

    def cpu_items_seconds(self, dtype: KVDtype, threads: int, seqs: int, kv_heads: int) -> float:
        """What a host-tier call over `seqs` sequences costs beyond its bytes (and beyond one
        sequence's): (seqs − 1) · kv_heads · the measured seconds a (sequence, kv head)."""
        r = self._attn_at(dtype, threads)
        return max(0, seqs - 1) * kv_heads * (r.item_s if r else 0.0)

    def _attn_at(self, dtype: KVDtype, threads: int) -> AttnRate | None:
        """The CPU attention timing of `dtype` at the nearest measured thread count below `threads`."""
        rates = sorted((r for r in self.cpu_attention if r.dtype == dtype.value), key=lambda r: r.threads)
        below = [r for r in rates if r.threads <= threads] or rates[:1]
        return below[-1] if below else None

    def cpu_attention_rate(self, dtype: KVDtype, threads: int) -> float:
        """GB/s of `dtype` KV the CPU reads with `threads` threads.

        Between measured thread counts the rate scales linearly from the nearest one below,
        capped by the DRAM read rate; an unmeasured dtype falls back to half the DRAM rate.
        """
        r = self._attn_at(dtype, threads)
        if r is None:
            return 0.5 * self.dram_read_gbps * min(1.0, threads / max(1, self.physical_cores))
        return min(r.gbps * threads / r.threads, max(r.gbps, self.dram_read_gbps)) if threads > r.threads \
            else r.gbps * threads / r.threads

    @property
    def cpu_experts_rate(self) -> float:
        """GB/s of int4 expert weights the CPU computes over (unmeasured: the GEMV rate)."""
        return self.cpu_experts_gbps or self.cpu_gemv_gbps

    def gpu_attention_rate(self, dtype: KVDtype) -> float:
        """KV bytes / s the GPU's decode attention reads of `dtype` blocks (unmeasured: the bf16 rate)."""
        rate = {KVDtype.INT8: self.gpu_attention_int8_gbps, KVDtype.INT4: self.gpu_attention_int4_gbps}.get(dtype, 0.0)
        return rate or self.gpu_attention_gbps

    def gpu_linear_gbps(self, rows: int, dtype: WDtype = WDtype.NF4) -> float:
        """Weight bytes / s of a GPU linear in `dtype` over `rows` rows: the GEMV rate up to 8 rows
        (the engine's matrix-vector kernels: up to 8 rows cost what one does, gpu_ops.nf4_tc), the
        32-row rate above (another kernel: the 4-bit tensor-core matmul or dequantize + GEMM). The
        linear q4 format at its own measured rates (NF4's where unmeasured)."""
        gemv, gemm = (self.gpu_gemv_q4_gbps, self.gpu_gemm_q4_gbps) if dtype is WDtype.Q4 and self.gpu_gemv_q4_gbps \
            else (self.gpu_gemv_gbps, self.gpu_gemm_gbps)
        return gemm if rows > GEMV_ROWS and gemm > 0 else gemv

    def gpu_4bit(self, rows: int) -> WDtype:
        """The GPU's faster 4-bit format for a decode step of `rows` rows, as measured: q4 (decoded
        by arithmetic) where its linear beat NF4's (decoded by table lookups) at those rows, else
        NF4. (H200: q4 2132 against 1486 GB/s at 1 row, but 500 against 829 at 32.)"""
        q4 = self.gpu_gemv_q4_gbps and self.gpu_linear_gbps(rows, WDtype.Q4) > self.gpu_linear_gbps(rows, WDtype.NF4)
        return WDtype.Q4 if q4 else WDtype.NF4

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
            created="synthetic", versions={"format": str(FORMAT), "kernels": kernels_version()},
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


def kernels_version() -> str:
    """A digest of the installed CPU kernels' sources: rates measured with other kernels are stale."""
    import hashlib

    import cpu_attention

    h = hashlib.sha1()
    for f in sorted(Path(cpu_attention.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def implausible(prof: HardwareProfile) -> list[str]:
    """Figures of a profile that disagree with the same profile's others (a busy machine while it
    measured): a CPU attention rate far below the same dtype's at fewer threads or above DRAM's."""
    out = []
    for r in prof.cpu_attention:
        fewer = [x for x in prof.cpu_attention if x.dtype == r.dtype and x.threads < r.threads]
        best = max((x.gbps for x in fewer), default=0.0)
        if best and r.gbps < 0.5 * best:
            out.append(f"CPU attention {r.dtype} × {r.threads} threads read {r.gbps:.2f} GB/s, less than half "
                       f"of {best:.2f} GB/s at fewer threads")
        if prof.dram_read_gbps and r.gbps > 2 * prof.dram_read_gbps:
            out.append(f"CPU attention {r.dtype} × {r.threads} threads read {r.gbps:.1f} GB/s, over twice "
                       f"the DRAM read rate ({prof.dram_read_gbps:.1f} GB/s)")
    out += [n for n in prof.notes if "busy" in n]
    return out


def current_memory(prof: HardwareProfile) -> HardwareProfile:
    """The same profile with free GPU and available host memory read now."""
    total, avail = host_memory()
    gpu_free = prof.gpu_free_bytes
    if prof.has_gpu and torch.cuda.is_available():
        gpu_free = torch.cuda.mem_get_info()[0]
    return replace(prof, host_total_bytes=total, host_available_bytes=avail, gpu_free_bytes=gpu_free)



def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    vm = psutil.virtual_memory()
    return vm.total, vm.available


def physical_cores() -> tuple[int, int]:
    """(physical cores, logical CPUs) this process may run on."""
    logical = len(psutil.Process().cpu_affinity() or []) or psutil.cpu_count() or 1
    return max(1, min(psutil.cpu_count(logical=False) or logical, logical)), logical


def estimate() -> HardwareProfile:
    """This host's memory and cores with stated rates in place of measured ones (no GPU): enough to
    place a model on the CPU, whose choices do not depend on the rates; its predictions are rough
    (`hetero profile` measures)."""
    total, avail = host_memory()
    cores, logical = physical_cores()
    prof = HardwareProfile.synthetic(None, host_gib=total / GIB, cores=cores)
    return replace(prof, created="estimated", host_available_bytes=avail, logical_cpus=logical,
                   notes=("estimated, not measured: `hetero profile` measures this machine",))


def default_budget(hw: HardwareProfile) -> tuple[Budget, list[Choice]]:
    """Free memory minus a margin: GPU max(512 MiB, 5%), host max(2 GiB, 10%)."""
    gpu_margin = max(512 * 2**20, hw.gpu_total_bytes // 20)
    host_margin = max(2 * GIB, hw.host_total_bytes // 10)
    b = Budget(max(0, hw.gpu_free_bytes - gpu_margin), max(0, hw.host_available_bytes - host_margin))
    ch = [Choice("--cpu-mem", fs(b.host_bytes), f"{fs(hw.host_available_bytes)} available minus a {fs(host_margin)} margin")]
    if hw.has_gpu:
        ch.insert(0, Choice("--gpu-mem", fs(b.gpu_bytes), f"{fs(hw.gpu_free_bytes)} free minus a {fs(gpu_margin)} margin"))
    return b, ch
