"""`gpu_ops.q4`'s linear 4-bit matrix dequantized to bf16 on the GPU, for a prefill's matmul (as
bitsandbytes dequantizes NF4 before cuBLAS): one read of the codes, one write of 2 bytes a weight,
no float32 temporaries (torch's `dequantize_q4` would hold 8 bytes a weight at once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS = 256  # int32 words (2048 weights) a program


@triton.jit
def codes_f32(c):
    """4-bit codes (int32, 0..15) → float32 without a conversion instruction (I2F is quarter-rate on
    Hopper): c or'ed into the float bits of 2²³ are 2²³ + c exactly; less 2²³."""
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def scale_zero(s):
    """Group words s (int32: bf16 scale high, bf16 128 + z low) → (scale, z) as float32."""
    return (s & -65536).to(tl.float32, bitcast=True), ((s & 65535) << 16).to(tl.float32, bitcast=True) - 128.0


@triton.jit
def _dequant_kernel(w_ptr, sz_ptr, out_ptr, n_words, WORDS: tl.constexpr):
    """Words [pid·WORDS, +WORDS) of the flat [N·K/8] codes → their 8 weights each, in element order."""
    offs = tl.program_id(0) * WORDS + tl.arange(0, WORDS)
    ok = offs < n_words
    q = tl.load(w_ptr + offs, mask=ok, other=0)
    sc, z = scale_zero(tl.load(sz_ptr + offs // 8, mask=ok, other=0))  # 8 words a group of 64
    e = tl.arange(0, 8)
    shift = 4 * (e // 2) + 16 * (e % 2)  # element 2i in nibble i, 2i + 1 in nibble i + 4
    c = codes_f32((q[:, None] >> shift[None, :]) & 15)
    v = ((c - z[:, None]) * sc[:, None]).to(tl.bfloat16)  # bf16((c − z) · s), as dequantize_q4
    tl.store(out_ptr + offs[:, None] * 8 + e[None, :], v, mask=ok[:, None])


def dequantize_q4_gpu(packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """packed int32 [N, K/8], sz int32 [N, K/64] → W [N, K] bf16, equal to `dequantize_q4`'s."""
    N, KW = packed.shape
    out = torch.empty(N, KW * 8, dtype=torch.bfloat16, device=packed.device)
    n = N * KW
    _dequant_kernel[(triton.cdiv(n, WORDS),)](packed, sz, out, n, WORDS=WORDS)
    return out
