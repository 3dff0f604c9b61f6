"""Attention over the paged KV cache in host memory, computed by the CPU.

`decode_attention` (Numba, see `decode.py`) and `prefill_attention` (torch GEMMs, see
`prefill.py`) return the output and the log-sum-exp, so a partial over the host tier merges
with the GPU tier's partial (`merge_attention`). Their torch twins are in `reference.py`.
Both take `threads=` (default: physical cores) and are safe to call from a worker thread.
"""
from cpu_attention._numba import physical_cores
from cpu_attention.decode import DecodeWork, decode_attention
from cpu_attention.layout import INT4_GROUP, HostKVPool, KVDtype, dequantize, quantize
from cpu_attention.merge import merge_attention
from cpu_attention.prefill import prefill_attention
from cpu_attention.reference import decode_attention_ref, prefill_attention_ref

__all__ = [
    "INT4_GROUP", "DecodeWork", "HostKVPool", "KVDtype", "decode_attention", "prefill_attention",
    "decode_attention_ref", "prefill_attention_ref", "merge_attention", "quantize",
    "dequantize", "physical_cores",
]
