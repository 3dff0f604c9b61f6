"""4-bit weights in the bitsandbytes NF4 layout, and the linear layer over them (`NF4Linear`; its
`codes` may also be the linear q4 of `gpu_ops.q4`, kept in the same two tensors).

Format (one format, on disk and in memory, whatever kernel reads it):

    packed  uint8    [ceil(N*K / 2)]   the row-major flattened weight [N, K], two codes a byte:
                                       element 2i in the HIGH nibble, 2i+1 in the low one
    absmax  float32  [ceil(N*K / 64)]  max |w| of each run of 64 consecutive elements
    w ≈ NF4_CODE[code] * absmax[flat_index // 64]

This is exactly what `bitsandbytes.functional.quantize_4bit(w, blocksize=64, quant_type="nf4",
compress_statistics=False)` produces, so its CUDA kernels read our tensors unchanged; the pure
torch quantize/dequantize below is the reference twin and the CPU fallback.
"""
from __future__ import annotations

import enum
import functools
import math

import torch
import torch.nn.functional as F

from gpu_ops import nf4_tc
from gpu_ops.nf4_code import BLOCK, NF4_CODE
from gpu_ops.q4 import dequantize_q4, quantize_q4

_MIDS = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2  # decision thresholds: nearest code wins
_CHUNK = 1 << 24  # elements quantized at a time, to bound the float32 temporaries


@functools.cache
def _on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(NF4_CODE, _MIDS) on `device`, copied once (a copy inside a CUDA graph capture would fail)."""
    return NF4_CODE.to(device), _MIDS.to(device)


def quantize_nf4(w: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype, any device) → (packed uint8 [ceil(N*K/2)], absmax float32 [ceil(N*K/64)]) on
    `device` (default: w's). A piece of _CHUNK values at a time goes there and is quantized, so a
    matrix on the host never needs its whole float copy on the device (a 1 GB lm_head under --gpu-mem)."""
    device = w.device if device is None else torch.device(device)
    flat = w.reshape(-1)
    n = flat.numel()
    nblocks = math.ceil(n / BLOCK)
    packed = torch.empty((nblocks * BLOCK) // 2, dtype=torch.uint8, device=device)
    absmax = torch.empty(nblocks, dtype=torch.float32, device=device)
    mids = _on(device)[1]
    for s in range(0, nblocks * BLOCK, _CHUNK):
        x = flat[s: s + _CHUNK].to(device).float()
        if x.numel() % BLOCK:  # the last block is partial: pad with zeros (they do not move absmax)
            x = F.pad(x, (0, BLOCK - x.numel() % BLOCK))
        x = x.view(-1, BLOCK)
        amax = x.abs().amax(1)
        b0 = s // BLOCK
        absmax[b0: b0 + x.shape[0]] = amax
        codes = torch.bucketize(x / amax.clamp_min(1e-30)[:, None], mids).to(torch.uint8).view(-1)
        packed[s // 2: s // 2 + codes.numel() // 2] = (codes[0::2] << 4) | codes[1::2]
    return packed[: math.ceil(n / 2)], absmax


def dequantize_nf4(
    packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_nf4` → w [N, K] in `dtype`."""
    n = shape[0] * shape[1]
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1).view(-1)[:n].long()
    scale = absmax.repeat_interleave(BLOCK)[:n]
    return (_on(packed.device)[0][codes] * scale).view(shape).to(dtype)


class Codes(str, enum.Enum):
    """What a 4-bit linear's codes stand for; both keep 4 bits a weight and 4 bytes a group of 64 in
    `packed` and `absmax` (so the weight cache, streaming and stacking move either unchanged)."""

    NF4 = "nf4"  # the NF4 code book times the group's absmax (bitsandbytes' format, this module's doc)
    Q4 = "q4"  # linear: (c − z) · s (gpu_ops.q4; packed holds its int32 words, absmax its sz words)


class Nf4Kernel(str, enum.Enum):
    AUTO = "auto"  # cuda: GEMV for ≤ 2 rows (≤ 8 with nf4_tc), MMA to 64, else bitsandbytes; cpu: torch
    BNB = "bnb"  # bitsandbytes' CUDA kernels (gemv for 1 row, gemm / dequant + cuBLAS above)
    TRITON = "triton"  # gpu_ops.nf4_triton: one-row gemv, else fused dequant + tensor-core matmul
    GEMV = "gemv"  # gpu_ops.nf4_gemv for ≤ 8 rows (decode), bitsandbytes above
    MMA = "mma"  # gpu_ops.nf4_mma (W4A16 tensor cores) for ≤ 64 rows, bitsandbytes above
    TORCH = "torch"  # dequantize, then F.linear: the reference, and the CPU path


GEMV_K_MULTIPLE = 256  # the Triton one-row kernel steps K by 4 groups of 64
# Rows that AUTO sends to nf4_mma: measured on an H100 (bench/nf4_mma.py), its sum over a Llama-3-8B
# step's linears beats nf4_gemv and bitsandbytes at every row count from 4 to 64 (3.8 ms vs 6.1
# and 10.6 at 4 rows, 4.2 vs 12.6 bnb at 32); ≤ 2 rows stay with nf4_gemv (the fused decode layer).
MMA_AUTO_ROWS = range(3, 65)
# Rows the tensor-core GEMV (gpu_ops.nf4_tc) takes where the device runs it: up to 8 cost what one
# does (bench/nf4_gemv.py: 5 rows of a Llama-3-8B step's linears 2.64 ms on an H200, 1 row 2.58;
# nf4_mma took 3.8 at 4 rows on an H100)
GEMV_TC_ROWS = 8


class NF4Linear:
    """y = x @ W.T (+ b) with W [N, K] stored as NF4 (see the module docstring)."""

    def __init__(
        self,
        packed: torch.Tensor,
        absmax: torch.Tensor,
        shape: tuple[int, int],
        bias: torch.Tensor | None = None,
        kernel: Nf4Kernel = Nf4Kernel.AUTO,
        compute_dtype: torch.dtype = torch.bfloat16,
        codes: Codes = Codes.NF4,
    ):
        if codes is Codes.Q4 and kernel in (Nf4Kernel.BNB, Nf4Kernel.TRITON):
            raise ValueError(f"the {kernel.value} kernels read NF4 codes only, not {codes.value}")
        self.packed, self.absmax, self.bias, self.codes = packed, absmax, bias, codes
        self.out_features, self.in_features = shape
        self.shape = (int(shape[0]), int(shape[1]))
        self.compute_dtype = compute_dtype  # cuda only: the CPU path computes in x's dtype
        self.kernel = kernel
        self.gemv_config: tuple[int, int, int, int] | None = None  # nf4_gemv's tiles; None: its default
        self._bnb_state = None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 4 * self.absmax.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _KERNELS[self.pick(x.shape[0])](self, x)

    def pick(self, rows: int) -> Nf4Kernel:
        if self.device.type != "cuda":
            return Nf4Kernel.TORCH
        if self.kernel is Nf4Kernel.AUTO:  # measured (bench/nf4_gemv.py, bench/nf4_mma.py): the GEMV
            # at 1-2 rows (1-8 with nf4_tc), nf4_mma to 64, bitsandbytes (dequantize + cuBLAS) above
            if self.codes is Codes.Q4:  # the tensor-core GEMV up to 8 rows, nf4_mma to 64, then torch
                if rows <= GEMV_TC_ROWS and nf4_tc.enabled(self.device):
                    return Nf4Kernel.GEMV
                return Nf4Kernel.MMA if rows <= MMA_AUTO_ROWS.stop - 1 else Nf4Kernel.TORCH
            if self.in_features % BLOCK:
                return Nf4Kernel.BNB
            if rows <= 2 or rows <= GEMV_TC_ROWS and nf4_tc.enabled(self.device):
                return Nf4Kernel.GEMV
            return Nf4Kernel.MMA if rows in MMA_AUTO_ROWS else Nf4Kernel.BNB
        return self.kernel

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.codes is Codes.Q4:
            words, sz = self.q4_words()
            if self.device.type == "cuda":  # one kernel, bf16 out (a prefill's matmul: `_torch_linear`)
                from gpu_ops.q4_triton import dequantize_q4_gpu

                return dequantize_q4_gpu(words, sz).to(dtype)
            return dequantize_q4(words, sz, dtype)
        return dequantize_nf4(self.packed, self.absmax, self.shape, dtype)

    def q4_words(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes.Q4's tensors as gpu_ops.q4 shapes them: packed int32 [N, K/8], sz int32 [N, K/64]."""
        N, K = self.shape
        return self.packed.view(torch.int32).view(N, K // 8), self.absmax.view(torch.int32).view(N, K // BLOCK)

    def bnb_state(self):
        if self._bnb_state is None:
            from bitsandbytes.functional import QuantState

            self._bnb_state = QuantState(
                absmax=self.absmax, shape=torch.Size(self.shape), code=_on(self.device)[0],
                blocksize=BLOCK, quant_type="nf4", dtype=self.compute_dtype,
            )
        return self._bnb_state


def _torch_linear(lin: NF4Linear, x: torch.Tensor) -> torch.Tensor:
    dt = x.dtype if lin.device.type == "cpu" else lin.compute_dtype
    b = None if lin.bias is None else lin.bias.to(dt)
    return F.linear(x.to(dt), lin.dequantize(dt), b)


def _bnb_linear(lin: NF4Linear, x: torch.Tensor) -> torch.Tensor:
    import bitsandbytes as bnb

    b = None if lin.bias is None else lin.bias.to(lin.compute_dtype)
    return bnb.matmul_4bit(x.to(lin.compute_dtype), lin.packed.view(-1, 1), quant_state=lin.bnb_state(), bias=b)


def _fallback(lin: NF4Linear, x: torch.Tensor) -> torch.Tensor:
    """Past a kernel's rows: bitsandbytes for NF4, dequantize + matmul for Q4."""
    return _bnb_linear(lin, x) if lin.codes is Codes.NF4 else _torch_linear(lin, x)


def _gemv_linear(lin: NF4Linear, x: torch.Tensor) -> torch.Tensor:
    from gpu_ops.nf4_gemv import MAX_ROWS, nf4_gemv

    if x.shape[0] > MAX_ROWS or lin.in_features % BLOCK:
        return _fallback(lin, x)
    if lin.codes is Codes.Q4:
        y = nf4_tc.q4_tc_gemv(x, *lin.q4_words(), lin.shape)
    else:
        y = nf4_gemv(x, lin.packed, lin.absmax, lin.shape, config=lin.gemv_config)
    return y if lin.bias is None else y + lin.bias.to(y.dtype)


def _mma_linear(lin: NF4Linear, x: torch.Tensor) -> torch.Tensor:
    from gpu_ops.nf4_gemv import Decode
    from gpu_ops.nf4_mma import MAX_ROWS, nf4_mma

    if x.shape[0] > MAX_ROWS or lin.in_features % BLOCK:
        return _fallback(lin, x)
    if lin.codes is Codes.Q4:
        words, sz = lin.q4_words()
        y = nf4_mma(x, words, sz, lin.shape, decode=Decode.LINEAR)
    else:
        y = nf4_mma(x, lin.packed, lin.absmax, lin.shape)
    return y if lin.bias is None else y + lin.bias.to(y.dtype)


def _triton_linear(lin: NF4Linear, x: torch.Tensor) -> torch.Tensor:
    from gpu_ops.nf4_triton import nf4_gemv, nf4_matmul

    fn = nf4_gemv if x.shape[0] == 1 and lin.in_features % GEMV_K_MULTIPLE == 0 else nf4_matmul
    y = fn(x.to(lin.compute_dtype), lin.packed, lin.absmax, lin.shape)
    return y if lin.bias is None else y + lin.bias.to(y.dtype)


_KERNELS = {Nf4Kernel.TORCH: _torch_linear, Nf4Kernel.BNB: _bnb_linear, Nf4Kernel.TRITON: _triton_linear,
            Nf4Kernel.GEMV: _gemv_linear, Nf4Kernel.MMA: _mma_linear}


def codes_for(codes: Codes, shape: tuple[int, int]) -> Codes:
    """Q4 takes whole groups of K; a matrix whose K is not a multiple of 64 keeps NF4 (flat blocks)."""
    return Codes.NF4 if shape[1] % BLOCK else codes


def nf4_linear(w: torch.Tensor, b: torch.Tensor | None, device: torch.device,
               kernel: Nf4Kernel = Nf4Kernel.AUTO, codes: Codes = Codes.NF4) -> NF4Linear:
    """Quantize w [N, K] (on `device`, so a GPU does the work) into a 4-bit linear living there
    (in `codes_for(codes, w.shape)`)."""
    codes = codes_for(codes, tuple(w.shape))
    if codes is Codes.Q4:
        words, sz = quantize_q4(w, device)
        packed, absmax = words.view(torch.uint8).reshape(-1), sz.view(torch.float32).reshape(-1)
    else:
        packed, absmax = quantize_nf4(w, device)
    bias = None if b is None else b.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    return NF4Linear(packed, absmax, tuple(w.shape), bias, kernel, codes=codes)
