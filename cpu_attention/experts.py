"""Mixture-of-experts layers' host-resident experts, computed by the CPU (Numba, `experts_kernels`).

Format (int4, per expert matrix W [O, I], I a multiple of 64): a float32 scale per 64 weights
(max |w| / 7) and 4-bit codes c = round(w / scale) + 8 in 0..15, two a byte; of a group's 64
weights, byte j holds weight j in its low nibble and weight 32 + j in its high one, so a group's
two halves multiply two contiguous runs of x. 0.5625 bytes a weight, as NF4. `quantize_int4` runs
on any torch device (a GPU quantizes a model's experts as it loads), `dequantize_int4` is the twin.

`HostExperts` holds one layer's host experts stacked ([E, 2F, I/2] gate/up, [E, H, F/2] down);
`__call__` computes them for a batch (tokens, and per token the host's expert index of each routed
slot, −1 for slots that are not the host's), and `descriptor` gives the same call for the C entry
point. `Scratch` is what a call needs besides the weights (one serves every layer). `experts_ref` is the torch twin (float32 or float64).
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch
import torch.nn.functional as F

GROUP = 64


@functools.cache
def _kernels():
    from cpu_attention import _numba, experts_kernels

    _numba.configure()
    return experts_kernels


@functools.cache
def tsc_hz() -> float:
    """Time-stamp cycles a second (the C entry point's clock), measured once over 20 ms."""
    from numba import njit

    cycles = _kernels().cycles
    read = njit(lambda: cycles())  # noqa: E731
    c0, t0 = read(), time.perf_counter()
    time.sleep(0.02)
    return (read() - c0) / (time.perf_counter() - t0)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] (any device) → (codes uint8 [O, I/2], scale float32 [O, I/64]) on w's device; a
    piece of 2^22 weights at a time, so a GPU near its budget needs little room for it."""
    O, I = w.shape
    if I % GROUP:
        raise ValueError(f"int4 experts need rows of a multiple of {GROUP} weights, got {I}")
    codes = torch.empty(O, I // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(O, I // GROUP, dtype=torch.float32, device=w.device)
    step = max(1, 2**22 // I)
    for a in range(0, O, step):
        g = w[a: a + step].to(torch.float32, copy=True).reshape(-1, I // GROUP, GROUP)  # (divided in place)
        s = g.abs().amax(-1).clamp_min_(1e-30).div_(7)
        c = g.div_(s[..., None]).round_().clamp_(-8, 7).add_(8).to(torch.uint8)
        codes[a: a + step] = (c[..., :32] | (c[..., 32:] << 4)).reshape(-1, I // 2)
        scale[a: a + step] = s
    return codes, scale


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize_int4` → W [O, I] in dtype."""
    O = codes.shape[0]
    c = codes.reshape(O, -1, 32)
    q = torch.cat([c & 15, c >> 4], dim=-1).to(dtype) - 8
    return (q * scale.to(dtype)[..., None]).reshape(O, -1)


def quantize_rows_int8(x: torch.Tensor) -> torch.Tensor:
    """x [N, I] → x as the integer kernel sees it (`experts_kernels._quantize`): each group of 64
    rounded to int8 steps of max |x| / 127, in float32 as the kernel computes them; in x's dtype."""
    g = x.float().reshape(x.shape[0], -1, GROUP)
    m = g.abs().amax(-1, keepdim=True)
    s = torch.where(m > 0, m / 127, torch.ones_like(m))
    return ((g * (1 / s)).round() * s).reshape(x.shape).to(x.dtype)


def experts_ref(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gu_q, gu_s, d_q, d_s,
                quantized: bool = False) -> torch.Tensor:
    """The torch twin: x [N, H], ids [N, k] host expert index or −1, w [N, k] → [N, H] in x's dtype
    (float32 or float64), from the dequantized weights. quantized: x and the activations rounded to
    int8 a group first, as the integer kernel does (`quantize_rows_int8`)."""
    out = torch.zeros_like(x)
    dt = x.dtype
    q = quantize_rows_int8 if quantized else (lambda v: v)
    for n, s in (ids >= 0).nonzero().tolist():
        e = int(ids[n, s])
        g, u = (q(x[n: n + 1])[0] @ dequantize_int4(gu_q[e], gu_s[e], dt).T).chunk(2)
        act = (F.silu(g) * u)[None]
        out[n] += w[n, s].to(dt) * (q(act)[0] @ dequantize_int4(d_q[e], d_s[e], dt).T)
    return out


class Scratch:
    """What a call needs besides the weights, for up to `max_rows` tokens of top-k routing; one
    serves every layer (their calls run one at a time)."""

    def __init__(self, max_rows: int, top_k: int, hidden: int, inter: int, max_experts: int):
        P = max_rows * top_k
        self.max_rows = max_rows
        self.tok, self.pws = np.zeros(P, np.int64), np.zeros(P, np.int64)
        self.starts, self.gexp = np.zeros(max_experts + 1, np.int64), np.zeros(max(max_experts, 1), np.int64)
        self.act = np.zeros((P, inter), np.float32)
        self.xsum, self.asum = np.zeros((max_rows, hidden // GROUP), np.float32), np.zeros((P, inter // GROUP), np.float32)
        self.xq, self.aq = np.zeros((max_rows, hidden), np.int8), np.zeros((P, inter), np.int8)
        self.xcorr, self.acorr = np.zeros((max_rows, hidden // 8), np.int32), np.zeros((P, inter // 8), np.int32)
        # the calls through the C entry point: [0] their time-stamp cycles, [1] the (token, expert)
        # pairs they computed (and those of the calls from Python)
        self.cycles = np.zeros(2, np.int64)
        self.pool = None  # an experts_pool.ExpertsPool: the C entry point's calls run on it
        self.seconds = 0.0  # time of the calls made from Python

    def take_seconds(self) -> float:
        """The calls' time since the last take (the C entry point's cycles at `tsc_hz`)."""
        n = int(self.cycles[0])
        self.cycles[0] -= n
        t, self.seconds = self.seconds + n / tsc_hz(), 0.0
        return t

    def take_pairs(self) -> int:
        """The (token, expert) pairs the calls computed since the last take: each one expert's
        weights read (its bytes: `HostExperts.nbytes` / its experts)."""
        n = int(self.cycles[1])
        self.cycles[1] -= n
        return n


class HostExperts:
    """One layer's experts that the host holds: `experts` (their indices in the layer, ascending)
    stacked in the int4 format."""

    def __init__(self, experts: list[int], hidden: int, inter: int, top_k: int, threads: int, zeros=np.zeros):
        """zeros(shape, dtype) → the arrays' memory (page-locked where a GPU copies them up)."""
        E = len(experts)
        self.experts, self.H, self.F, self.k, self.threads = list(experts), hidden, inter, top_k, threads
        self.gu_q = zeros((E, 2 * inter, hidden // 2), np.uint8)
        self.gu_s = zeros((E, 2 * inter, hidden // GROUP), np.float32)
        self.d_q = zeros((E, hidden, inter // 2), np.uint8)
        self.d_s = zeros((E, hidden, inter // GROUP), np.float32)
        self._descriptors: dict[tuple[int, ...], np.ndarray] = {}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.gu_q, self.gu_s, self.d_q, self.d_s))

    def set(self, j: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Store the j-th held expert from its float weights (gate_up [2F, H], down [H, F]; any device)."""
        for (q, s), (qd, sd) in (((self.gu_q, self.gu_s), quantize_int4(gate_up)), ((self.d_q, self.d_s), quantize_int4(down))):
            q[j] = qd.cpu().numpy()
            s[j] = sd.cpu().numpy()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(a) for a in (self.gu_q, self.gu_s, self.d_q, self.d_s))

    def __call__(self, x: np.ndarray, ids: np.ndarray, w: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        """out [N, H] f32 = this layer's host experts over x [N, H] f32 for the slots ids [N, k] int32
        (the host's index, −1: another device's), weighted by w [N, k] f32."""
        self._check(x.shape[0], scratch)
        from cpu_attention._numba import resolve_threads

        resolve_threads(self.threads)
        sc = scratch
        kn = _kernels()
        t = time.perf_counter()
        sc.cycles[1] += kn.run(x, ids, w, self.gu_q, self.gu_s, self.d_q, self.d_s, sc.tok, sc.pws, sc.starts, sc.gexp,
                               sc.act, out, sc.xsum, sc.asum, sc.xq, sc.xcorr, sc.aq, sc.acorr,
                               kn.vnni_shapes(self.H, self.F))
        sc.seconds += time.perf_counter() - t

    def _check(self, rows: int, scratch: Scratch) -> None:
        if rows > scratch.max_rows or len(self.experts) > scratch.gexp.shape[0]:
            raise ValueError(f"{rows} rows over {len(self.experts)} experts: more than the scratch was sized for "
                             f"({scratch.max_rows} rows, {scratch.gexp.shape[0]} experts)")

    def descriptor(self, x: np.ndarray, ids: np.ndarray, w: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        """The int64 descriptor of the call `self(x, ids, w, out, scratch)` for the C entry point
        (`experts_pool.ExpertsPool.entry_address` where the scratch has a pool, else
        `experts_kernels.entry_address`); the arrays must outlive every use of it (pinned buffers
        a captured graph keeps using), so it is kept here, one per set of buffers and rows."""
        self._check(x.shape[0], scratch)
        kn = _kernels()
        key = (x.ctypes.data, ids.ctypes.data, w.ctypes.data, out.ctypes.data, x.shape[0], id(scratch))
        d = self._descriptors.get(key)
        if d is None:
            d = np.zeros(kn.FIELDS, np.int64)
            sc = scratch
            vals = {kn.N_: x.shape[0], kn.K_: self.k, kn.H_: self.H, kn.F_: self.F, kn.E_: len(self.experts),
                    kn.THREADS_: self.threads, kn.VNNI_: int(kn.vnni_shapes(self.H, self.F))}
            arrays = {kn.X_: x, kn.IDS_: ids, kn.W_: w, kn.GUQ_: self.gu_q, kn.GUS_: self.gu_s, kn.DQ_: self.d_q,
                      kn.DS_: self.d_s, kn.TOK_: sc.tok, kn.PWS_: sc.pws, kn.STARTS_: sc.starts,
                      kn.GEXP_: sc.gexp, kn.ACT_: sc.act, kn.OUT_: out, kn.XSUM_: sc.xsum,
                      kn.ASUM_: sc.asum, kn.XQ_: sc.xq, kn.XCORR_: sc.xcorr, kn.AQ_: sc.aq, kn.ACORR_: sc.acorr,
                      kn.CYCLES_: sc.cycles}
            d[kn.POOL_] = sc.pool.address if sc.pool is not None else 0
            for i, v in vals.items():
                d[i] = v
            for i, a in arrays.items():
                if not a.flags.c_contiguous:
                    raise ValueError("the host experts' arrays must be contiguous")
                d[i] = a.ctypes.data
            self._descriptors[key] = d
        return d


def timing_layers(layers: int, experts: int, hidden: int, inter: int, top_k: int, threads: int,
                  huge_pages: bool = True) -> list[HostExperts]:
    """`layers` layers' worth of `experts` int4 host experts with fixed codes and scales (their values
    do not change a call's time): what the profile and the benchmarks cycle over, past the
    last-level cache, to time the kernel at DRAM's rate. In 2 MiB pages where the OS gives them,
    as the engine's are (`host_memory`; huge_pages=False: numpy's)."""
    zeros = np.zeros
    if huge_pages:
        from cpu_attention import host_memory

        zeros = lambda shape, dt: host_memory.zeros(shape, torch.from_numpy(np.zeros(0, dt)).dtype).numpy()  # noqa: E731
    sets = [HostExperts(list(range(experts)), hidden, inter, top_k, threads=threads, zeros=zeros)
            for _ in range(layers)]
    for he in sets:
        he.gu_q.fill(0x5A)
        he.d_q.fill(0xA5)
        he.gu_s.fill(0.01)
        he.d_s.fill(0.01)
    return sets
