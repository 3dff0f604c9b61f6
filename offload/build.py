"""Carry out a `Plan`: load the weights where it puts them, size the KV tiers, fence GPU memory
to the budget, make the runner.

The planner decides; this module only does what the plan says (offload/placement.py for the
weights), and refuses plainly what the runtime cannot do (`check_plan_supported`). The model's
device may be the CPU standing in for the GPU (tests): then both KV tiers and the weight
staging are host memory, and every path but the CUDA streams runs.
"""
from __future__ import annotations

import logging
import threading

import torch

from hetero.checkpoint import Checkpoint
from offload.loader import Progress, load_model
from hetero.model import Model
from offload.kv_cache import TieredKVCache
from offload.placement import FORMATS, PlacedWeights, check_plan_supported, place_weights, weight_homes
from offload.runner import Runner
from planner.plan import Device, Plan
from planner.tensors import Kind

log = logging.getLogger(__name__)


def load_from_plan(ck: Checkpoint, plan: Plan, device: torch.device,
                   progress: Progress | None = None) -> tuple[Model, PlacedWeights]:
    """The checkpoint's model with every weight group where `plan` puts it (see offload/placement.py);
    progress(done, total) as the layers' weights are converted."""
    check_plan_supported(plan, device)
    if plan.device is Device.CPU:  # every group in the plan's format on the CPU: the loader's own default
        model = load_model(ck, FORMATS[plan.weights], device, progress=progress)
        return model, place_weights(model, plan)
    embed_dev = device if plan.placement(-1, Kind.EMBED).on_gpu else torch.device("cpu")
    wl = plan.workload
    model = load_model(ck, FORMATS[plan.weights], device, embed_device=embed_dev, homes=weight_homes(plan, device),
                       progress=progress, threads=plan.threads, moe_rows=max(wl.ubatch, wl.batch),
                       moe_upload_rows=plan.moe_upload_rows)
    return model, place_weights(model, plan)


def on_own_thread(fn, *args, name: str = "hetero-load", **kwargs):
    """fn(*args, **kwargs) on a thread of its own that ends with it, so the OpenMP pools its CPU
    work makes end too (`cpu_attention._numba`: a pool left beside the CPU kernels' thread makes
    every later parallel region pay its workers' wake-up). Where CUDA runs, the caller's device is
    current there and its GPU work is done before this returns. → fn's result, or its exception
    raised here."""
    cuda = torch.cuda.is_available()
    device, out = (torch.cuda.current_device() if cuda else None), {}

    def run() -> None:
        if cuda:
            torch.cuda.set_device(device)
        try:
            out["value"] = fn(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()  # its copies done whatever stream the caller runs on next
        except BaseException as e:  # noqa: BLE001  raised again in the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def fence_gpu_memory(budget_bytes: int, device: torch.device) -> None:
    """Make --gpu-mem a hard limit: the caching allocator refuses anything past it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), index)


def runtime_from_plan(model: Model, plan: Plan, pin: bool = False, detailed_timing: bool = False,
                      weights: PlacedWeights | None = None) -> Runner:
    """The tiered KV cache and runner for `plan` (KV sized for the plan's batch at its context).
    weights: from `load_from_plan` (None: every weight is on the model's device)."""
    kv, batch = plan.kv, plan.workload.batch
    dev = model.device
    gpu_tokens = kv.gpu_tokens * batch
    cache = TieredKVCache(
        model.cfg,
        host_tokens=kv.host_tokens * batch + kv.block_size * batch,
        gpu_tokens=gpu_tokens,
        host_dtype=kv.host_dtype,
        gpu_tokens_per_seq=kv.gpu_tokens if gpu_tokens else 0,
        device=dev,
        block_size=kv.block_size,
        pin=dev.type == "cuda" and (pin or kv.stream_tokens > 0),  # streamed blocks go up by DMA: pinned
        gpu_dtype=kv.gpu_dtype,
        max_seqs=batch,
    )
    log.info("KV: %d tokens/seq on %s (%s), %d on the host (%s), batch %d", kv.gpu_tokens, dev,
             kv.gpu_dtype.value, kv.host_tokens, kv.host_dtype.value, batch)
    return Runner(model, cache, threads=plan.threads, sub_batches=plan.sub_batches, detailed_timing=detailed_timing,
                  max_batch=batch, max_context=plan.workload.ctx_size,
                  stream_tokens=kv.stream_tokens, weights=weights)
