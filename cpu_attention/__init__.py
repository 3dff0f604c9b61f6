"""Attention over the paged KV cache in host memory, computed by the CPU.

`decode_attention` (Numba, see `decode.py`) and `prefill_attention` (torch GEMMs, see
`prefill.py`) return the output and the log-sum-exp, so a partial over the host tier merges
with the GPU tier's partial (`merge_attention`). Their torch twins are in `reference.py`.
Both take `threads=` (default: physical cores) and are safe to call from a worker thread;
`configure()` makes Numba's settings before the first kernel compiles (engine start).

The names below are imported on first use (torch and Numba take seconds to import), so the CLI
can import `cpu_attention.warm` and start its background compiles before paying for them.
"""

__all__ = [
    "DecodeWork", "HostKVPool", "INT4_GROUP", "KVDtype", "configure", "decode_attention", "decode_attention_ref",
    "dram_read_gbps",
    "dequantize", "merge_attention", "physical_cores", "prefill_attention", "prefill_attention_ref", "quantize",
]


def __getattr__(name: str):
    if name in ("configure", "dram_read_gbps", "physical_cores"):
        from cpu_attention import _numba as module
    elif name in ("DecodeWork", "decode_attention"):
        from cpu_attention import decode as module
    elif name == "HostKVPool":
        from cpu_attention import pool as module
    elif name in ("INT4_GROUP", "KVDtype", "dequantize", "quantize"):
        from cpu_attention import layout as module
    elif name == "merge_attention":
        from cpu_attention import merge as module
    elif name == "prefill_attention":
        from cpu_attention import prefill as module
    elif name in ("decode_attention_ref", "prefill_attention_ref"):
        from cpu_attention import reference as module
    else:
        raise AttributeError(f"module 'cpu_attention' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value
