"""NF4 matrix-vector product for decode (1..8 rows of x) on the tensor cores: CUDA C++, via NVRTC.

Why: the Triton GEMV (`gpu_ops.nf4_gemv`) decodes once per row of x and does its multiply-adds
on the CUDA cores, so 5 rows cost 2.5-3x one (a speculative step's). Here the lookup yields bf16
pairs, each pair is scaled by its group's absmax with one bf16x2 multiply, and a warp's
`mma.sync.m16n8k16` does the multiply-adds, x's rows being the MMA's 8 columns: up to 8 rows cost
what one does. At one row both kernels run at 1.3-2.1 TB/s of NF4 on an H200 (HBM ~4 TB/s): the
code-book lookup's integer work bounds them (bench/nf4_tc_probe.py), so one row stays Triton's
(`nf4_gemv.nf4_gemv` routes).

A warp owns 16 rows of W (rows g and g + 8 for lane group g = lane / 4) and steps K by 128 codes:
lane c = lane % 4 loads 16 bytes (4 words, 32 codes) of each of its two rows. One word of row g
and the same word of row g + 8 make the A operand of two MMAs (codes 0-3, then 4-7, standing
at the MMA's k slots 2c, 2c + 1, 2c + 8, 2c + 9); the B operand is x's 8 matching values from
the lane's own row of x (lane group g is x's row g; groups ≥ M hold zeros). The dot product does
not care how K is ordered, only that W and x agree. Scaled weights are bf16(bf16(code)·
bf16(absmax)), as `gpu_ops.nf4_mma` and bitsandbytes' dequantize-then-matmul give; float32 sums.

A block is WR × WK warps: WR 16-row tiles, each split over WK warps along K (their float32 sums
meet in shared memory), so that narrow matrices still fill the GPU. Epilogues as nf4_gemv's:
plain, + residual, SwiGLU (the tile's rows 0-7 are gate rows f..f+7, rows 8-15 the matching up
rows: silu(gate)·up is formed in registers), and the experts' form (a slot per grid row, its
expert's matrix, zeros for slot −1). PDL: the first weights are loaded before the wait.

`q4_tc_gemv` is the same kernel over the linear 4-bit format of `gpu_ops.q4` (FORMAT 1), whose
codes decode by a mask and two float ops instead of the code book's 21 integer ops a word.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging

import torch

from gpu_ops import cuda_rtc, pdl
from gpu_ops.nf4_ptx import prmt_tables

log = logging.getLogger(__name__)
MAX_ROWS = 8

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#if __CUDA_ARCH__ >= 900  // programmatic dependent launch (gpu_ops/pdl.py); a no-op when not launched so
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;")
#else
#define PDL_WAIT()
#define PDL_LAUNCH()
#endif

__device__ __forceinline__ u32 bf16x2(float s) {
    u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(s)); return r;
}
__device__ __forceinline__ u16 to_bf16(float f) {
    u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}
__device__ __forceinline__ float from_bf16(u16 b) { return __uint_as_float((u32)b << 16); }
__device__ __forceinline__ float round_bf16(float f) { return from_bf16(to_bf16(f)); }

__device__ __forceinline__ uint4 load_stream(const u32* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// One int32 of codes (byte p: element 2p in the high nibble, 2p + 1 in the low) → 4 bf16 pairs
// {element 2i (low half), 2i + 1 (high)}, each times s2 (the absmax as bf16x2). The code book's
// high and low bytes are T[0..3] and T[4..7] (gpu_ops/nf4_ptx.py explains the lookup).
__device__ __forceinline__ void decode(u32 q, u32 s2, const u32* T, u32* p) {
    u32 q7 = q & 0x77777777u, q7h = q7 >> 16;
    u32 t = ((q >> 1) & 0x44444444u) | 0x32103210u, th = t >> 16;
    u32 h0 = __byte_perm(__byte_perm(T[0], T[1], q7), __byte_perm(T[2], T[3], q7), t);
    u32 l0 = __byte_perm(__byte_perm(T[4], T[5], q7), __byte_perm(T[6], T[7], q7), t);
    u32 h1 = __byte_perm(__byte_perm(T[0], T[1], q7h), __byte_perm(T[2], T[3], q7h), th);
    u32 l1 = __byte_perm(__byte_perm(T[4], T[5], q7h), __byte_perm(T[6], T[7], q7h), th);
    p[0] = __byte_perm(l0, h0, 0x4051); p[1] = __byte_perm(l0, h0, 0x6273);
    p[2] = __byte_perm(l1, h1, 0x4051); p[3] = __byte_perm(l1, h1, 0x6273);
    const u32 z = 0x80008000u;  // -0, -0: fma(p, s, -0) is an exact product
    #pragma unroll
    for (int i = 0; i < 4; ++i) asm("fma.rn.bf16x2 %0, %0, %1, %2;" : "+r"(p[i]) : "r"(s2), "r"(z));
}

// FORMAT 1 (gpu_ops/q4.py): a word's nibbles i and i + 4 are elements 2i and 2i + 1, a code c
// stands for (c − z) · s. 0x4300 | c is the bf16 of 128 + c exactly; minus 128 + z is c − z
// exactly; times s rounds once: 7 integer ops a word. sz: s (bf16) high, 128 + z (bf16) low.
__device__ __forceinline__ void decode_q4(u32 q, u32 sz, u32* p) {
    const u32 s2 = __byte_perm(sz, 0, 0x3232), nz2 = __byte_perm(sz, 0, 0x1010) ^ 0x80008000u;
    const u32 one = 0x3F803F80u, z = 0x80008000u;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        p[i] = ((q >> (4 * i)) & 0x000F000Fu) | 0x43004300u;
        asm("fma.rn.bf16x2 %0, %0, %1, %2;" : "+r"(p[i]) : "r"(one), "r"(nz2));
        asm("fma.rn.bf16x2 %0, %0, %1, %2;" : "+r"(p[i]) : "r"(s2), "r"(z));
    }
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct Chunk { uint4 qa[U], qb[U]; float sa[U], sb[U]; };

// The U chunks j0, j0 + WK, ... of this lane's two rows (words 16j + 4c .. + 3); past K: zeros,
// scale 0.
__device__ __forceinline__ void load_chunks(Chunk& ch, const u32* w0, const u32* w1, const float* a0,
                                            const float* a1, int j0, int KW, int c) {
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        int j = j0 + u * WK;
        if (16 * j + 4 * c < KW) {
            ch.qa[u] = load_stream(w0 + 16 * j); ch.qb[u] = load_stream(w1 + 16 * j);
            ch.sa[u] = __ldg(a0 + 2 * j); ch.sb[u] = __ldg(a1 + 2 * j);
        } else {
            ch.qa[u] = ch.qb[u] = make_uint4(0, 0, 0, 0); ch.sa[u] = ch.sb[u] = 0.f;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * WR * WK)
nf4_tc(const u32* __restrict__ w, const float* __restrict__ absmax, const u32* __restrict__ x,
       u16* __restrict__ out, const u16* __restrict__ res, const int* __restrict__ eids,
       int N, int KW, int M, int stride_x, int stride_r, long long expert_words, int xdiv, int swiglu,
       u32 T0, u32 T1, u32 T2, u32 T3, u32 T4, u32 T5, u32 T6, u32 T7)
{
    const u32 T[8] = {T0, T1, T2, T3, T4, T5, T6, T7};
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int rt = warp % WR, ks = warp / WR;
    const int s = blockIdx.y;  // the slot (experts), else 0
    if (eids != nullptr) {  // the expert ids come from the routing kernel: read only after the wait
        PDL_WAIT();
        int e = eids[s];
        if (e < 0) {  // an expert another device computes: a zero row
            if (ks == 0 && c == 0) {
                int NO = swiglu ? N / 2 : N, tile = swiglu ? 8 : 16;
                int n = (blockIdx.x * WR + rt) * tile + g;
                for (int r = n; r < n + tile && r < NO; r += 8) out[(u64)s * NO + r] = 0;
            }
            return;
        }
        w += (u64)e * expert_words;
        absmax += (u64)e * (expert_words / 8);
        x += (u64)(s / xdiv) * stride_x;
    }
    int r0, r1, n;
    if (swiglu) {
        const int F = N / 2;
        n = (blockIdx.x * WR + rt) * 8 + g;
        r0 = min(n, F - 1); r1 = r0 + F;
    } else {
        n = (blockIdx.x * WR + rt) * 16 + g;
        r0 = min(n, N - 1); r1 = min(n + 8, N - 1);  // rows past N re-read row N - 1, dropped at the store
    }
    const u32* w0 = w + (u64)r0 * KW + 4 * c;
    const u32* w1 = w + (u64)r1 * KW + 4 * c;
    const float* a0 = absmax + (u64)r0 * (KW / 8) + (c >> 1);
    const float* a1 = absmax + (u64)r1 * (KW / 8) + (c >> 1);
    const u32* xp = x + (u64)g * stride_x + 16 * c;  // this lane group's row of x, as bf16 pairs
    const bool xrow = g < M;
    const int KC = (KW + 15) / 16;  // 128-code chunks

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    Chunk cur, nxt;
    load_chunks(cur, w0, w1, a0, a1, ks, KW, c);
    if (eids == nullptr) PDL_WAIT();
    for (int j0 = ks; j0 < KC; j0 += WK * U) {
        load_chunks(nxt, w0, w1, a0, a1, j0 + WK * U, KW, c);
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u * WK;
            const bool ok = xrow && 16 * j + 4 * c < KW;
#if FORMAT == 1
            const u32 sa = __float_as_uint(cur.sa[u]), sb = __float_as_uint(cur.sb[u]);  // the groups' sz words
#else
            const u32 sa = bf16x2(cur.sa[u]), sb = bf16x2(cur.sb[u]);
#endif
            const u32 qa[4] = {cur.qa[u].x, cur.qa[u].y, cur.qa[u].z, cur.qa[u].w};
            const u32 qb[4] = {cur.qb[u].x, cur.qb[u].y, cur.qb[u].z, cur.qb[u].w};
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 pa[4], pb[4];
#if FORMAT == 1
                decode_q4(qa[i], sa, pa);
                decode_q4(qb[i], sb, pb);
#else
                decode(qa[i], sa, T, pa);
                decode(qb[i], sb, T, pb);
#endif
                uint4 xv = ok ? *reinterpret_cast<const uint4*>(xp + 64 * j + 4 * i) : make_uint4(0, 0, 0, 0);
                mma(acc, pa[0], pb[0], pa[1], pb[1], xv.x, xv.y);
                mma(acc, pa[2], pb[2], pa[3], pb[3], xv.z, xv.w);
            }
        }
        cur = nxt;
    }
    PDL_LAUNCH();

    if (WK > 1) {  // the K-split warps of a tile add up in shared memory
        __shared__ float4 part[WK > 1 ? WK - 1 : 1][WR][32];
        if (ks > 0) part[ks - 1][rt][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        __syncthreads();
        if (ks > 0) return;
        #pragma unroll
        for (int k = 0; k < WK - 1; ++k) {
            float4 p = part[k][rt][lane];
            acc[0] += p.x; acc[1] += p.y; acc[2] += p.z; acc[3] += p.w;
        }
    }
    // acc: [row g][x row 2c], [g][2c + 1], [g + 8][2c], [g + 8][2c + 1]
    if (eids != nullptr) {
        if (c != 0) return;  // one row of x a slot: column 0
        if (swiglu) {
            if (n < N / 2) {
                float gt = round_bf16(acc[0]), up = round_bf16(acc[2]);
                out[(u64)s * (N / 2) + n] = to_bf16(gt / (1.f + __expf(-gt)) * up);
            }
        } else {
            if (n < N) out[(u64)s * N + n] = to_bf16(acc[0]);
            if (n + 8 < N) out[(u64)s * N + n + 8] = to_bf16(acc[2]);
        }
        return;
    }
    #pragma unroll
    for (int mm = 0; mm < 2; ++mm) {
        const int m = 2 * c + mm;
        if (m >= M) break;
        if (swiglu) {
            if (n < N / 2) {
                float gt = round_bf16(acc[mm]), up = round_bf16(acc[2 + mm]);
                out[(u64)m * (N / 2) + n] = to_bf16(gt / (1.f + __expf(-gt)) * up);
            }
            continue;
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = n + 8 * h;
            if (r >= N) continue;
            float y = acc[2 * h + mm];
            if (res != nullptr) y = round_bf16(y) + from_bf16(res[(u64)m * stride_r + r]);
            out[(u64)m * N + r] = to_bf16(y);
        }
    }
}
"""


@dataclasses.dataclass(frozen=True)
class TcConfig:
    """A block of wr × wk warps: wr 16-row tiles, each split over wk warps along K; u chunks
    (128 codes a row) in flight a warp, and as many more being loaded."""

    wr: int
    wk: int
    u: int = 2


def tc_config(tiles: int, chunks: int, sms: int) -> TcConfig:
    """The fastest of bench/nf4_gemv.py's sweep on an H200 at 1 row: wide W (≥ 4 tiles an SM:
    gate_up, lm_head) in blocks of 2 tiles × 2 K-ways with 4 chunks in flight; narrow W (qkv, o,
    down) one tile a block, split 8 ways along K (fewer where K has fewer chunks), 1 chunk in
    flight where each warp has ≤ 4 chunks, else 2."""
    if tiles >= 4 * sms:
        return TcConfig(2, 2, 4)
    wk = 8
    while wk > 1 and chunks < wk:
        wk //= 2
    return TcConfig(1, wk, 1 if chunks <= 4 * wk else 2)


_use = True


def use(on: bool) -> None:
    """Route nf4_gemv to this kernel where the device can run it (the default), or never (A/B)."""
    global _use
    _use = on


def enabled(device: torch.device) -> bool:
    return _use and _builds(device)


@functools.cache
def _builds(device: torch.device) -> bool:
    """Whether the kernel compiles and loads on this device (once; the cubin is cached on disk).
    Where it does not (no NVRTC, an older driver), the Triton GEMV serves, with a warning."""
    if not cuda_rtc.available(device):
        return False
    try:
        for fmt in (0, 1):  # NF4 and the linear q4
            _kernel(TcConfig(1, 8, 1), _SOURCE, fmt).load(device)
    except (OSError, RuntimeError) as e:
        log.warning("the tensor-core NF4 GEMV does not build on %s (%s); the Triton GEMV serves instead", device, e)
        return False
    return True


@functools.cache
def _kernel(cfg: TcConfig, source: str, fmt: int = 0) -> cuda_rtc.Kernel:
    """fmt 0: NF4 (`gpu_ops.nf4`), 1: the linear 4-bit format (`gpu_ops.q4`)."""
    head = f"#define WR {cfg.wr}\n#define WK {cfg.wk}\n#define U {cfg.u}\n#define FORMAT {fmt}\n"
    return cuda_rtc.Kernel(head + source, "nf4_tc")


@functools.cache
def _tables() -> list[ctypes.c_uint]:
    return [ctypes.c_uint(t) for t in prmt_tables()]


@functools.cache
def _sms(device: torch.device) -> int:
    """Multiprocessors of `device` (8 for a CPU: Triton's interpreter), for the 4-bit kernels' launch shapes."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _rows_of_x(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.bfloat16)
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # rows read 16 bytes at a time
        x = x.contiguous()
    return x


def _launch(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor,
            res: torch.Tensor | None, eids: torch.Tensor | None, N: int, K: int, M: int, grid_y: int,
            expert_words: int, xdiv: int, swiglu: bool, config: TcConfig | None, source: str = _SOURCE,
            fmt: int = 0) -> None:
    """source: the kernel's CUDA text (bench/nf4_tc_probe.py times variants of it)."""
    tiles = -(-(N // 2) // 8) if swiglu else -(-N // 16)
    cfg = config or tc_config(tiles, -(-K // 128), _sms(x.device))
    blocks = -(-tiles // cfg.wr)
    null = ctypes.c_void_p(0)
    args = [ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(absmax.data_ptr()), ctypes.c_void_p(x.data_ptr()),
            ctypes.c_void_p(out.data_ptr()), null if res is None else ctypes.c_void_p(res.data_ptr()),
            null if eids is None else ctypes.c_void_p(eids.data_ptr()),
            ctypes.c_int(N), ctypes.c_int(K // 8), ctypes.c_int(M), ctypes.c_int(x.stride(0) // 2),
            ctypes.c_int(0 if res is None else res.stride(0)), ctypes.c_longlong(expert_words),
            ctypes.c_int(xdiv), ctypes.c_int(int(swiglu)), *_tables()]
    _kernel(cfg, source, fmt).launch(x.device, (blocks, grid_y, 1), 32 * cfg.wr * cfg.wk, args, pdl=pdl.enabled(x.device))


def nf4_tc_gemv(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int],
                residual: torch.Tensor | None = None, swiglu: bool = False,
                config: TcConfig | None = None) -> torch.Tensor:
    """`gpu_ops.nf4_gemv.nf4_gemv`'s contract: x [M ≤ 8, K] bf16, W [N, K] NF4 (K a multiple of
    64) → y [M, N] bf16 (+ residual), or silu(x·gateᵀ)·(x·upᵀ) [M, N/2] where swiglu."""
    return _gemv(x, packed, absmax, shape, residual, swiglu, config, 0)


def q4_tc_gemv(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, shape: tuple[int, int],
               residual: torch.Tensor | None = None, swiglu: bool = False,
               config: TcConfig | None = None) -> torch.Tensor:
    """`nf4_tc_gemv` over the linear 4-bit format (`gpu_ops.q4`: packed int32 [N, K/8], sz int32
    [N, K/64]): y = x · bf16((c − z) · s)ᵀ, float32 sums, bf16 out."""
    return _gemv(x, packed, sz, shape, residual, swiglu, config, 1)


def _gemv(x, packed, scales, shape, residual, swiglu, config, fmt) -> torch.Tensor:
    N, K = shape
    M = x.shape[0]
    if K % 64 or not 1 <= M <= MAX_ROWS or (swiglu and (N % 2 or residual is not None)):
        raise ValueError(f"the tensor-core GEMV takes 1..{MAX_ROWS} rows, K divisible by 64 and, with swiglu, "
                         f"an even N and no residual: x {tuple(x.shape)}, W {shape}")
    if residual is not None and (residual.shape != (M, N) or residual.dtype != torch.bfloat16
                                 or residual.stride(-1) != 1):
        raise ValueError(f"residual must be bf16 [{M}, {N}] with unit stride, got {residual.dtype} {tuple(residual.shape)}")
    x = _rows_of_x(x)
    out = torch.empty((M, N // 2 if swiglu else N), dtype=torch.bfloat16, device=x.device)
    _launch(x, packed, scales, out, residual, None, N, K, M, 1, 0, 1, swiglu, config, fmt=fmt)
    return out


def nf4_tc_experts_gemv(x: torch.Tensor, eids: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                        shape: tuple[int, int], xdiv: int, swiglu: bool = False) -> torch.Tensor:
    """`gpu_ops.nf4_gemv.nf4_experts_gemv`'s contract: y[s] = W_{eids[s]} · x[s // xdiv], a zero
    row where eids[s] is −1; eids int32, read on the device."""
    N, K = shape
    if K % 64 or (swiglu and N % 2):
        raise ValueError(f"nf4_tc_experts_gemv needs K divisible by 64 (and an even N with swiglu), got W {shape}")
    x = _rows_of_x(x)
    S = eids.numel()
    out = torch.empty((S, N // 2 if swiglu else N), dtype=torch.bfloat16, device=x.device)
    _launch(x, packed, absmax, out, None, eids.to(torch.int32), N, K, 1, S, N * K // 8, xdiv, swiglu, None)
    return out
