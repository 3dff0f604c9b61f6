"""Typer functions for `hetero serve`, `hetero monitor` and `hetero bench` (cli.py registers them).

Each is a few lines over a library call a Python user can make too: `hetero.app.serve.serve`,
`hetero.app.monitor.run_monitor` / `render_once`, `hetero.app.bench.run_bench`.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import typer
from rich.console import Console

from hetero.errors import UserError

err = Console(stderr=True, soft_wrap=True)


def _opt(default, *names: str, help: str = ""):
    env = "HETERO_" + names[-1].lstrip("-").replace("-", "_").upper()
    return typer.Option(default, *names, envvar=env, help=help, show_default=True)


def _fail(e: UserError) -> None:
    err.print(f"[bold red]error:[/bold red] {e}", highlight=False)
    raise typer.Exit(2)


def serve_cmd(
    model_arg: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="HF folder or .gguf (default: demo model)"),
    model: Optional[str] = _opt(None, "-m", "--model", help="HF folder or .gguf"),
    host: str = _opt("127.0.0.1", "--host", help="address to listen on"),
    port: int = _opt(8080, "--port", help="TCP port"),
    parallel: int = _opt(4, "-np", "--parallel", help="sequences decoded together (each gets a full context of KV)"),
    queue: int = _opt(64, "--queue", help="requests that may wait beyond --parallel; more get 503 + Retry-After"),
    alias: Optional[str] = _opt(None, "-a", "--alias", help="model id in /v1/models (default: the file or folder name)"),
    ctx_size: int = _opt(0, "-c", "--ctx-size", help="context length per sequence; 0 = the model's (capped at 4096)"),
    max_new_tokens: Optional[int] = _opt(None, "-n", "--max-new-tokens",
                                         help="default max_tokens of a request (default: until the context ends)"),
    threads: Optional[int] = _opt(None, "-t", "--threads", help="CPU threads for host attention"),
    kv_dtype: Optional[str] = _opt(None, "--kv-dtype", help="host KV precision: bf16|int8|int4|f32"),
    gpu_kv_dtype: Optional[str] = _opt(None, "--gpu-kv-dtype", help="GPU KV precision: bf16|int8|int4|f32"),
    weights: str = _opt("auto", "--weights", help="weight precision: auto|4bit|int8|bf16|f32"),
    device: str = _opt("auto", "--device", help="auto|cpu|cuda"),
    gpu_mem: Optional[str] = _opt(None, "--gpu-mem", help="GPU budget, a hard limit (e.g. 6GiB)"),
    cpu_mem: Optional[str] = _opt(None, "--cpu-mem", help="host budget (e.g. 48GiB)"),
    gpu_kv_tokens: Optional[int] = _opt(None, "--gpu-kv-tokens", help="KV tokens per sequence kept on the GPU"),
    stream_tokens: Optional[int] = _opt(None, "--kv-stream-tokens", help="host KV tokens the GPU attends over (batch 1)"),
    weight_mode: str = _opt("auto", "--weight-mode", help="weights that do not fit the GPU: auto|stream|cpu"),
    plan: Optional[str] = _opt(None, "--plan", help="run exactly this saved plan"),
    temperature: Optional[float] = _opt(None, "--temp", "--temperature", help="default temperature"),
    top_k: Optional[int] = _opt(None, "--top-k"),
    top_p: Optional[float] = _opt(None, "--top-p"),
    min_p: Optional[float] = _opt(None, "--min-p"),
    repeat_penalty: Optional[float] = _opt(None, "--repeat-penalty"),
    seed: Optional[int] = _opt(None, "--seed"),
    verbose: bool = _opt(False, "-v", "--verbose"),
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), /health and /metrics."""
    import hetero
    from hetero.app.serve import ServeOptions, serve

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                    seed=seed)
    try:
        opts = ServeOptions(host=host, port=port, parallel=parallel, queue=queue, max_new_tokens=max_new_tokens,
                            model_name=alias, log_level="info" if verbose else "warning")
        load = functools.partial(hetero.load, model or model_arg, device=device, weights=weights, kv_dtype=kv_dtype,
                                 gpu_kv_dtype=gpu_kv_dtype, ctx_size=ctx_size, parallel=parallel, threads=threads, gpu_mem=gpu_mem,
                                 cpu_mem=cpu_mem, gpu_kv_tokens=gpu_kv_tokens, stream_tokens=stream_tokens,
                                 weight_mode=weight_mode, plan=plan,
                                 **{k: v for k, v in sampling.items() if v is not None})
        err.print(f"[dim]hetero serve: listening on http://{host}:{port} (loading the model; /health is 503 "
                  f"until it is ready)[/dim]", highlight=False)
        serve(load, opts)
    except UserError as e:
        _fail(e)


def bench_cmd(
    model_arg: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="HF folder or .gguf (default: demo model)"),
    model: Optional[str] = _opt(None, "-m", "--model", help="HF folder or .gguf"),
    random: Optional[str] = _opt(None, "--random",
                                 help="a random-weight model of a named shape, built in memory: llama3-8b, llama3-70b, "
                                      "qwen3-8b, qwen3-30b-a3b, mixtral-8x7b, smollm2-135m"),
    n_prompt: int = _opt(512, "-p", "--n-prompt", help="prompt tokens (pp test; 0: none)"),
    n_gen: int = _opt(128, "-n", "--n-gen", help="generated tokens (tg test; 0: none)"),
    depth: str = _opt("0", "-d", "--n-depth", help="context already there, comma-separated (e.g. 0,8192,32768)"),
    reps: int = _opt(3, "-r", "--repetitions", help="repetitions of each test"),
    parallel: str = _opt("1", "-b", "--parallel", help="sequences decoded together, comma-separated (e.g. 1,16)"),
    kv_dtype: Optional[str] = _opt(None, "--kv-dtype", help="host KV precision(s), comma-separated: bf16,int8,int4"),
    output: str = _opt("md", "-o", "--output", help="md|json|csv"),
    threads: Optional[int] = _opt(None, "-t", "--threads", help="CPU threads for host attention"),
    weights: str = _opt("auto", "--weights", help="weight precision: auto|4bit|int8|bf16|f32"),
    device: str = _opt("auto", "--device", help="auto|cpu|cuda"),
    gpu_mem: Optional[str] = _opt(None, "--gpu-mem", help="GPU budget, a hard limit (e.g. 8GiB)"),
    cpu_mem: Optional[str] = _opt(None, "--cpu-mem", help="host budget (e.g. 48GiB)"),
    gpu_kv_tokens: Optional[int] = _opt(None, "--gpu-kv-tokens", help="KV tokens per sequence kept on the GPU"),
    weight_mode: str = _opt("auto", "--weight-mode", help="weights that do not fit the GPU: auto|stream|cpu"),
    verbose: bool = _opt(False, "-v", "--verbose"),
) -> None:
    """Measure prompt and generation tokens/s (llama-bench style), one row per combination."""
    import sys

    import hetero
    from hetero.app.bench import BenchSpec, parse_list, render, run_bench

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    try:
        if output not in ("md", "json", "csv"):
            raise UserError(f"-o {output!r} is not one of md, json, csv")
        if random and (model or model_arg):
            raise UserError("give a MODEL or --random SHAPE, not both")
        spec = BenchSpec(n_prompt=n_prompt, n_gen=n_gen, depths=parse_list(depth, "-d"), reps=reps,
                         batches=parse_list(parallel, "-b"),
                         kv_dtypes=tuple(kv_dtype.split(",")) if kv_dtype else (None,))
        source = model or model_arg
        if random:
            import torch

            from hetero.random_weights import RandomCheckpoint, random_shape

            on_gpu = device != "cpu" and torch.cuda.is_available()
            source = RandomCheckpoint(random_shape(random), device="cuda" if on_gpu else "cpu")
        load = functools.partial(hetero.load, source, device=device, weights=weights, threads=threads, gpu_mem=gpu_mem,
                                 cpu_mem=cpu_mem, gpu_kv_tokens=gpu_kv_tokens, weight_mode=weight_mode)
        rows = run_bench(load, spec, on_row=lambda r: err.print(f"[dim]{r.test} batch {r.n_batch} {r.kv_dtype}: "
                                                                f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f} t/s[/dim]"))
        sys.stdout.write(render(rows, output) + "\n")
    except UserError as e:
        _fail(e)


def monitor_cmd(
    url: str = typer.Argument("http://127.0.0.1:8080", help="the hetero server to watch"),
    once: bool = _opt(False, "--once", help="print one frame as plain text and exit"),
) -> None:
    """Watch a running `hetero serve`: throughput, latency, KV per tier, memory, busy devices (q quits, p pauses)."""
    import sys

    from hetero.app.monitor import render_once, run_monitor

    try:
        if once:
            sys.stdout.write(render_once(url))
            return
        run_monitor(url)
    except UserError as e:
        _fail(e)
    except KeyboardInterrupt:
        pass
