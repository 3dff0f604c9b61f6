"""PTX text of the NF4 decoders that `gpu_ops.nf4_gemv` inlines (plain Python: tests read it without a GPU).

Each decoder turns one int32 of packed codes (bitsandbytes order: byte p holds element 2p in its
high nibble, 2p + 1 in its low one) into the 8 elements' code-book values as float32, in
element order. tests/test_gpu_ops.py runs both through a small PTX emulator for every byte.
"""
from __future__ import annotations

import torch

from gpu_ops.nf4 import NF4_CODE


def bf16_bits() -> list[int]:
    return [int(v) & 0xFFFF for v in NF4_CODE.to(torch.bfloat16).view(torch.int16)]


def prmt_tables() -> tuple[int, int, int, int, int, int, int, int]:
    """(hi bytes of codes 0-3, 4-7, 8-11, 12-15, then the low bytes likewise) as 32-bit words."""
    bits = bf16_bits()
    words = []
    for shift in (8, 0):
        for base in (0, 4, 8, 12):
            words.append(sum(((bits[base + i] >> shift) & 0xFF) << (8 * i) for i in range(4)))
    return tuple(words)


def prmt_asm() -> str:
    """PTX: one int32 of packed codes ($8) → 8 float32 ($0..$7) in element order.

    $9..$16 are the code book's bytes (`prmt_tables`), passed in so that they stay in registers.
    Byte p of the word holds element 2p in its high nibble and 2p + 1 in its low one, so the
    word's nibbles, low to high, are elements 1, 0, 3, 2, 5, 4, 7, 6.
    """
    return """{
.reg .b32 q7, q7h, t, th, ha, hb, la, lb, h0, l0, h1, l1, p0, p1, p2, p3;
and.b32 q7, $8, 0x77777777;
shr.u32 q7h, q7, 16;
shr.u32 t, $8, 1;
and.b32 t, t, 0x44444444;
or.b32 t, t, 0x32103210;
shr.u32 th, t, 16;
prmt.b32 ha, $9, $10, q7;
prmt.b32 hb, $11, $12, q7;
prmt.b32 h0, ha, hb, t;
prmt.b32 la, $13, $14, q7;
prmt.b32 lb, $15, $16, q7;
prmt.b32 l0, la, lb, t;
prmt.b32 ha, $9, $10, q7h;
prmt.b32 hb, $11, $12, q7h;
prmt.b32 h1, ha, hb, th;
prmt.b32 la, $13, $14, q7h;
prmt.b32 lb, $15, $16, q7h;
prmt.b32 l1, la, lb, th;
prmt.b32 p0, l0, h0, 0x5140;
prmt.b32 p1, l0, h0, 0x7362;
prmt.b32 p2, l1, h1, 0x5140;
prmt.b32 p3, l1, h1, 0x7362;
and.b32 $0, p0, 0xffff0000;
shl.b32 $1, p0, 16;
and.b32 $2, p1, 0xffff0000;
shl.b32 $3, p1, 16;
and.b32 $4, p2, 0xffff0000;
shl.b32 $5, p2, 16;
and.b32 $6, p3, 0xffff0000;
shl.b32 $7, p3, 16;
}"""


def lut_asm() -> str:
    """PTX: int32 of packed codes ($8), the float32 code book's address ($9 low, $10 high word;
    256-byte aligned, so a code's entry differs from it in the low byte only) → 8 float32 ($0..$7)."""
    lines = ["{", ".reg .b32 lo, hi, o;", ".reg .b64 a;",
             "shl.b32 lo, $8, 2;", "and.b32 lo, lo, 0x3c3c3c3c;",  # 4 · low nibble, in each byte
             "shr.u32 hi, $8, 2;", "and.b32 hi, hi, 0x3c3c3c3c;"]  # 4 · high nibble
    for e in range(8):  # element 2p: high nibble of byte p; 2p + 1: low nibble
        src, byte = ("hi" if e % 2 == 0 else "lo"), e // 2
        lines += [f"prmt.b32 o, {src}, $9, 0x765{byte};", "mov.b64 a, {o, $10};", f"ld.global.nc.f32 ${e}, [a];"]
    return "\n".join(lines + ["}"])
