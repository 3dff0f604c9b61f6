"""Carry out a `Plan`: size the KV tiers, fence GPU memory to the budget, make the runner.

The planner decides; this module only does what the plan says, and refuses plainly what the
runtime cannot do yet (weights the plan leaves on the host).
"""
from __future__ import annotations

import logging

import torch

from hetero.errors import UserError
from hetero.model import Model
from offload.kv_cache import TieredKVCache
from offload.runner import Runner
from planner.plan import Device, Mode, Plan
from planner.tensors import Kind

log = logging.getLogger(__name__)


def check_weights_supported(plan: Plan) -> None:
    """Every weight group but the embedding (a row lookup, fine on the host) must be resident on
    the plan's device: streaming weights over PCIe is not built yet."""
    off = [p for p in plan.placements if p.kind is not Kind.EMBED
           and (p.mode is not Mode.RESIDENT or (plan.device is Device.CUDA and not p.on_gpu))]
    if off and plan.device is Device.CUDA:
        need = sum(p.nbytes for p in off) / 2**30
        raise UserError(
            f"the plan leaves {len(off)} weight groups ({need:.1f} GiB) on the host to be "
            f"{off[0].mode.value}ed; this runtime keeps all weights on the GPU: raise --gpu-mem by "
            f"{need:.1f} GiB or use a smaller model"
        )


def fence_gpu_memory(budget_bytes: int, device: torch.device) -> None:
    """Make --gpu-mem a hard limit: the caching allocator refuses anything past it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), index)


def runtime_from_plan(model: Model, plan: Plan, pin: bool = False, detailed_timing: bool = False) -> Runner:
    """The tiered KV cache and runner for `plan` (KV sized for the plan's batch at its context)."""
    kv, batch = plan.kv, plan.workload.batch
    dev = model.device
    gpu_tokens = kv.gpu_tokens * batch if dev.type == "cuda" else 0
    cache = TieredKVCache(
        model.cfg,
        host_tokens=kv.host_tokens * batch + kv.block_size * batch,
        gpu_tokens=gpu_tokens,
        host_dtype=kv.host_dtype,
        gpu_tokens_per_seq=kv.gpu_tokens if gpu_tokens else 0,
        device=dev,
        block_size=kv.block_size,
        pin=pin or kv.stream_tokens > 0,  # streamed blocks go up by DMA: pinned
    )
    log.info("KV: %d tokens/seq on %s (%s), %d on the host (%s), batch %d", kv.gpu_tokens, dev,
             kv.gpu_dtype.value, kv.host_tokens, kv.host_dtype.value, batch)
    return Runner(model, cache, threads=plan.threads, sub_batches=plan.sub_batches, detailed_timing=detailed_timing,
                  max_batch=batch, max_context=plan.workload.ctx_size,
                  stream_tokens=kv.stream_tokens if dev.type == "cuda" else 0)
