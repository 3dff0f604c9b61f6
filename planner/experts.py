"""Mixture-of-experts layers placed expert by expert: how many of a layer's experts the GPU holds, and
the two placements (the GPU's part with the router, the host's) of a layer split between them."""
from __future__ import annotations

from hetero.config import ModelConfig
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


def expert_parts(g: Group, weights: WDtype, n: int) -> list[Placement]:
    """An experts group with its first n experts on the GPU (with the router), the rest on the host."""
    E = g.params // g.expert_params
    if n >= E:
        return [Placement(g.layer, g.kind, Device.CUDA, weights, Mode.RESIDENT, g.nbytes(weights))]
    host = cpu_dtype(weights, Kind.EXPERTS)
    return [Placement(g.layer, g.kind, Device.CUDA, weights, Mode.RESIDENT,
                      router_bytes(g) + n * expert_bytes(g, weights), tuple(range(n))),
            Placement(g.layer, g.kind, Device.CPU, host, Mode.CPU, (E - n) * expert_bytes(g, host),
                      tuple(range(n, E)))]


def experts_choice(cfg: ModelConfig, placements: tuple[Placement, ...], order: str) -> Choice:
    """The plan's line on where a MoE model's experts went (some weights are off the GPU)."""
    split = [len(p.experts) for p in placements if p.kind is Kind.EXPERTS and p.experts is not None and p.on_gpu]
    if split:
        return Choice("experts", f"{min(split)}–{max(split)} of {cfg.num_experts} a layer on the GPU",
                      "the GPU's room after the other weights, spread over the layers; the rest int4 in host "
                      "memory, computed by the CPU beside the GPU's (copied up for a prefill)")
    why = "attention weights are read whole each step, experts only as routed" if order == "attention first" \
        else "experts and MLP before attention weights"
    return Choice("GPU priority", order, why + " (the faster prediction)")
