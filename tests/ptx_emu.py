"""A tiny emulator of the few PTX instructions the NF4 decoders use (tests only)."""
from __future__ import annotations

import re
import struct

import torch

M32 = 0xFFFFFFFF


def prmt(a: int, b: int, c: int) -> int:
    """prmt.b32 default mode: byte i of the result is byte (c >> 4i) & 7 of {b, a}, or its sign
    replicated when bit 3 of that selector nibble is set."""
    src = (a & M32) | ((b & M32) << 32)
    out = 0
    for i in range(4):
        s = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (s & 7))) & 0xFF
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _to_bf16(v: float) -> int:
    """Round to bf16, nearest-even (torch's float32 → bf16 cast is)."""
    return int(torch.tensor(v, dtype=torch.float32).to(torch.bfloat16).view(torch.int16)) & 0xFFFF


def _pair(lo: float, hi: float) -> int:
    return _to_bf16(lo) | (_to_bf16(hi) << 16)


def fma_bf16x2(a: int, b: int, c: int) -> int:
    """Per half: bf16(a·b + c), one rounding (a bf16 product is exact in float32)."""
    half = lambda x, i: _bf16(x >> (16 * i))  # noqa: E731
    return _pair(*(half(a, i) * half(b, i) + half(c, i) for i in range(2)))


def run(asm: str, inputs: dict[int, int], memory: dict[int, int] | None = None) -> dict[int, int]:
    """Run `asm` with $n = inputs[n]; returns every $n written, as unsigned 32-bit words."""
    regs: dict[str, int] = {f"${n}": v & ((1 << 64) - 1) for n, v in inputs.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]

    for line in asm.split(";"):  # one statement at a time; '{' and '}' open and close the block
        line = line.strip().lstrip("{").strip()
        if not line or line[0] in "}.":
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # unpack into 16-bit registers: {low half, high half}
            lo, hi, src = (t.strip(" {}") for t in rest.replace("}", ",").split(",") if t.strip())
            regs[lo], regs[hi] = regs[src] & 0xFFFF, (regs[src] >> 16) & 0xFFFF
            continue
        if op == "mov.b64":
            d, pair = rest.split(",", 1)
            lo, hi = (val(t) for t in pair.strip(" {}").split(","))
            regs[d.strip()] = (lo & M32) | ((hi & M32) << 32)
            continue
        if op.startswith("ld.global"):
            d, addr = (t.strip() for t in rest.split(",", 1))
            regs[d] = memory[regs[addr.strip("[] ")]]
            continue
        d, *src = (t.strip() for t in rest.split(","))
        x = [val(t) for t in src]
        r = {"and.b32": lambda: x[0] & x[1], "or.b32": lambda: x[0] | x[1], "xor.b32": lambda: x[0] ^ x[1],
             "shr.u32": lambda: (x[0] & M32) >> x[1],
             "shl.b32": lambda: x[0] << x[1], "prmt.b32": lambda: prmt(*x), "mov.b32": lambda: x[0],
             "fma.rn.bf16x2": lambda: fma_bf16x2(*x),
             "cvt.rn.bf16x2.f32": lambda: _pair(*(struct.unpack("<f", struct.pack("<I", v & M32))[0] for v in x[::-1]))}[op]()
        regs[d] = r & M32
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$") and int(k[1:]) not in inputs}
