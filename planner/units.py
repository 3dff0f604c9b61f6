"""Memory sizes as users type them (`8GiB`, `512MiB`, `24G`, `1.5GB`) and as we print them."""
from __future__ import annotations

import re

from hetero.errors import UserError

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'8GiB' → 8589934592. Bare letters (K, M, G, T) are binary, as in llama.cpp and Ollama."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UserError(f"cannot read the size {text!r}: write a number and a unit, e.g. 8GiB, 512MiB, 24G")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """Bytes → '4.50 GiB' (binary units, three significant figures)."""
    sign, n = ("-" if n < 0 else ""), abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(n)} B"
            return f"{sign}{n:.0f} {unit}" if n >= 100 else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_tokens(n: int) -> str:
    """8192 → '8k', 1536 → '1.5k', 300 → '300' (the chat status line's style)."""
    if n < 1000:
        return str(n)
    k = n / 1024
    return f"{k:.0f}k" if abs(k - round(k)) < 0.05 or k >= 100 else f"{k:.1f}k"
