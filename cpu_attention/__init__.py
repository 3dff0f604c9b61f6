"""Attention over the paged KV cache in host memory, computed by the CPU.

`decode_attention` and `prefill_attention` return the output and the log-sum-exp, so a
partial over the host tier merges with the GPU tier's partial (`merge_attention`).
"""
from cpu_attention.layout import INT4_GROUP, HostKVPool, KVDtype, dequantize, quantize
from cpu_attention.merge import merge_attention
from cpu_attention.reference import decode_attention_ref as decode_attention
from cpu_attention.reference import prefill_attention_ref as prefill_attention

__all__ = [
    "INT4_GROUP", "HostKVPool", "KVDtype", "decode_attention", "prefill_attention",
    "merge_attention", "quantize", "dequantize",
]
