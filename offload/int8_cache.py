"""On-disk cache of the CPU's int8 weights, so a second start maps them instead of dequantizing
and re-quantizing every matrix (most of a warm `hetero chat` start on the CPU).

One safetensors file per checkpoint beside the NF4 cache (`gpu_ops.weight_cache`: same key, a
hash of the checkpoint's path, sizes and mtimes), holding `name.q` (int8 [O, I]) and
`name.scale` (float32 [O]) per linear layer; the header's metadata names the format, so a file
of another format is a miss and is written again. A cache folder that cannot be written only
costs the next start the conversion.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch

from cpu_attention.linear import Int8Linear

log = logging.getLogger(__name__)

METADATA = {"hetero_weight_cache": "1", "quant_type": "int8-rows", "layout": "q int8 [O, I], scale f32 [O]: w = q * scale"}


class Int8Cache:
    def __init__(self, source: Path):
        from gpu_ops.weight_cache import cache_root, source_key

        self.path = cache_root() / f"{source_key(Path(source))}.int8.safetensors"
        self._new: dict[str, torch.Tensor] = {}
        self._have: dict[str, torch.Tensor] = {}
        if self.path.is_file():
            try:
                from safetensors import safe_open

                with safe_open(str(self.path), framework="pt") as f:
                    if {k: (f.metadata() or {}).get(k) for k in METADATA} == METADATA:
                        self._have = {k: f.get_tensor(k) for k in f.keys()}
            except (OSError, ValueError, RuntimeError) as e:  # a damaged file: convert again
                log.warning("ignoring the int8 weight cache %s (%s)", self.path, e)
        self.hit = bool(self._have)

    def linear(self, name: str, weight: Callable[[], torch.Tensor], bias: torch.Tensor | None) -> Int8Linear:
        if name + ".q" in self._have:
            return Int8Linear.from_quantized(self._have[name + ".q"], self._have[name + ".scale"], bias)
        lin = Int8Linear(weight(), bias)
        self._new[name + ".q"], self._new[name + ".scale"] = lin.q, lin.scale
        return lin

    def save(self) -> None:
        if not self._new:
            return
        from safetensors.torch import save_file

        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file({**self._have, **self._new}, str(tmp), metadata=METADATA)
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("note: cannot write the int8 weight cache %s (%s); the next start converts again",
                        self.path, e)
        self._new.clear()
