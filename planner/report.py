"""`hetero plan`'s report: the per-layer table, KV per tier, totals against the budgets, the
predictions with the bottleneck named, and every automatic choice (rich), or one JSON document."""
from __future__ import annotations

import json
from itertools import groupby
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.plan import Device, Mode, Placement, Plan
from planner.tensors import Kind
from planner.units import format_size as fs
from planner.units import format_tokens


def summary_line(p: Plan) -> str:
    """`offloaded 32/32 layers' weights to GPU (4.9 GiB of 5.9 GiB) · KV 8k GPU / 24k CPU · 46%/54% CPU/GPU`
    (a layer counts when all its groups are on the GPU; the shares are of the bytes one decode
    step reads)."""
    kv, m = p.kv, p.memory
    total = m.gpu_weights + m.host_weights
    if p.device is Device.CPU:
        return (f"on the CPU: {p.weights.value} weights {fs(total)} · KV {format_tokens(kv.host_tokens)} "
                f"{kv.host_dtype.value} a sequence · {p.threads} threads")
    split = [len(x.experts) for x in p.placements if x.experts is not None and x.on_gpu]
    if split:  # a MoE plan placed expert by expert: the layers whose other weights are all on the GPU
        off = {x.layer for x in p.placements if x.layer >= 0 and not x.on_gpu and x.experts is None}
        first = next(x.layer for x in p.placements if x.experts is not None)
        E = sum(len(x.experts) for x in p.expert_placements(first))
        layers = (f"{p.num_layers - len(off)}/{p.num_layers} layers ({min(split)}–{max(split)} of their {E} "
                  "experts each)")
    else:
        layers = f"{p.gpu_layers}/{p.num_layers} layers' weights"
    return (f"offloaded {layers} to GPU "
            f"({fs(m.gpu_weights)} of {fs(total)}) · "
            f"KV {format_tokens(kv.gpu_tokens)} GPU / {format_tokens(kv.host_tokens)} CPU · "
            f"{100 * p.prediction.cpu_share:.0f}%/{100 * p.prediction.gpu_share:.0f}% CPU/GPU")


def _where(pl: Placement) -> str:
    if pl.mode is Mode.STREAM:
        return "cpu → cuda (stream)"
    return pl.device.value


def _group(x: Placement, layer: list[Placement]) -> str:
    """The group's name; a split experts group's parts say how many of the layer's experts each holds
    (the device's part also holds the router)."""
    if x.experts is None:
        return x.kind.value
    E = sum(len(y.experts or ()) for y in layer if y.kind is Kind.EXPERTS)
    return f"experts {len(x.experts)}/{E}" + (" + router" if x.on_gpu else "")


def _layer_rows(p: Plan) -> list[tuple[str, str, int, str, str]]:
    """Rows (layers, groups, bytes, dtype, device); runs of identical layers collapse to one row."""
    per_layer = {layer: list(pls) for layer, pls in groupby(
        sorted((x for x in p.placements if x.layer >= 0), key=lambda x: x.layer), key=lambda x: x.layer)}
    sig = lambda pls: tuple((_group(x, pls), x.dtype, x.mode, x.device, x.nbytes) for x in pls)  # noqa: E731
    rows: list[tuple[str, str, int, str, str]] = []
    head = {x.kind: x for x in p.placements if x.layer < 0}
    if Kind.EMBED in head:
        e = head[Kind.EMBED]
        rows.append(("embed", "embedding", e.nbytes, e.dtype.value, _where(e)))
    layers = sorted(per_layer)
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and sig(per_layer[layers[j + 1]]) == sig(per_layer[layers[i]]):
            j += 1
        name = str(layers[i]) if i == j else f"{layers[i]}–{layers[j]}"
        for x in per_layer[layers[i]]:
            rows.append((name, _group(x, per_layer[layers[i]]), x.nbytes * (j - i + 1), x.dtype.value, _where(x)))
            name = ""
        i = j + 1
    for k in (Kind.FINAL_NORM, Kind.LM_HEAD):
        if k in head:
            x = head[k]
            rows.append(("head", k.value, x.nbytes, x.dtype.value, _where(x)))
    return rows


def render(p: Plan, console: Console, checkpoint: dict[str, Any] | None = None) -> None:
    """Print the plan as UX.md's `hetero plan` describes."""
    wl = p.workload
    title = f"{p.model or 'model'} · ctx {wl.ctx_size} × {wl.batch} seq · prompt {wl.prompt_tokens} + {wl.gen_tokens} new"
    if checkpoint:
        console.print(f"[dim]checkpoint {checkpoint['path']}: {checkpoint['format']}, {checkpoint['tensors']} tensors, "
                      f"{fs(checkpoint['nbytes'])} (headers only)[/dim]")
    t = Table(title=title, title_justify="left")
    for col, just in (("layers", "right"), ("group", "left"), ("bytes", "right"), ("dtype", "left"), ("device", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for layers, group, nbytes, dtype, dev in _layer_rows(p):
        style = "" if dev == "cuda" else "yellow"
        t.add_row(layers, group, fs(nbytes), dtype, dev, style=style)
    console.print(t)

    kv, m = p.kv, p.memory
    k = Table(title="KV cache (per sequence, block size %d)" % kv.block_size, title_justify="left")
    for col in ("tier", "tokens", "dtype", "bytes (batch)"):
        k.add_column(col, justify="right" if col != "tier" else "left")
    k.add_row("GPU", str(kv.gpu_tokens), kv.gpu_dtype.value, fs(kv.gpu_bytes))
    k.add_row("CPU", str(kv.host_tokens), kv.host_dtype.value, fs(kv.host_bytes))
    console.print(k)
    if kv.stream_tokens:
        console.print(f"of the CPU tier, each sequence's first {kv.stream_tokens} tokens are copied up each "
                      "step and attended by the GPU (they stay stored on the host)")

    mem = Table(title="memory", title_justify="left")
    for col in ("device", "weights", "KV", "workspace", "total", "budget", "free"):
        mem.add_column(col, justify="left" if col == "device" else "right")
    if m.gpu_budget or m.gpu_used:
        mem.add_row("cuda:0", fs(m.gpu_weights), fs(m.gpu_kv), fs(m.gpu_workspace), fs(m.gpu_used),
                    fs(m.gpu_budget), fs(m.gpu_free))
    mem.add_row("host", fs(m.host_weights), fs(m.host_kv), "–", fs(m.host_used), fs(m.host_budget),
                fs(m.host_available))
    console.print(mem)

    pr = p.prediction
    console.print(summary_line(p))
    console.print(f"predicted: prefill [bold]{pr.prefill_tok_s:.0f}[/bold] tok/s · decode [bold]{pr.decode_tok_s:.1f}[/bold] tok/s "
                  f"({pr.decode_step_ms:.1f} ms a step at {wl.decode_context} tokens, {p.sub_batches} sub-batch"
                  f"{'es' if p.sub_batches > 1 else ''}, {p.threads} threads)")
    console.print(f"bottleneck: {pr.bottleneck}")
    if p.choices:
        console.print("automatic choices:")
        for c in p.choices:
            console.print(f"  [cyan]{c.setting}[/cyan] {c.value} [dim]— {c.reason}[/dim]", highlight=False)


def to_json(p: Plan, checkpoint: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> str:
    """The Plan itself (predictions included), plus the summary line, the checkpoint seen and any
    `extra` sections (`hetero plan --draft-accept`'s prediction)."""
    d = p.to_dict()
    d["summary"] = summary_line(p)
    if checkpoint:
        d["checkpoint"] = checkpoint
    return json.dumps({**d, **(extra or {})}, indent=1)
