"""Carry out a plan's weight placements: which group the device holds, which it streams, which
the CPU computes.

    RESIDENT  stored on the device, in the plan's format (NF4, bf16, f32)
    STREAM    stored on the host in the device format, copied up a layer ahead (offload/weights.py)
    CPU       stored on the host in the CPU format, computed there (offload/host_compute.py)

The loader builds every group where `weight_homes` says (one matrix at a time, so a model larger
than the GPU budget loads under it); `place_weights` then rebinds the streamed tensors to the
device staging and wraps the host-computed matrices. Vectors the device applies between
host-computed matrices (RMSNorm weights, the q/k norms of an attention group) stay on the device:
they are a few KiB a layer, and moving them would cost a round trip each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero.errors import UserError
from offload.loader import Home, Homes, WeightFormat
from hetero.model import LayerWeights, Linear, Model
from offload.host_compute import HostCompute, HostFFN, HostLinear
from offload.weights import TensorRef, WeightStreamer
from planner.plan import Device, Mode, Plan
from planner.tensors import Kind, WDtype

FORMATS = {WDtype.NF4: WeightFormat.NF4, WDtype.Q4: WeightFormat.Q4, WDtype.INT8: WeightFormat.INT8, WDtype.INT4: WeightFormat.INT4,
           WDtype.BF16: WeightFormat.BF16, WDtype.F32: WeightFormat.F32}
_VECTORS = (Kind.NORMS, Kind.FINAL_NORM)  # applied by the device whatever the plan's mode


@dataclass
class PlacedWeights:
    """What the runner needs to know of the weights' placement."""

    streamer: WeightStreamer | None  # layers whose weights are streamed (None: none)
    host: HostCompute | None  # groups computed by the CPU (None: none)
    host_groups: int = 0

    @property
    def device_only(self) -> bool:
        return self.streamer is None and self.host is None


def check_plan_supported(plan: Plan, device: torch.device | None = None) -> None:
    """Refuse, with what to change, placements this runtime cannot carry out (on `device`: a GPU
    plan may run with the CPU standing in for the GPU, a CPU plan only on the CPU)."""
    if plan.device is Device.CPU:
        if device is not None and device.type != "cpu":
            raise UserError("this plan is for a host without a GPU: run it with --device cpu, or make a plan for "
                            "the GPU with `hetero plan --device cuda`")
        for p in plan.placements:
            if p.on_gpu or p.mode is not Mode.CPU:
                raise UserError(f"plan: the plan is for the CPU (--device cpu) but {p.name} is {p.mode.value} on "
                                f"{p.device.value}: fix the plan or make it again")
        return
    for p in plan.placements:
        if p.kind is Kind.EMBED:
            continue  # a row lookup: wherever the table is stored
        if p.mode is Mode.RESIDENT and not p.on_gpu or p.mode is not Mode.RESIDENT and p.on_gpu:
            raise UserError(f"plan: {p.name} is {p.mode.value} but stored on {p.device.value}; resident groups are "
                            "stored on cuda, streamed and CPU-computed ones on cpu: fix the plan or make it again")
        if p.mode is Mode.STREAM and p.dtype is WDtype.INT8:
            raise UserError(f"plan: {p.name} streams int8 weights, but int8 is computed by the CPU only: set its "
                            "mode to cpu, or its dtype to the plan's GPU format")
        if p.mode is Mode.RESIDENT and p.dtype in (WDtype.INT8, WDtype.INT4):
            raise UserError(f"plan: {p.name} keeps {p.dtype.value} weights on the GPU, which has no kernel for them: "
                            "use nf4 or bf16")
        if p.dtype is WDtype.INT4 and not (p.kind is Kind.EXPERTS and p.mode is Mode.CPU):
            raise UserError(f"plan: {p.name} is int4, the format of experts the CPU computes only: use int8 or nf4")
        if p.experts is not None and p.mode is Mode.CPU and p.dtype is not WDtype.INT4 and \
                (device is None or device.type == "cuda"):
            raise UserError(f"plan: {p.name} has {p.dtype.value} host experts beside a GPU; the CPU computes a split "
                            "layer's experts beside the GPU in int4: set their dtype to int4")
        if p.experts is not None and p.mode is Mode.STREAM:
            raise UserError(f"plan: {p.name} streams a part of a layer's experts; a split layer's host experts are "
                            "computed by the CPU: set its mode to cpu")
    for layer in {p.layer for p in plan.placements if p.kind is Kind.EXPERTS}:
        parts = plan.expert_placements(layer)
        if len(parts) > 1 and not any(p.on_gpu for p in parts):
            raise UserError(f"plan: layer {layer}'s experts are split but no part is on the GPU, which routes: "
                            "put the router's part on cuda")


def weight_homes(plan: Plan, device: torch.device) -> Homes:
    """(layer, kind) → where the loader stores the group and in which format."""
    host = torch.device("cpu")

    def home(layer: int, kind: Kind, expert: int | None = None) -> Home:
        p = plan.placement(layer, kind)
        if expert is not None:  # the part of the layer's experts that holds this one
            p = next(x for x in plan.expert_placements(layer) if x.experts is None or expert in x.experts)
        if p.mode is Mode.RESIDENT or kind in _VECTORS and p.mode is Mode.CPU:
            return Home(FORMATS[p.dtype], device)
        return Home(FORMATS[p.dtype], host, host_computed=p.experts is not None and p.mode is Mode.CPU)

    return home


def place_weights(model: Model, plan: Plan) -> PlacedWeights:
    """Rebind streamed groups to the device staging and wrap CPU-computed ones (the model was
    loaded with `weight_homes(plan, model.device)`)."""
    if plan.device is Device.CPU:  # every group is computed where it is stored, by the CPU
        return PlacedWeights(None, None)
    L = model.cfg.num_layers
    streamed: dict[int, list[TensorRef]] = {}
    compute = HostCompute(model.device)
    host_groups = 0
    for p in plan.placements:
        if p.kind is Kind.EMBED or p.mode is Mode.RESIDENT:
            continue
        key = p.layer if p.layer >= 0 else L
        if p.mode is Mode.STREAM:
            streamed.setdefault(key, []).extend(_tensors(model, p.layer, p.kind))
        elif p.experts is not None:  # a split layer's host experts: offload.moe computes them beside the device's
            continue
        elif p.kind not in _VECTORS:
            _compute_on_host(model, p.layer, p.kind, compute)
            host_groups += 1
    streamer = WeightStreamer(streamed, model.device) if streamed else None
    model.use_kernels(model.fused, model.ops)  # the layers whose weights moved to the CPU no longer fit them
    return PlacedWeights(streamer, compute if host_groups else None, host_groups)


def _compute_on_host(model: Model, layer: int, kind: Kind, compute: HostCompute) -> None:
    dev = model.device
    if kind is Kind.LM_HEAD:
        model.lm_head = HostLinear(model.lm_head, compute)
        return
    lw = model.layers[layer]
    if kind is Kind.ATTN:
        lw.qkv, lw.o = HostLinear(lw.qkv, compute), HostLinear(lw.o, compute)
        if lw.q_norm is not None:
            lw.q_norm, lw.k_norm = lw.q_norm.to(dev), lw.k_norm.to(dev)
        return
    # MLP or experts: the host keeps its own LayerWeights view of them; the device's loses them
    host = LayerWeights(attn_norm=lw.attn_norm, qkv=lw.qkv, o=lw.o, mlp_norm=lw.mlp_norm, gate_up=lw.gate_up,
                        down=lw.down, router=lw.router, experts=lw.experts)
    lw.ffn = HostFFN(model.cfg, host, compute)
    lw.gate_up = lw.down = lw.router = None
    lw.experts = []


def _tensors(model: Model, layer: int, kind: Kind) -> list[TensorRef]:
    """The tensors of one weight group, as attributes the streamer can rebind."""
    if kind is Kind.FINAL_NORM:
        return [TensorRef(model, "norm")]
    if kind is Kind.LM_HEAD:
        return _linear(model.lm_head)
    lw = model.layers[layer]
    if kind is Kind.NORMS:
        return [TensorRef(lw, "attn_norm"), TensorRef(lw, "mlp_norm")]
    if kind is Kind.ATTN:
        out = _linear(lw.qkv) + _linear(lw.o)
        return out + ([TensorRef(lw, "q_norm"), TensorRef(lw, "k_norm")] if lw.q_norm is not None else [])
    if kind is Kind.MLP:
        return _linear(lw.gate_up) + _linear(lw.down)
    out = [TensorRef(lw, "router")]
    for gate_up, down in lw.experts:
        out += _linear(gate_up) + _linear(down)
    return out


def _linear(lin: Linear) -> list[TensorRef]:
    from gpu_ops.nf4 import NF4Linear
    from hetero.model import Dense

    if isinstance(lin, NF4Linear):
        names = ["packed", "absmax"]
    elif isinstance(lin, Dense):
        names = ["weight"]
    else:
        raise UserError(f"{type(lin).__name__} weights cannot be streamed to the GPU (the CPU computes them): "
                        "set the group's mode to cpu")
    return [TensorRef(lin, n) for n in names + (["bias"] if lin.bias is not None else [])]
