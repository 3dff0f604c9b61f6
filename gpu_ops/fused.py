"""Fused decode layer on the GPU: the few-row (decode) layer in 7 kernels instead of ~60.

At batch 1 the graphed decode step spent ~3.5 of its ~6.2 ms outside the weight GEMVs, in
~60 small kernels a layer (RMSNorm as 7 ops, RoPE as ~9 a tensor, casts, SiLU·up, residual
adds), each ~1.5 µs even inside a CUDA graph (bench/RESULTS.md, gpu_ops). Here a layer is:

    rms_norm → qkv GEMV → rope (q and k in place) → [the runtime's KV write + attention]
    → o GEMV + residual → rms_norm → gate_up GEMV + silu·up → down GEMV + residual

with the residual adds and SwiGLU in the GEMV's epilogue (`nf4_gemv(residual=, swiglu=)`).
The arithmetic is the torch path's (`hetero.model`), rounding included: float32 inside each
kernel, bf16 where torch rounds to bf16 (after the norm's scaling, after each projection, after
each add). Every kernel here is launched with PDL where the GPU has it (`gpu_ops.pdl`).

The whole layer applies only where its kernels are the fastest measured: CUDA, bf16
activations, rows that `NF4Linear.pick` sends to our GEMV (≤ 2), NF4 weights without biases,
no q/k norm, a dense MLP (`applies`). Elsewhere on CUDA bf16 (prefill, larger batches, other
weights) `hetero.model` still takes `rms_norm`, `rope_` and `silu_mul` from here: one kernel
each instead of ~7, ~9 and 3 torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gpu_ops import pdl
from gpu_ops import nf4_tc
from gpu_ops.nf4 import Codes, NF4Linear, Nf4Kernel
from gpu_ops.nf4_gemv import nf4_gemv


def fits(lw) -> bool:
    """Whether layer weights `lw` can take the fused path: NF4 without biases, bf16 norms, no q/k
    norm, a dense MLP computed here."""
    if lw.q_norm is not None or lw.router is not None or getattr(lw, "ffn", None) is not None:
        return False  # ffn: an MLP computed elsewhere (offload.host_compute)
    lins = (lw.qkv, lw.o, lw.gate_up, lw.down)
    return all(isinstance(w, NF4Linear) and w.bias is None for w in lins) \
        and lw.attn_norm.dtype == torch.bfloat16 and lw.mlp_norm.dtype == torch.bfloat16


def takes(lw, x: torch.Tensor) -> bool:
    """Whether a step of weights that `fit` over activations x [N, H] does: CUDA bf16, rows that
    `NF4Linear.pick` sends to our GEMV (not while torch.compile traces: inductor fuses itself)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and not torch.compiler.is_compiling()
            and all(w.pick(x.shape[0]) is Nf4Kernel.GEMV for w in (lw.qkv, lw.o, lw.gate_up, lw.down)))


def applies(lw, x: torch.Tensor) -> bool:
    """Whether layer weights `lw` at activations x [N, H] take the fused path."""
    return fits(lw) and takes(lw, x)


def pre_attention(cfg, lw, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_out: tuple | None = None):
    """x [N, H] bf16, pos [N] → q [N, Hq, D], k, v [N, Hkv, D] (views of one qkv buffer).

    kv_out = (k_pool, v_pool, layer, slots, block_size): the RoPE kernel also stores k and v at
    slots [N] of the pools [L, NB, Hkv, BS, D] (as `gpu_ops.kv_pool.kv_write`), and k, v come
    back as None. Only where that kernel can (contiguous pools, D a power of two); else ignored."""
    h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
    qkv = _gemv(lw.qkv, h)
    N, D = x.shape[0], cfg.head_dim
    kv = None if kv_out is None else (*kv_out, cfg.num_heads, cfg.num_kv_heads)
    if rope_(qkv, pos, cos, sin, cfg.num_heads + cfg.num_kv_heads, D, kv_out=kv):
        return qkv[:, :cfg.q_size].view(N, cfg.num_heads, D), None, None
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    return q.view(N, cfg.num_heads, D), k.view(N, cfg.num_kv_heads, D), v.view(N, cfg.num_kv_heads, D)


def post_attention(cfg, lw, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """x [N, H] residual stream, attn [N, Hq, D] → the layer's output [N, H]."""
    x = _gemv(lw.o, attn.reshape(attn.shape[0], -1).to(torch.bfloat16), residual=x)
    act = _gemv(lw.gate_up, rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps), swiglu=True)  # silu(gate)·up
    return _gemv(lw.down, act, residual=x)


def linear_residual(lin, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
    """residual + lin(x) [N, O] bf16 with the add in the GEMV's epilogue (one kernel, rounded as
    torch rounds the two), where lin is 4-bit without a bias and x's rows take the GEMV; else None."""
    if not (isinstance(lin, NF4Linear) and lin.bias is None and lin.in_features % 64 == 0
            and x.dtype == residual.dtype == torch.bfloat16 and lin.pick(x.shape[0]) is Nf4Kernel.GEMV):
        return None
    return _gemv(lin, x, residual=residual)


def _gemv(lin: NF4Linear, x: torch.Tensor, residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    if lin.codes is Codes.Q4:
        return nf4_tc.q4_tc_gemv(x, *lin.q4_words(), lin.shape, residual=residual, swiglu=swiglu)
    return nf4_gemv(x, lin.packed, lin.absmax, lin.shape, config=lin.gemv_config, residual=residual, swiglu=swiglu)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, eps, stride_x, stride_o, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)  # a weight: before the wait
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    y = (x * r).to(tl.bfloat16).to(tl.float32) * w  # torch: (xf * rsqrt(...)).to(bf16) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(tl.bfloat16), mask=ok)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H] bf16, w [H] bf16 → bf16 [N, H], as `hetero.model.rms_norm`."""
    N, H = x.shape
    out = torch.empty_like(x)
    _rms_norm_kernel[(N,)](x, w, out, H, eps, x.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(H),
                           PDL=pdl.enabled(x.device), num_warps=8, **pdl.launch(x.device))
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_x, NH, D: tl.constexpr, NHP: tl.constexpr,
                 WRITE: tl.constexpr = False, kp=None, vp=None, slots_ptr=None, layer_off=0, s_blk=0, s_head=0,
                 s_off=0, BS=1, HQ=0, HKV=0, HKVP: tl.constexpr = 1, PDL: tl.constexpr = False,
                 NORM: tl.constexpr = False, qn_ptr=None, kn_ptr=None, eps=0.0, NQ=0):
    """Rotate-half RoPE of the first NH heads of row x[n] in place (float32 tables [T, D]); with
    WRITE, heads HQ..NH (k) rotated and the HKV heads after them (v) also go to the KV pools.
    NORM: each head RMS-normed first (Qwen3's q_norm for heads below NQ, k_norm above), as
    `hetero.model.rms_norm` rounds: the normed value to bf16, times the weight, to bf16 again."""
    row = tl.program_id(0)
    heads = tl.arange(0, NHP)
    half = tl.arange(0, D // 2)
    ok = (heads < NH)[:, None]
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    p = tl.load(pos_ptr + row)
    c1 = tl.load(cos_ptr + p * D + half)[None, :]
    c2 = tl.load(cos_ptr + p * D + D // 2 + half)[None, :]
    s1 = tl.load(sin_ptr + p * D + half)[None, :]
    s2 = tl.load(sin_ptr + p * D + D // 2 + half)[None, :]
    lo = x_ptr + row * stride_x + heads[:, None] * D + half[None, :]
    x1 = tl.load(lo, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(lo + D // 2, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        is_q = (heads < NQ)[:, None]
        w1 = tl.where(is_q, tl.load(qn_ptr + half)[None, :].to(tl.float32), tl.load(kn_ptr + half)[None, :].to(tl.float32))
        w2 = tl.where(is_q, tl.load(qn_ptr + D // 2 + half)[None, :].to(tl.float32),
                      tl.load(kn_ptr + D // 2 + half)[None, :].to(tl.float32))
        x1 = ((x1 * r).to(tl.bfloat16).to(tl.float32) * w1).to(tl.bfloat16).to(tl.float32)
        x2 = ((x2 * r).to(tl.bfloat16).to(tl.float32) * w2).to(tl.bfloat16).to(tl.float32)
    y1 = (x1 * c1 - x2 * s1).to(tl.bfloat16)  # x·cos + rotate_half(x)·sin
    y2 = (x2 * c2 + x1 * s2).to(tl.bfloat16)
    tl.store(lo, y1, mask=ok)
    tl.store(lo + D // 2, y2, mask=ok)
    if WRITE:
        slot = tl.load(slots_ptr + row)
        base = layer_off + (slot // BS) * s_blk + (slot % BS) * s_off
        is_k = ((heads >= HQ) & (heads < NH))[:, None]
        kd = kp + base + (heads - HQ)[:, None] * s_head + half[None, :]
        tl.store(kd, y1.to(kp.dtype.element_ty), mask=is_k)
        tl.store(kd + D // 2, y2.to(kp.dtype.element_ty), mask=is_k)
        j = tl.arange(0, HKVP)
        d = tl.arange(0, D)
        vok = (j < HKV)[:, None]
        v = tl.load(x_ptr + row * stride_x + (NH + j)[:, None] * D + d[None, :], mask=vok)
        tl.store(vp + base + j[:, None] * s_head + d[None, :], v.to(vp.dtype.element_ty), mask=vok)


def rope_(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, D: int,
          norms: tuple[torch.Tensor, torch.Tensor, float, int] | None = None, kv_out: tuple | None = None) -> bool:
    """In place on x [N, ≥ heads·D] bf16 (row-contiguous): the first `heads` heads of each row
    rotated at pos [N], as `hetero.model.Rope` (cos, sin: its float32 [T, D] tables).
    norms = (q_norm, k_norm, eps, q heads): each head RMS-normed first (Qwen3), the first q heads
    with q_norm, the others with k_norm (bf16 [D] weights), as `hetero.model.rms_norm`.
    kv_out = (k_pool, v_pool, layer, slots, block_size, q heads, kv heads), with x's heads q, k, v
    in that order: k (rotated) and v also go to the pools' slots [N] (as `kv_write`); where they
    can (contiguous pools, D a power of two) → True, else they are not stored → False."""
    N = x.shape[0]
    assert x.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    qn, kn, eps, nq = norms if norms is not None else (None, None, 0.0, 0)
    write = kv_out is not None and kv_out[0].is_contiguous() and kv_out[1].is_contiguous() and D & (D - 1) == 0
    kv = {}
    if write:
        kp, vp, layer, slots, bs, hq, hkv = kv_out
        st = kp.stride()
        kv = dict(WRITE=True, kp=kp, vp=vp, slots_ptr=slots, layer_off=layer * st[0], s_blk=st[1], s_head=st[2],
                  s_off=st[3], BS=bs, HQ=hq, HKV=hkv, HKVP=triton.next_power_of_2(hkv))
    _rope_kernel[(N,)](x, cos, sin, pos, x.stride(0), heads, D=D, NHP=triton.next_power_of_2(heads),
                       PDL=pdl.enabled(x.device), NORM=norms is not None, qn_ptr=qn, kn_ptr=kn, eps=eps, NQ=nq,
                       num_warps=4, **kv, **pdl.launch(x.device))
    return write


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, F, stride_gu, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row, pid = tl.program_id(0), tl.program_id(1)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < F
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + F + offs, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + offs, y.to(tl.bfloat16), mask=ok)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [N, 2F] bf16 (gate then up) → silu(gate) · up, bf16 [N, F]."""
    N, F2 = gu.shape
    F = F2 // 2
    out = torch.empty((N, F), dtype=torch.bfloat16, device=gu.device)
    BLOCK = 2048
    _silu_mul_kernel[(N, triton.cdiv(F, BLOCK))](gu, out, F, gu.stride(0), out.stride(0), BLOCK=BLOCK,
                                                 PDL=pdl.enabled(gu.device), num_warps=4, **pdl.launch(gu.device))
    return out


@triton.jit
def _kv_write_kernel(kp, vp, slots_ptr, k_ptr, v_ptr, layer_off, s_blk, s_head, s_off, s_kt, s_kh, s_vt, s_vh,
                     BS, Hkv, HP: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    slot = tl.load(slots_ptr + t)
    blk, off = slot // BS, slot % BS
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, D)[None, :]
    ok = h < Hkv
    dst = layer_off + blk * s_blk + h * s_head + off * s_off + d
    k = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=ok)
    v = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=ok)
    tl.store(kp + dst, k.to(kp.dtype.element_ty), mask=ok)
    tl.store(vp + dst, v.to(vp.dtype.element_ty), mask=ok)


def kv_write(k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, block_size: int) -> None:
    """`gpu_ops.kv_pool.kv_write` in one kernel: k, v [T, Hkv, D] (unit stride along D) into the
    contiguous pools [L, NB, Hkv, BS, D] at flat slots [T] (block · BS + offset)."""
    T, Hkv, D = k.shape
    s = k_pool.stride()
    _kv_write_kernel[(T,)](k_pool, v_pool, slots, k, v, layer * s[0], s[1], s[2], s[3], k.stride(0), k.stride(1),
                           v.stride(0), v.stride(1), block_size, Hkv, HP=triton.next_power_of_2(Hkv), D=D,
                           PDL=pdl.enabled(k.device), num_warps=4, **pdl.launch(k.device))
