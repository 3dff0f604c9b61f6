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
from planner.options import budget_from, overrides_from
from planner.plan import Workload
from planner.profile import HardwareProfile, cache_path, load_or_measure
from planner.report import render, to_json
from planner.search import plan
from planner.tensors import total_params
from planner.units import format_size as fs


def _opt(default, *names: str, help: str = ""):
    env = "HETERO_" + names[-1].lstrip("-").replace("-", "_").upper()
    return typer.Option(default, *names, envvar=env, help=help, show_default=True)


def _fail(e: UserError) -> None:
    Console(stderr=True).print(f"[bold red]error:[/bold red] {e}", highlight=False)
    raise typer.Exit(2)


def plan_cmd(
    model_arg: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="HF folder or .gguf (headers only are read)"),
    model: Optional[str] = _opt(None, "-m", "--model", help="HF folder or .gguf"),
    ctx_size: int = _opt(0, "-c", "--ctx-size", help="context length per sequence; 0 = the model's"),
    parallel: int = _opt(1, "-np", "--parallel", help="sequences decoded together"),
    prompt_tokens: int = _opt(0, "-p", "--prompt-tokens", help="prompt length; 0 = ctx-size minus max-new-tokens"),
    max_new_tokens: int = _opt(256, "-n", "--max-new-tokens", help="tokens generated per answer"),
    ubatch: int = _opt(2048, "-ub", "--ubatch-size", help="prefill chunk, tokens"),
    threads: Optional[int] = _opt(None, "-t", "--threads", help="CPU threads for host attention (default: physical cores)"),
    gpu_mem: Optional[str] = _opt(None, "--gpu-mem", help="GPU budget, e.g. 8GiB (default: free minus a margin)"),
    cpu_mem: Optional[str] = _opt(None, "--cpu-mem", help="host budget, e.g. 48GiB (default: available minus a margin)"),
    kv_dtype: Optional[str] = _opt(None, "--kv-dtype", help="host-tier KV: auto|bf16|int8|int4"),
    gpu_kv_dtype: Optional[str] = _opt(None, "--gpu-kv-dtype", help="GPU-tier KV: auto|bf16|int8|int4"),
    gpu_kv_tokens: Optional[int] = _opt(None, "--gpu-kv-tokens", help="GPU-tier KV tokens per sequence"),
    stream_tokens: Optional[int] = _opt(None, "--kv-stream-tokens",
                                        help="host-tier KV tokens the GPU attends over after copying them up each step (batch 1)"),
    weights: str = _opt("auto", "--weights", help="auto|4bit|int8|bf16|f32 (int8: CPU only)"),
    weight_mode: str = _opt("auto", "--weight-mode", help="weights that do not fit the GPU: auto|stream|cpu"),
    device: str = _opt("auto", "--device", help="auto|cpu|cuda"),
    sub_batches: Optional[int] = _opt(None, "--sub-batches", help="1 or 2 (default: the faster prediction)"),
    profile: Optional[Path] = _opt(None, "--profile", help="hardware profile JSON to plan for (default: this machine's)"),
    json_: bool = _opt(False, "--json", help="print the plan as one JSON document"),
) -> None:
    """Show where weights and KV would go and the predicted speed (reads only headers)."""
    try:
        cfg, checkpoint, notes = _model(model or model_arg)
        hw = _hardware(profile)
        wl = Workload(ctx_size, parallel, prompt_tokens, max_new_tokens, ubatch)
        if parallel < 1 or max_new_tokens < 1 or ubatch < 1 or ctx_size < 0:
            raise UserError("--parallel, --max-new-tokens and --ubatch-size must be ≥ 1, --ctx-size ≥ 0")
        budget = budget_from(hw, gpu_mem, cpu_mem)
        ov = overrides_from(device=device, weights=weights, kv_dtype=kv_dtype, gpu_kv_dtype=gpu_kv_dtype,
                            threads=threads, sub_batches=sub_batches, gpu_kv_tokens=gpu_kv_tokens,
                            weight_mode=weight_mode, stream_tokens=stream_tokens)
        p = plan(cfg, hw, budget, wl, ov)
    except UserError as e:
        _fail(e)
    if json_:
        sys.stdout.write(to_json(p, checkpoint) + "\n")
        return
    console = Console()
    for n in notes:
        console.print(f"[yellow]note:[/yellow] {n}", highlight=False)
    render(p, console, checkpoint)


def _model(path: Optional[str]):
    """(config, checkpoint summary, notes) from headers only."""
    from hetero.config import LLAMA3_8B

    if path is None:
        return LLAMA3_8B, None, ["no model given: planning for the Llama-3-8B shape"]
    from hetero.checkpoint import inspect

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
    refresh: bool = _opt(False, "--refresh", help="measure again instead of using the cached profile"),
    json_: bool = _opt(False, "--json", help="print the profile as JSON"),
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
    rows += [(f"CPU attention {r.dtype} × {r.threads} threads", f"{r.gbps:.1f} GB/s of KV") for r in hw.cpu_attention]
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
            ("GPU bf16 matmul", f"{hw.gpu_tflops:.0f} TFLOP/s"),
        ]
    for what, value in rows:
        t.add_row(what, value)
    console.print(t)
    for n in hw.notes:
        console.print(f"[dim]{n}[/dim]")
