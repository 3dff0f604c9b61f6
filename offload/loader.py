"""Build a `Model` from a checkpoint: read each tensor once, fuse, convert, place.

Tensors are read one at a time from the lazily opened checkpoint and turned into their
final form (fused QKV and gate/up, the chosen weight format, the chosen device) before the
next is read, so peak memory stays near the final model size.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hetero.checkpoint import Checkpoint
from hetero.config import ModelConfig
from cpu_attention.linear import Int8Layers, Int8Linear
from hetero.errors import UserError
from hetero.model import Dense, ElementwiseOps, FusedLayer, LayerWeights, Linear, Model
from planner.tensors import Kind

log = logging.getLogger(__name__)


class WeightFormat(str, enum.Enum):
    F32 = "f32"
    BF16 = "bf16"
    INT8 = "int8"  # per-row int8, CPU kernel
    INT4 = "int4"  # host experts: a scale per 64 weights, the CPU's expert kernel (cpu_attention.experts)
    NF4 = "4bit"  # bitsandbytes NF4, GPU
    Q4 = "q4"  # linear 4-bit (gpu_ops.q4), GPU: NF4's bytes; a MoE layer's experts stay NF4

    @classmethod
    def parse(cls, value: "str | WeightFormat", device: torch.device) -> "WeightFormat":
        if isinstance(value, WeightFormat):
            return value
        if value == "auto":
            return cls.NF4 if device.type == "cuda" else cls.INT8
        try:
            return cls(value)
        except ValueError:
            raise UserError(f"--weights {value!r} is not one of auto, 4bit, q4, int8, bf16, f32") from None


FOUR_BIT = (WeightFormat.NF4, WeightFormat.Q4)  # made on the GPU (gpu_ops.nf4.NF4Linear's codes)


@dataclass(frozen=True)
class Home:
    """Where one weight group is stored and in which format (offload.placement derives it from a plan)."""

    fmt: WeightFormat
    device: torch.device
    host_computed: bool = False  # computed by the CPU beside the device (a MoE layer's host experts)


Progress = Callable[[int, int], None]  # (done, total) as the weights are converted
# (layer, group kind[, expert]) → its home; layer -1: embedding and head. With an expert index: that
# expert's (a plan may split a layer's experts between the devices); without: the group's (the router's).
Homes = Callable[..., Home]


def make_linear(w: torch.Tensor, b: torch.Tensor | None, fmt: WeightFormat, device: torch.device) -> Linear:
    if fmt is WeightFormat.F32:
        return Dense(w.float().to(device), None if b is None else b.float().to(device))
    if fmt is WeightFormat.BF16:
        return Dense(w.bfloat16().to(device), None if b is None else b.bfloat16().to(device))
    if fmt is WeightFormat.INT8:
        if device.type != "cpu":
            raise UserError("--weights int8 runs on the CPU only; use --weights 4bit or bf16 with --device cuda")
        return Int8Linear(w, b)
    from gpu_ops.nf4 import nf4_linear  # bitsandbytes is needed only for these formats

    return nf4_linear(w, b, device, codes=_codes(fmt))


def _codes(fmt: WeightFormat):
    """A 4-bit format's `gpu_ops.nf4.Codes`."""
    from gpu_ops.nf4 import Codes

    return Codes.Q4 if fmt is WeightFormat.Q4 else Codes.NF4


def load_model(ck: Checkpoint, fmt: WeightFormat, device: torch.device,
               embed_device: torch.device | None = None, homes: Homes | None = None,
               progress: Progress | None = None, threads: int | None = None, moe_rows: int = 2048,
               moe_upload_rows: int = 0) -> Model:
    """embed_device: where the embedding table lives (the CPU, when the plan keeps it off the GPU:
    a step reads one row per token). homes: each weight group's storage (device and format) when
    not every group is `fmt` on `device`; a group kept on the host in a device format (streamed
    weights) is made on `device` first, so a GPU quantizes it, then moved there, one matrix at a time.
    progress(done, total): called as each layer's weights are ready (total: the layers and the head).
    threads, moe_rows: the CPU threads and the most rows a step gives host-resident experts;
    moe_upload_rows: from how many rows a step copies them up to the GPU instead (0: the default,
    `offload.moe.MoEFeedForward`)."""
    cfg: ModelConfig = ck.config
    act = torch.float32 if fmt in (WeightFormat.F32, WeightFormat.INT8) or device.type == "cpu" else torch.bfloat16
    keep = torch.float32 if act == torch.float32 else torch.bfloat16
    get = ck.get
    has = ck.tensors.__contains__
    four_bit: dict = {}  # a 4-bit format's disk cache (gpu_ops.weight_cache), opened as its first matrix is made

    def cached(f: WeightFormat):
        """f's cache: quantized once, then read back (q4 plans keep their experts NF4: two caches)."""
        if f not in four_bit:
            from gpu_ops.weight_cache import NF4Cache

            c = four_bit[f] = NF4Cache(ck.path, codes=_codes(f))
            log.info("%s weights %s %s", f.value, "from the cache" if c.hit else "quantized now, cached in", c.path)
        return four_bit[f]

    int8 = None
    if fmt is WeightFormat.INT8 and homes is None and device.type == "cpu" and ck.format != "random":
        # converted once, then read back from the disk cache (a random model has no file to key it on)
        from offload.int8_cache import Int8Cache

        int8 = Int8Cache(ck.path)
    home = homes or (lambda layer, kind, expert=None: Home(fmt, device))
    staging: list = []  # the MoE layers' shared host staging, made with the first that needs it

    def lin(where: Home, name: str, weight, b: torch.Tensor | None = None) -> Linear:
        """`weight()` reads (and fuses) the source tensor; a cache hit never calls it."""
        if where.fmt in FOUR_BIT and ck.format != "random":  # a random model has no file to key a cache on
            made = cached(where.fmt).linear(name, weight, b, device)
        elif int8 is not None:
            made = int8.linear(name, weight, b)
        else:
            made = make_linear(weight(), b, where.fmt, device if where.fmt in FOUR_BIT else where.device)
        return move_linear(made, where.device)

    def vec(where: Home, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:  # norms, router
        return get(name).to(where.device, dtype or keep)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn, norms = home(i, Kind.ATTN), home(i, Kind.NORMS)
        qkv_b = torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"]) if cfg.attention_bias else None
        lw = LayerWeights(
            attn_norm=vec(norms, p + "input_layernorm.weight"),
            qkv=lin(attn, a + "qkv", lambda: torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"]), qkv_b),
            o=lin(attn, a + "o", lambda: get(a + "o_proj.weight")),
            mlp_norm=vec(norms, p + "post_attention_layernorm.weight"),
        )
        if cfg.qk_norm:
            lw.q_norm, lw.k_norm = vec(attn, a + "q_norm.weight"), vec(attn, a + "k_norm.weight")
        m = p + "mlp."
        if cfg.moe_layers[i]:
            ex = home(i, Kind.EXPERTS)
            ehomes = [home(i, Kind.EXPERTS, e) for e in range(cfg.num_experts)]

            def pair(e: int, where: Home) -> tuple[Linear, Linear]:
                if where.fmt is WeightFormat.Q4:  # the grouped expert kernels read NF4 (planner: Group.dtype_for)
                    where = Home(WeightFormat.NF4, where.device, where.host_computed)
                x = f"{m}experts.{e}."
                gu = lambda: torch.cat([get(x + "gate_proj.weight"), get(x + "up_proj.weight")])  # noqa: E731
                return lin(where, x + "gate_up", gu), lin(where, x + "down", lambda: get(x + "down_proj.weight"))

            split = _split_moe(ex, ehomes, device)  # MoEFeedForward routes in the activations' dtype (planned as bf16)
            lw.router = vec(ex, m + "gate.weight", None if split else torch.float32)
            if split:
                if not staging and any(h.host_computed for h in ehomes):
                    from offload.moe_host import HostStaging

                    staging.append(HostStaging(cfg, device, moe_rows, threads))
                lw.ffn = _moe_layer(cfg, i, lw.router, ehomes, pair, get, device, staging[0] if staging else None,
                                    threads, moe_upload_rows)
            else:
                lw.experts = [pair(e, ex) for e in range(cfg.num_experts)]
        else:
            mlp = home(i, Kind.MLP)
            lw.gate_up = lin(mlp, m + "gate_up", lambda: torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]))
            lw.down = lin(mlp, m + "down", lambda: get(m + "down_proj.weight"))
        layers.append(lw)
        if progress is not None:
            progress(i + 1, cfg.num_layers + 1)

    embed = get("model.embed_tokens.weight")
    head_w = embed if cfg.tie_word_embeddings or not has("lm_head.weight") else get("lm_head.weight")
    rope_freqs = get("rope_freqs") if has("rope_freqs") else None
    lm_head = lin(home(-1, Kind.LM_HEAD), "lm_head", lambda: head_w)
    for c in four_bit.values():
        c.save()
    if int8 is not None:
        int8.save()
    model = Model(
        cfg,
        embed=embed.to(embed_device or device, keep),
        norm=vec(home(-1, Kind.FINAL_NORM), "model.norm.weight"),
        lm_head=lm_head,
        layers=layers,
        device=device,
        act_dtype=act,
        rope_freqs=rope_freqs,
    )
    model.use_kernels(*kernels_for(device))
    if progress is not None:
        progress(cfg.num_layers + 1, cfg.num_layers + 1)
    return model


def _split_moe(group: Home, homes: list[Home], device: torch.device) -> bool:
    """Whether a MoE layer runs as `offload.moe.MoEFeedForward`: some of its experts computed by the
    host beside the device (which routes), or all NF4 on a GPU (the grouped kernels, which a CUDA
    graph can hold); else the model's own loop over the experts (streamed experts, a CPU plan)."""
    if any(h.host_computed != group.host_computed for h in homes):
        return True
    return device.type == "cuda" and all(h.device == device and h.fmt is WeightFormat.NF4 for h in homes)  # Q4: dense only


_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32}


def _moe_layer(cfg: ModelConfig, layer: int, router: torch.Tensor, homes: list[Home], pair, get,
               device: torch.device, staging, threads: int | None, upload_rows: int = 0):
    """The layer's `MoEFeedForward`: the device's experts and the host's, as `homes` says."""
    from offload.moe import MoEFeedForward, TorchHostExperts

    on_dev = [e for e, h in enumerate(homes) if not h.host_computed]
    on_host = [e for e, h in enumerate(homes) if h.host_computed]
    dx = _device_experts(on_dev, (pair(e, homes[e]) for e in on_dev), device) if on_dev else None
    host = None
    if on_host and homes[on_host[0]].fmt is WeightFormat.INT4:
        host = _int4_experts(cfg, layer, on_host, get, device, threads)
    elif on_host:
        host = TorchHostExperts(on_host, [pair(e, homes[e]) for e in on_host])
    return MoEFeedForward(cfg, router.to(device), dx, host, device, staging, upload_rows)


def _device_experts(experts: list[int], pairs, device: torch.device):
    """The device's experts; NF4 on CUDA: also stacked for the grouped kernel, each expert's codes
    copied into the stacks as it is made (`pairs` yields them one at a time) and its linears made
    views of them."""
    from gpu_ops.nf4 import NF4Linear
    from offload.moe import DeviceExperts

    linears, stacked = [], None
    for n, (gu, dn) in enumerate(pairs):
        parts = ((gu, "packed"), (gu, "absmax"), (dn, "packed"), (dn, "absmax"))
        if device.type == "cuda" and isinstance(gu, NF4Linear) and isinstance(dn, NF4Linear):
            if stacked is None:
                stacked = tuple(torch.empty((len(experts),) + getattr(lin, a).shape, dtype=getattr(lin, a).dtype,
                                            device=device) for lin, a in parts)
            for t, (lin, a) in zip(stacked, parts):
                t[n].copy_(getattr(lin, a))
                setattr(lin, a, t[n])
        linears.append((gu, dn))
    return DeviceExperts(experts, linears, stacked)


def _int4_experts(cfg: ModelConfig, layer: int, experts: list[int], get, device: torch.device, threads: int | None):
    """The host's experts in int4 (`cpu_attention.experts`), quantized from the checkpoint's weights
    on the GPU where there is one; page-locked beside a GPU (a prefill copies them up)."""
    from cpu_attention._numba import physical_cores
    from cpu_attention.experts import HostExperts

    cuda = device.type == "cuda"
    zeros = np.zeros
    if cuda:
        from offload import pinned

        zeros = lambda shape, dt: pinned.zeros(shape, _TORCH[np.dtype(dt)]).numpy()  # noqa: E731
    # one core fewer beside a GPU: the main thread waits for it (spinning) meanwhile
    host = HostExperts(experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                       max(1, (threads or physical_cores()) - cuda), zeros)
    qdev = device if cuda else torch.device("cpu")
    for j, e in enumerate(experts):
        x = f"model.layers.{layer}.mlp.experts.{e}."
        gu = torch.cat([get(x + "gate_proj.weight").to(qdev), get(x + "up_proj.weight").to(qdev)])
        host.set(j, gu, get(x + "down_proj.weight").to(qdev))
    return host


def kernels_for(device: torch.device) -> tuple[FusedLayer | None, ElementwiseOps | None]:
    """The fused kernels a model on `device` takes where its layers' weights fit them: on CUDA
    gpu_ops.fused (NF4 decode layers, and the elementwise ops at any row count; none without
    Triton), on the CPU the int8 decode kernels."""
    if device.type == "cuda":
        try:
            from gpu_ops import fused
        except ImportError:  # no Triton: the torch math
            return None, None
        return fused, fused
    return Int8Layers, None


def move_linear(lin: Linear, device: torch.device) -> Linear:
    """The same linear with its tensors on `device` (in place; a no-op where they are already)."""
    from gpu_ops.nf4 import NF4Linear

    if isinstance(lin, NF4Linear):
        if lin.device != device:
            lin.packed, lin.absmax = lin.packed.to(device), lin.absmax.to(device)
            lin.bias = None if lin.bias is None else lin.bias.to(device)
    elif isinstance(lin, Dense):
        lin.weight = lin.weight.to(device)
        lin.bias = None if lin.bias is None else lin.bias.to(device)
    elif device.type != "cpu":
        raise UserError(f"{type(lin).__name__} weights are computed by the CPU only; they cannot live on {device}")
    return lin
