"""Typer functions for `hetero plan` and `hetero profile` (cli.py registers them).

Each is a few lines over library calls a Python user can make too:
`planner.plan(...)`, `planner.load_or_measure(...)`, `planner.report.render(...)`.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from cpu_attention.layout import KVDtype
from hetero.errors import UserError
from planner import flags
from planner.cost import speculative_gain
from planner.options import budget_from, overrides_from
from planner.plan import Workload
from planner.hardware import RUN_ROWS
from planner.profile import HardwareProfile, cache_path, implausible, load_or_measure
from planner.report import render, to_json
from planner.experts import routing_for
from planner.search import plan
from planner.tensors import WDtype, total_params
from planner.units import format_size as fs


def _fail(e: UserError) -> None:
    Console(stderr=True).print(f"[bold red]error:[/bold red] {e}", highlight=False)
    raise typer.Exit(2)


def _rate(text: str | float) -> float:
    """An acceptance rate in [0, 1)."""
    try:
        x = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number; use a share of drafts kept in [0, 1), e.g. 0.7") from None
    if not 0 <= x < 1:
        raise typer.BadParameter(f"{x} is outside [0, 1); use a share of drafts kept, e.g. 0.7")
    return x


def plan_cmd(
    model_arg: Optional[str] = flags.model_arg(),
    model: Optional[str] = flags.model(),
    ctx_size: int = flags.ctx_size(),
    parallel: int = flags.whole_opt(1, "-np", "--parallel", lo=1, help="sequences decoded together"),
    prompt_tokens: int = flags.whole_opt(0, "-p", "--prompt-tokens", lo=0,
                                         help="prompt length; 0 = ctx-size minus max-new-tokens, and with "
                                              "neither given, as hetero chat and serve plan: decode over "
                                              "the context's second half"),
    max_new_tokens: Optional[int] = flags.whole_opt(None, "-n", "--max-new-tokens", lo=1,
                                                    help="tokens to generate per answer"),
    ubatch: int = flags.whole_opt(2048, "-ub", "--ubatch-size", lo=1, help="prefill chunk, tokens"),
    threads: Optional[int] = flags.threads(),
    gpu_mem: Optional[int] = flags.gpu_mem(),
    cpu_mem: Optional[int] = flags.cpu_mem(),
    kv_dtype: str = flags.kv_dtype(),
    gpu_kv_dtype: str = flags.gpu_kv_dtype(),
    gpu_kv_tokens: Optional[int] = flags.gpu_kv_tokens(),
    n_cpu_moe: int = flags.n_cpu_moe(),
    stream_tokens: Optional[int] = flags.stream_tokens(),
    weights: str = flags.weights(),
    weight_mode: str = flags.weight_mode(),
    device: str = flags.device(),
    sub_batches: Optional[int] = typer.Option(None, "--sub-batches", parser=lambda t: int(flags.one_of("1", "2")(t)),
                                              metavar="1|2", envvar="HETERO_SUB_BATCHES",
                                              help="1 or 2 (default: the faster prediction)"),
    profile: Optional[Path] = typer.Option(None, "--profile", envvar="HETERO_PROFILE",
                                           help="hardware profile JSON to plan for (default: this machine's)"),
    json_: bool = typer.Option(False, "--json", help="print the plan as one JSON document"),
    draft_accept: Optional[float] = flags.option(None, "--draft-accept", parser=_rate, metavar="RATE",
                                                 help="also predict speculative decoding (--draft) at batch 1 "
                                                      "with this share of drafted tokens kept, e.g. 0.7"),
) -> None:
    """Show where weights and KV would go and the predicted speed (reads only headers)."""
    try:
        cfg, checkpoint, notes = _model(model or model_arg)
        hw = _hardware(profile)
        ctx = cfg.context(ctx_size)
        wl = Workload.conversation(ctx, parallel, ubatch) if not (prompt_tokens or max_new_tokens) else \
            Workload(ctx, parallel, prompt_tokens, max_new_tokens or flags.DEFAULT_MAX_NEW_TOKENS, ubatch)
        budget = budget_from(hw, gpu_mem, cpu_mem)
        ov = overrides_from(device=device, weights=weights, kv_dtype=kv_dtype, gpu_kv_dtype=gpu_kv_dtype,
                            threads=threads, sub_batches=sub_batches, gpu_kv_tokens=gpu_kv_tokens,
                            weight_mode=weight_mode, stream_tokens=stream_tokens, n_cpu_moe=n_cpu_moe)
        p = plan(cfg, hw, budget, wl, ov, routing_for(checkpoint["path"], cfg))
    except UserError as e:
        _fail(e)
    notes += [f"the hardware profile looks implausible: {n}; its predictions may be off — run `hetero profile "
              f"--refresh` when the machine is idle" for n in implausible(hw)]
    spec = None if draft_accept is None else speculative_gain(cfg, hw, p, draft_accept)
    if json_:
        for n in notes:
            Console(stderr=True).print(f"[yellow]note:[/yellow] {n}", highlight=False)
        extra = None if spec is None else {
            "speculative": {"draft_accept": draft_accept, "draft_tokens": spec[0], "speed_up": spec[1]}}
        sys.stdout.write(to_json(p, checkpoint, extra) + "\n")
        return
    console = Console()
    for n in notes:
        console.print(f"[yellow]note:[/yellow] {n}", highlight=False)
    render(p, console, checkpoint)
    if spec is not None:
        k, gain = spec
        console.print(f"speculative decoding, {draft_accept:.0%} of drafts kept: " + (
            f"[bold]{gain:.2f}×[/bold] at {k} drafted a step (batch 1)" if k else
            "no draft length pays on this plan (each drafted row costs about a step)"), highlight=False)


def _model(path: Optional[str]):
    """(config, checkpoint summary, notes) from headers only."""
    from hetero.checkpoint import inspect
    from hetero.demo import demo_model_path

    path = path or demo_model_path()

    info = inspect(path)
    params = sum(math.prod(t.shape) for t in info.tensors.values())
    summary = {"path": str(info.path), "format": info.format, "tensors": len(info.tensors),
               "nbytes": info.nbytes, "params": params}
    notes = []
    expected = total_params(info.config)
    if params and abs(params - expected) > 0.02 * expected:
        notes.append(f"the checkpoint holds {params / 1e9:.2f}B parameters, the config implies "
                     f"{expected / 1e9:.2f}B: sizes below follow the config")
    return info.config, summary, notes


def _hardware(path: Optional[Path]) -> HardwareProfile:
    if path is not None:
        try:
            return HardwareProfile.from_json(Path(path).read_text())
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise UserError(f"cannot read the hardware profile {path}: {e}") from e
    if not cache_path().is_file():
        Console(stderr=True).print("[dim]measuring this machine once (under 30 s); `hetero profile --refresh` repeats it[/dim]")
    return load_or_measure()


def profile_cmd(
    refresh: bool = typer.Option(False, "--refresh", help="measure again instead of using the cached profile"),
    json_: bool = typer.Option(False, "--json", help="print the profile as JSON"),
) -> None:
    """Measure this machine (bandwidths, attention and GEMV rates) and cache the result."""
    try:
        if refresh or not cache_path().is_file():
            Console(stderr=True).print("[dim]measuring (under 30 s)…[/dim]")
        hw = load_or_measure(refresh=refresh)
    except UserError as e:
        _fail(e)
    if json_:
        sys.stdout.write(hw.to_json() + "\n")
        return
    render_profile(hw, Console())


def render_profile(hw: HardwareProfile, console: Console) -> None:
    t = Table(title=f"hardware profile · {hw.created} · cached in {cache_path()}", title_justify="left")
    t.add_column("what")
    t.add_column("value", justify="right")
    rows = [
        ("host memory (available / total)", f"{fs(hw.host_available_bytes)} / {fs(hw.host_total_bytes)}"),
        ("cores (physical / logical)", f"{hw.physical_cores} / {hw.logical_cpus}"),
        ("DRAM read", f"{hw.dram_read_gbps:.1f} GB/s"),
        (f"CPU GEMV ({hw.cpu_gemv_dtype})", f"{hw.cpu_gemv_gbps:.1f} GB/s of weights"),
        ("CPU fp32 matmul", f"{hw.cpu_gflops:.0f} GFLOP/s"),
    ]
    rows += [(f"CPU attention {r.dtype} × {r.threads} threads", f"{r.gbps:.1f} GB/s of KV"
              + (f"; a run of {RUN_ROWS} rows {r.run_cost:.1f}× one row" if r.run_cost else "")
              + (f"; +{r.item_s * 1e6:.1f} µs a further sequence and kv head" if r.item_s else ""))
             for r in hw.cpu_attention]
    if hw.has_gpu:
        rows += [
            ("GPU", hw.gpu_name or ""),
            ("GPU memory (free / total)", f"{fs(hw.gpu_free_bytes)} / {fs(hw.gpu_total_bytes)}"),
            ("PCIe host → device (pinned)", f"{hw.pcie_h2d_gbps:.1f} GB/s"),
            ("PCIe device → host (pinned)", f"{hw.pcie_d2h_gbps:.1f} GB/s"),
            ("PCIe small-copy latency", f"{hw.pcie_latency_s * 1e6:.1f} µs"),
            ("HBM copy (read + write)", f"{hw.hbm_gbps:.0f} GB/s"),
            ("GPU attention (bf16 / int8 / int4 KV)", f"{hw.gpu_attention_gbps:.0f} / "
             f"{hw.gpu_attention_rate(KVDtype.INT8):.0f} / {hw.gpu_attention_rate(KVDtype.INT4):.0f} GB/s of KV"),
            (f"GPU GEMV ({hw.gpu_gemv_dtype})", f"{hw.gpu_gemv_gbps:.0f} GB/s of weights at 1 row, "
                                                f"{hw.gpu_linear_gbps(32):.0f} at 32"),
            *([("GPU GEMV (q4)", f"{hw.gpu_gemv_q4_gbps:.0f} GB/s of weights at 1 row, "
                                 f"{hw.gpu_linear_gbps(32, WDtype.Q4):.0f} at 32")] if hw.gpu_gemv_q4_gbps else []),
            ("GPU bf16 matmul", f"{hw.gpu_tflops:.0f} TFLOP/s"),
        ]
    for what, value in rows:
        t.add_row(what, value)
    console.print(t)
    for n in hw.notes:
        console.print(f"[dim]{n}[/dim]")
