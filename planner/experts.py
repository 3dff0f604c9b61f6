"""Mixture-of-experts layers placed expert by expert: how many of a layer's experts the GPU holds, and
the two placements (the GPU's part with the router, the host's) of a layer split between them.

Routing statistics (`hetero profile-experts`: how often each expert of each layer was routed to over
a set of prompts) pick which experts the GPU holds, the most used first, and tell the cost model
which share of a layer's routed slots each part takes; without them, routing is taken as uniform
and a layer's first experts go to the GPU. They are kept beside the hardware profile, one file a
model (`routing_path`)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hetero.config import ModelConfig
from hetero.errors import UserError
from hetero.paths import cache_dir
from planner.cost import HOST_EXPERTS_STEP_SHARE
from planner.hardware import HardwareProfile
from planner.plan import Choice, Device, Mode, Placement
from planner.tensors import Group, Kind, WDtype, cpu_dtype, expert_bytes, router_bytes


def spread_experts(groups: list[Group], weights: WDtype, room: int, n_cpu_moe: int) -> dict[int, int]:
    """Experts group index → how many of its experts the GPU holds, the room (after the routers)
    spread evenly over the layers at or past n_cpu_moe."""
    moe = [i for i, g in enumerate(groups) if g.kind is Kind.EXPERTS]
    room -= sum(router_bytes(groups[i]) for i in moe)
    eligible = [i for i in moe if groups[i].layer >= n_cpu_moe]
    counts = dict.fromkeys(moe, 0)
    if not eligible or room <= 0:
        return counts
    g0 = groups[eligible[0]]
    E = g0.params // g0.expert_params
    total = min(room // expert_bytes(g0, weights), E * len(eligible))
    base, extra = divmod(total, len(eligible))
    for rank, i in enumerate(eligible):
        counts[i] = base + (rank < extra)
    return counts


def expert_parts(g: Group, weights: WDtype, n: int, heat: list[float] | None = None) -> list[Placement]:
    """An experts group with n experts on the GPU (with the router), the rest on the host: the n
    most routed to in `heat` (the layer's routing counts), else its first n."""
    E = g.params // g.expert_params
    host = cpu_dtype(weights, Kind.EXPERTS)
    weights = g.dtype_for(weights)  # the device's experts' format (NF4 under --weights q4)
    if n >= E:
        return [Placement(g.layer, g.kind, Device.CUDA, weights, Mode.RESIDENT, g.nbytes(weights))]
    order = sorted(range(E), key=lambda e: -heat[e]) if heat else list(range(E))
    dev, rest = tuple(sorted(order[:n])), tuple(sorted(order[n:]))
    total = sum(heat) if heat else 0.0
    share = (lambda ids: sum(heat[e] for e in ids) / total) if total > 0 else (lambda ids: None)  # noqa: E731
    return [Placement(g.layer, g.kind, Device.CUDA, weights, Mode.RESIDENT,
                      router_bytes(g) + n * expert_bytes(g, weights), dev, share(dev)),
            Placement(g.layer, g.kind, Device.CPU, host, Mode.CPU, (E - n) * expert_bytes(g, host), rest, share(rest))]


def routing_path(model_path: str | Path) -> Path:
    """Where `hetero profile-experts` keeps a model's routing statistics."""
    key = hashlib.sha1(str(Path(model_path).resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "experts" / f"{Path(model_path).name}-{key}.json"


def save_routing(path: Path, model: str, counts: dict[int, list[float]], prompts: int, tokens: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "prompts": prompts, "tokens": tokens,
                               "layers": {str(i): c for i, c in counts.items()}}))


def routing_for(model_path: str | Path, cfg: ModelConfig) -> dict[int, list[float]] | None:
    """The model's saved routing statistics, or None (not a MoE model, or none saved)."""
    path = routing_path(model_path)
    return load_routing(path, cfg) if cfg.is_moe and path.is_file() else None


def load_routing(path: Path, cfg: ModelConfig) -> dict[int, list[float]]:
    """A model's routing statistics: layer → per-expert counts (checked against the config)."""
    try:
        d = json.loads(Path(path).read_text())
        counts = {int(i): [float(x) for x in c] for i, c in d["layers"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read the routing statistics {path}: {e}") from e
    if any(not 0 <= i < cfg.num_layers or not cfg.moe_layers[i] or len(c) != cfg.num_experts for i, c in counts.items()):
        raise UserError(f"the routing statistics {path} do not match this model's layers and experts: "
                        "make them again with `hetero profile-experts`")
    return counts


def upload_choice(hw: HardwareProfile, rows: int) -> Choice:
    """The plan's line on from how many rows a step's host experts go up to the GPU
    (`planner.cost.host_experts_upload_rows`)."""
    return Choice("host experts", f"go up to the GPU for steps of {rows}+ rows",
                  "the CPU decodes a host expert once a token routed to it, a copy reads it once: at "
                  f"{hw.cpu_experts_rate * HOST_EXPERTS_STEP_SHARE:.0f} GB/s in a step against PCIe's "
                  f"{hw.pcie_h2d_gbps:.0f}, the copy is the faster "
                  f"from {rows} rows (prefill chunks, large batches)")


def experts_choice(cfg: ModelConfig, placements: tuple[Placement, ...], order: str) -> Choice:
    """The plan's line on where a MoE model's experts went (some weights are off the GPU)."""
    split = [p for p in placements if p.kind is Kind.EXPERTS and p.experts is not None and p.on_gpu]
    if split:
        n = [len(p.experts) for p in split]
        shares = [p.share for p in split if p.share is not None]
        which = (f"the most routed to in the routing statistics ({100 * sum(shares) / len(shares):.0f}% of the "
                 "routed slots)") if shares else "no routing statistics: any of them alike (`hetero profile-experts`)"
        return Choice("experts", f"{min(n)}–{max(n)} of {cfg.num_experts} a layer on the GPU",
                      f"the GPU's room after the other weights, spread over the layers; {which}; the rest int4 in "
                      "host memory, computed by the CPU beside the GPU's (copied up to the GPU for steps of many rows)")
    why = "attention weights are read whole each step, experts only as routed" if order == "attention first" \
        else "experts and MLP before attention weights"
    return Choice("GPU priority", order, why + " (the faster prediction)")
