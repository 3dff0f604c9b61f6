"""hetero: LLM inference with 4-bit weights on the GPU and the KV cache attended by the CPU.

    import hetero
    engine = hetero.load()                      # the embedded demo model
    engine = hetero.load("path/to/hf-folder", weights="f32", kv_dtype="bf16")
    for chunk in engine.generate("The capital of France is", max_new_tokens=8):
        print(chunk.text, end="")
"""
from hetero.errors import UserError

__all__ = ["Chunk", "Engine", "UserError", "load"]


def __getattr__(name: str):
    # Imported on first use: the runtime packages (offload, planner) import hetero's modules,
    # and an eager import here would make every such import a cycle.
    if name == "load":
        from hetero.app.build import load

        return load
    if name in ("Engine", "Chunk"):
        from hetero.app import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'hetero' has no attribute {name!r}")
