"""On-disk cache of NF4 weights, so a second start reads 4-bit tensors instead of quantizing.

One safetensors file per source checkpoint under `$XDG_CACHE_HOME/hetero/weights/` (default
`~/.cache/hetero/weights/`), named by a hash of the checkpoint's resolved path and the size and
mtime of its files: editing or replacing the checkpoint gives a new key. Per linear layer `name`
it holds `name.packed` (uint8), `name.absmax` (float32) and `name.shape` (int64 [2]) in the
`gpu_ops.nf4` format (the linear q4 codes in a file of their own, `...-q4.safetensors`); the
header's metadata records that format, so a reader of another format (or version) treats the file
as a miss and writes it again.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from gpu_ops.nf4 import BLOCK, Codes, NF4Linear, Nf4Kernel, codes_for, nf4_linear

log = logging.getLogger(__name__)

METADATA = {
    Codes.NF4: {"hetero_weight_cache": "1", "quant_type": "nf4", "blocksize": str(BLOCK),
                "layout": "bitsandbytes: packed uint8, element 2i in the high nibble; absmax float32 per 64 elements"},
    Codes.Q4: {"hetero_weight_cache": "1", "quant_type": "q4", "blocksize": str(BLOCK), "extreme": "exact",
               "layout": "gpu_ops.q4: packed int32 words, elements 2i and 2i+1 in nibbles i and i+4; "
                         "sz int32 per 64 elements (bf16 scale high, bf16 128 + zero low)"},
}
_SOURCE_SUFFIXES = (".safetensors", ".gguf", ".json", ".bin")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetero" / "weights"


def source_key(source: Path) -> str:
    """Hash of the checkpoint's resolved path and each of its files' name, size and mtime."""
    source = source.expanduser().resolve()
    files = sorted(p for p in source.iterdir() if p.suffix in _SOURCE_SUFFIXES) if source.is_dir() else [source]
    h = hashlib.sha256(str(source).encode())
    for f in files:
        st = f.stat()
        h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


class NF4Cache:
    """Quantized linears of one checkpoint: read from the cache file, or quantized and saved."""

    def __init__(self, source: Path, root: Path | None = None, kernel: Nf4Kernel = Nf4Kernel.AUTO,
                 codes: Codes = Codes.NF4):
        self.source, self.kernel, self.codes = Path(source), kernel, codes
        suffix = "" if codes is Codes.NF4 else f"-{codes.value}"
        self.path = (root or cache_root()) / f"{source_key(self.source)}{suffix}.safetensors"
        self._new: dict[str, torch.Tensor] = {}
        self._file = self._open()
        self.hit = self._file is not None

    def _open(self):
        if not self.path.is_file():
            return None
        from safetensors import safe_open

        try:
            f = safe_open(str(self.path), framework="pt")
            meta = f.metadata() or {}
        except Exception as e:  # noqa: BLE001  a broken cache file is re-made, not fatal
            log.warning("weight cache %s is unreadable (%s); quantizing again", self.path, e)
            return None
        if any(meta.get(k) != v for k, v in METADATA[self.codes].items()):
            log.warning("weight cache %s has another format (%s); quantizing again", self.path, meta)
            return None
        return f

    def linear(self, name: str, weight: Callable[[], torch.Tensor], bias: torch.Tensor | None,
               device: torch.device) -> NF4Linear:
        """The NF4Linear for `name`; `weight()` is called (and the result quantized) only on a miss."""
        if self._file is not None:
            try:
                packed = self._file.get_tensor(f"{name}.packed")
                absmax = self._file.get_tensor(f"{name}.absmax")
                shape = tuple(self._file.get_tensor(f"{name}.shape").tolist())
            except Exception as e:  # noqa: BLE001
                raise RuntimeError(
                    f"weight cache {self.path} lacks or cannot read {name} ({e}): delete that file and load again"
                ) from e
            packed, absmax = packed.to(device), absmax.to(device)
        else:
            w = weight()
            shape = tuple(w.shape)
            made = nf4_linear(w, None, device, codes=self.codes)
            packed, absmax = made.packed, made.absmax
            self._new[f"{name}.packed"] = packed.cpu()
            self._new[f"{name}.absmax"] = absmax.cpu()
            self._new[f"{name}.shape"] = torch.tensor(shape, dtype=torch.int64)
        if bias is not None:
            bias = bias.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        return NF4Linear(packed, absmax, shape, bias, self.kernel, codes=codes_for(self.codes, shape))

    def save(self) -> None:
        """Write what was quantized (atomically: a crash leaves no half file behind)."""
        if self.hit or not self._new:
            return
        from safetensors.torch import save_file

        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            save_file(self._new, str(tmp), metadata={**METADATA[self.codes], "source": str(self.source)})
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("could not write the weight cache %s (%s); the next start quantizes again", self.path, e)
            return
        log.info("cached %s weights of %s in %s", self.codes.value, self.source, self.path)
        self._new.clear()
