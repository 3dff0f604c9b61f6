"""PTX text of the NF4 decoders that `gpu_ops.nf4_gemv` and `gpu_ops.nf4_mma` inline (plain Python:
tests read it without a GPU).

Each turns one int32 of packed codes (bitsandbytes order: byte p holds element 2p in its high
nibble, 2p + 1 in its low one) into the 8 elements' code-book values, in element order: bf16
widened to float32 (`prmt_asm`, for the GEMV's FMAs) or bf16 bits (`prmt_bf16_asm`, a
tensor-core operand), the latter optionally times the group's absmax. tests/test_gpu_ops.py
runs them through a small PTX emulator for every byte.
"""
from __future__ import annotations

import torch

from gpu_ops.nf4_code import NF4_CODE


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
    `prmt.b32 d, a, b, c` sets byte i of d to byte (c >> 4i) & 7 of the 8 bytes {b, a}: one
    looks up 4 codes among 8 entries (selectors q & 0x7777: the code's low 3 bits), a second
    picks each byte from the entries-0-7 or the 8-15 result by the code's bit 3 (selector
    i + 4·bit3), a third pairs low and high bytes into bf16 pairs, split by and/shl. The word's
    nibbles, low to high, are elements 1, 0, 3, 2, 5, 4, 7, 6.

    One line (PTX statements end at ';'): torch.compile re-emits the kernel's source with this
    string as a plain literal, which a newline inside would break.
    """
    return " ".join(line.strip() for line in _PRMT_ASM.splitlines())


def prmt_bf16_asm(scaled: bool) -> str:
    """PTX: one int32 of packed codes ($8) → 8 bf16 (int16 bits, $0..$7) in element order.

    `prmt_asm`'s lookup (tables in $9..$16), its last 4 prmt pairing the bytes the other way
    round: p_i holds elements 2i (low half) and 2i + 1 (high), memory order, so that the compiler
    finds the pair it packs for a store or an MMA operand already made (no prmt to repack it).
    scaled: $17 holds the group's absmax (float32 bits) and each pair is multiplied by it rounded
    to bf16, one bf16x2 fma with a -0 addend a pair (FP pipe, not the integer one the lookup
    loads): bf16(bf16(code) · bf16(absmax)), within a bf16 ulp of bitsandbytes' bf16(code · absmax)
    rounded once from float32.
    """
    lines = _PRMT_ASM.splitlines()
    regs, lookup = lines[1:2], lines[2: lines.index("prmt.b32 p0, l0, h0, 0x5140;")]
    lookup += ["prmt.b32 p0, l0, h0, 0x4051;", "prmt.b32 p1, l0, h0, 0x6273;",  # {low, high} = elements {2i, 2i + 1}
               "prmt.b32 p2, l1, h1, 0x4051;", "prmt.b32 p3, l1, h1, 0x6273;"]
    scale = []
    if scaled:
        regs += [".reg .b32 s2, z;", ".reg .f32 sf;"]
        scale = ["mov.b32 sf, $17;", "cvt.rn.bf16x2.f32 s2, sf, sf;", "mov.b32 z, 0x80008000;"]
        scale += [f"fma.rn.bf16x2 p{i}, p{i}, s2, z;" for i in range(4)]
    unpack = [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, p{i};" for i in range(4)]  # {low half, high half}
    return " ".join(["{", *regs, *lookup, *scale, *unpack, "}"])


def q4_bf16_asm() -> str:
    """PTX: one int32 of `gpu_ops.q4` codes ($8) and its group word ($9: the scale s as bf16 bits
    high, 128 + z low) → 8 bf16 (int16 bits, $0..$7) in element order: bf16((c − z) · s).

    A word's nibbles i and i + 4 are elements 2i and 2i + 1, so a shift, a mask and an or (one
    `lop3` after ptxas) make the pair's bf16x2 {128 + c_2i, 128 + c_2i+1} exactly; one bf16x2 fma
    less 128 + z leaves c − z exactly, another times s rounds once (as `nf4_tc`'s decode_q4, and
    the reference `q4.dequantize_q4`). Integer work a word: 3 shifts, 4 lop3 and the group word's
    two prmt and xor (NF4's lookup: 21); the 8 fmas go to the float pipe.
    """
    body = [".reg .b32 s2, nz2, one, z, t, p0, p1, p2, p3;",
            "prmt.b32 s2, $9, 0, 0x3232;",  # s, s
            "prmt.b32 nz2, $9, 0, 0x1010;",  # 128 + z twice, then negated
            "xor.b32 nz2, nz2, 0x80008000;",
            "mov.b32 one, 0x3F803F80;",
            "mov.b32 z, 0x80008000;"]
    for i in range(4):
        src = "$8"
        if i:
            body.append(f"shr.u32 t, $8, {4 * i};")
            src = "t"
        body += [f"and.b32 p{i}, {src}, 0x000F000F;", f"or.b32 p{i}, p{i}, 0x43004300;",
                 f"fma.rn.bf16x2 p{i}, p{i}, one, nz2;", f"fma.rn.bf16x2 p{i}, p{i}, s2, z;"]
    body += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, p{i};" for i in range(4)]  # {low half, high half}
    return " ".join(["{", *body, "}"])


_PRMT_ASM = """{
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
