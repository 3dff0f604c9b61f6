"""User options (CLI flags or `hetero.load` keywords) → the planner's Budget and Overrides.

One translation for `hetero plan`, `hetero chat` and `hetero.load`, so a flag means the same
everywhere; "auto" or None leaves the choice to the planner.
"""
from __future__ import annotations

from typing import Any

from cpu_attention.layout import KVDtype
from hetero.errors import UserError
from planner.plan import Budget, Device, Mode, Overrides
from planner.hardware import HardwareProfile, default_budget
from planner.tensors import WDtype
from planner.units import parse_size

WEIGHTS = {"4bit": WDtype.NF4, "nf4": WDtype.NF4, "q4": WDtype.Q4, "int8": WDtype.INT8, "bf16": WDtype.BF16,
           "f32": WDtype.F32}
DEVICES = {"cpu": Device.CPU, "cuda": Device.CUDA}
MODES = {"stream": Mode.STREAM, "cpu": Mode.CPU}
KV = {d.value: d for d in KVDtype}


def choice(value: str | None, flag: str, allowed: dict[str, Any]) -> Any:
    if value is None or value == "auto":
        return None
    if value not in allowed:
        raise UserError(f"{flag} {value!r} is not one of: auto, {', '.join(allowed)}")
    return allowed[value]


def budget_from(hw: HardwareProfile, gpu_mem: str | int | None, cpu_mem: str | int | None) -> Budget | None:
    """None when neither is set (the planner then takes free memory minus a margin)."""
    if not gpu_mem and not cpu_mem:
        return None
    default, _ = default_budget(hw)
    size = lambda v, d: d if not v else (v if isinstance(v, int) else parse_size(v))  # noqa: E731
    return Budget(size(gpu_mem, default.gpu_bytes), size(cpu_mem, default.host_bytes))


def overrides_from(*, device: str | None = None, weights: str | None = None, kv_dtype: str | None = None,
                   gpu_kv_dtype: str | None = None, threads: int | None = None, sub_batches: int | None = None,
                   gpu_kv_tokens: int | None = None, weight_mode: str | None = None,
                   block_size: int | None = None, stream_tokens: int | None = None, n_cpu_moe: int | None = None
                   ) -> Overrides:
    if sub_batches not in (None, 1, 2):
        raise UserError(f"--sub-batches {sub_batches}: use 1 or 2")
    return Overrides(
        device=choice(device, "--device", DEVICES),
        weights=choice(weights, "--weights", WEIGHTS),
        kv_dtype=choice(kv_dtype, "--kv-dtype", KV),
        gpu_kv_dtype=choice(gpu_kv_dtype, "--gpu-kv-dtype", KV),
        threads=threads, sub_batches=sub_batches, gpu_kv_tokens=gpu_kv_tokens,
        weight_mode=choice(weight_mode, "--weight-mode", MODES),
        block_size=block_size, stream_tokens=stream_tokens, n_cpu_moe=n_cpu_moe or 0,
    )
