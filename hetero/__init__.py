"""hetero: LLM inference with 4-bit weights on the GPU and the KV cache attended by the CPU.

    import hetero
    engine = hetero.load()                      # the embedded demo model
    engine = hetero.load("path/to/hf-folder", weights="f32", kv_dtype="bf16")
    for chunk in engine.generate("The capital of France is", max_new_tokens=8):
        print(chunk.text, end="")
"""
from hetero.engine import Chunk, Engine
from hetero.errors import UserError
from hetero.loading import load

__all__ = ["Chunk", "Engine", "UserError", "load"]
