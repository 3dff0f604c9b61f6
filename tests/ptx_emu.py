"""A tiny emulator of the few PTX integer instructions the NF4 decoders use (tests only)."""
from __future__ import annotations

import re

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


def run(asm: str, inputs: dict[int, int], memory: dict[int, int] | None = None) -> dict[int, int]:
    """Run `asm` with $n = inputs[n]; returns every $n written, as unsigned 32-bit words."""
    regs: dict[str, int] = {f"${n}": v & ((1 << 64) - 1) for n, v in inputs.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]

    for line in asm.replace("{", ";").replace("}", ";").split(";"):  # one statement at a time
        line = line.strip()
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
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
        r = {"and.b32": lambda: x[0] & x[1], "or.b32": lambda: x[0] | x[1], "shr.u32": lambda: (x[0] & M32) >> x[1],
             "shl.b32": lambda: x[0] << x[1], "prmt.b32": lambda: prmt(*x), "mov.b32": lambda: x[0]}[op]()
        regs[d] = r & M32
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$") and int(k[1:]) not in inputs}
