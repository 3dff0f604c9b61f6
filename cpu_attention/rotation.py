"""The fixed orthonormal rotation int4 KV is stored in (QuaRot's idea, without the learning).

Keys and values are quantized as x @ R, R = diag(s) · blockdiag(H_P, ..., H_P) / √P: s a fixed
pseudo-random ±1 per channel, H_P the Sylvester Hadamard matrix of size P, P the largest power
of two dividing D (64 → one 64-block, 96 → three 32-blocks, 128, 256 → one block). A key's
few outlier channels (real models have them, after RoPE too) are spread over all P channels
of their block, so a group of 32 no longer spends its 16 levels on one channel. R is
orthonormal, so attention over rotated K/V needs only q @ R in and out @ R.T back.

`rotate` computes the transform as a sign flip, log2(P) add/subtract butterfly stages and one
multiply by 1/√P, all elementwise float32 ops: any implementation doing the same ops in the
same order gets the same bits (the Numba append does, see `append.py`), which the quantizing
writers need. `unrotate` serves readers only, whose results need match no bits: on the CPU it
is one product with R.T, ~7x faster in torch on a CPU than the log2(P) elementwise passes (8k
tokens × 8 heads × 128 on 2 cores: ~50 ms against ~350 ms), equal to them to float32 rounding.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

SIGN_SEED = 20240531  # any fixed seed: readers and writers of one process must agree


def block(D: int) -> int:
    """Hadamard block size: the largest power of two dividing D."""
    return D & -D


@functools.cache
def signs(D: int, device: torch.device | None = None) -> torch.Tensor:
    """The fixed ±1 per channel [D] float32 (random signs stop the Hadamard from mapping a
    constant channel offset to a single spike), on `device` (default: the CPU). Cached per
    device, so a CUDA graph that rotates finds its copy made before capture."""
    if device is not None and torch.device(device).type != "cpu":
        return signs(D).to(device)
    gen = torch.Generator().manual_seed(SIGN_SEED)
    return (torch.randint(0, 2, (D,), generator=gen) * 2 - 1).float()


def inv_sqrt(D: int) -> torch.Tensor:
    """1/√P rounded to float32, as a 0-d CPU tensor (torch multiplies by it in float32 on any
    device, as by a scalar)."""
    return torch.tensor(1.0 / math.sqrt(block(D)), dtype=torch.float32)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of each P-block of x [..., D] (float32)."""
    D = x.shape[-1]
    P = block(D)
    h = 1
    while h < P:
        y = x.reshape(*x.shape[:-1], D // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], D)
        h *= 2
    return x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] → x @ R in float32 (see the module doc for the op order)."""
    return _fwht(x.float() * signs(x.shape[-1], x.device)) * inv_sqrt(x.shape[-1])


@functools.cache
def inverse(D: int) -> torch.Tensor:
    """R.T [D, D] float32 on the CPU."""
    return rotate(torch.eye(D)).T.contiguous()


def unrotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] → x @ R.T in float32, the inverse of `rotate`: one matrix product on the CPU; on
    a GPU the butterfly (a product there is a cuBLAS call, and each stream a CUDA graph is
    captured on gets its own cuBLAS workspace: the streamer's 32 layer captures took ~0.8 GiB
    more and broke a 6 GiB budget)."""
    D = x.shape[-1]
    if x.device.type == "cpu":
        return x.float() @ inverse(D)
    return (_fwht(x.float()) * inv_sqrt(D)) * signs(D, x.device)


def on_device(D: int, device: torch.device) -> None:
    """Make `rotate`/`unrotate`'s cached tensors for head dim D on `device` now (before a CUDA
    graph that rotates is captured)."""
    signs(D, device)


@functools.cache
def numba_args(D: int) -> tuple[np.ndarray, int, np.float32]:
    """(signs [D] float32, P, 1/√P as float32): the rotation as the Numba kernels take it."""
    return signs(D).numpy(), block(D), np.float32(inv_sqrt(D).item())
