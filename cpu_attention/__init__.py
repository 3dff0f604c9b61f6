"""Attention over the paged KV cache in host memory, computed by the CPU.

`decode_attention` (Numba, see `decode.py`) and `prefill_attention` (torch GEMMs, see
`prefill.py`) return the output and the log-sum-exp, so a partial over the host tier merges
with the GPU tier's partial (`merge_attention`). Their torch twins are in `reference.py`.
Both take `threads=` (default: physical cores) and are safe to call from a worker thread.

The names below load on first use (torch and Numba take seconds to import), so `warm` can
start its background compiles before the importing process has paid for them.
"""
import importlib

_WHERE = {
    "configure": "_numba", "physical_cores": "_numba", "DecodeWork": "decode", "decode_attention": "decode", "INT4_GROUP": "layout",
    "HostKVPool": "pool", "KVDtype": "layout", "dequantize": "layout", "quantize": "layout",
    "merge_attention": "merge", "prefill_attention": "prefill", "decode_attention_ref": "reference",
    "prefill_attention_ref": "reference",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'cpu_attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"cpu_attention.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
