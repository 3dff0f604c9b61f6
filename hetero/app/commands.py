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
from planner import flags

err = Console(stderr=True, soft_wrap=True)


def _fail(e: UserError) -> None:
    err.print(f"[bold red]error:[/bold red] {e}", highlight=False)
    raise typer.Exit(2)


def serve_cmd(
    model_arg: Optional[str] = flags.model_arg(),
    model: Optional[str] = flags.model(),
    host: str = flags.option("127.0.0.1", "--host", help="address to listen on"),
    port: int = flags.whole_opt(8080, "--port", lo=1, help="TCP port"),
    parallel: int = flags.parallel(4),
    queue: int = flags.whole_opt(64, "--queue", lo=0, help="requests that may wait beyond --parallel; more get 503 + Retry-After"),
    alias: Optional[str] = flags.option(None, "-a", "--alias", help="model id in /v1/models (default: the file or folder name)"),
    ctx_size: int = flags.ctx_size(),
    max_new_tokens: Optional[int] = flags.whole_opt(None, "-n", "--max-new-tokens", lo=1,
                                                    help="default max_tokens of a request (default: until the context ends)"),
    threads: Optional[int] = flags.threads(),
    kv_dtype: str = flags.kv_dtype(),
    gpu_kv_dtype: str = flags.gpu_kv_dtype(),
    weights: str = flags.weights(),
    device: str = flags.device(),
    gpu_mem: Optional[int] = flags.gpu_mem(),
    cpu_mem: Optional[int] = flags.cpu_mem(),
    gpu_kv_tokens: Optional[int] = flags.gpu_kv_tokens(),
    n_cpu_moe: int = flags.n_cpu_moe(),
    stream_tokens: Optional[int] = flags.stream_tokens(),
    weight_mode: str = flags.weight_mode(),
    plan: Optional[str] = flags.plan_file(),
    draft: str = flags.draft(),
    draft_model: Optional[str] = flags.draft_model(),
    temperature: Optional[float] = flags.temperature(),
    top_k: Optional[int] = flags.top_k(),
    top_p: Optional[float] = flags.top_p(),
    min_p: Optional[float] = flags.min_p(),
    repeat_penalty: Optional[float] = flags.repeat_penalty(),
    seed: Optional[int] = flags.seed(),
    verbose: bool = flags.option(False, "-v", "--verbose", help="log the engine's steps"),
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
                                 cpu_mem=cpu_mem, gpu_kv_tokens=gpu_kv_tokens, stream_tokens=stream_tokens, n_cpu_moe=n_cpu_moe,
                                 weight_mode=weight_mode, plan=plan, draft=draft, draft_model=draft_model,
                                 **{k: v for k, v in sampling.items() if v is not None})
        err.print(f"[dim]hetero serve: listening on http://{host}:{port} (loading the model; /health is 503 "
                  f"until it is ready)[/dim]", highlight=False)
        serve(load, opts)
    except UserError as e:
        _fail(e)


def bench_cmd(
    model_arg: Optional[str] = flags.model_arg(),
    model: Optional[str] = flags.model(),
    random: Optional[str] = flags.option(None, "--random",
                                         help="a random-weight model of a named shape, built in memory: llama3-8b, "
                                              "llama3-70b, qwen3-8b, qwen3-30b-a3b, mixtral-8x7b, smollm2-135m"),
    n_prompt: int = flags.whole_opt(512, "-p", "--n-prompt", lo=0, help="prompt tokens (pp test; 0: none)"),
    n_gen: int = flags.whole_opt(128, "-n", "--n-gen", lo=0, help="generated tokens (tg test; 0: none)"),
    depth: str = flags.option("0", "-d", "--n-depth", help="context already there, comma-separated (e.g. 0,8192,32768)"),
    reps: int = flags.whole_opt(3, "-r", "--repetitions", lo=1, help="repetitions of each test"),
    parallel: str = flags.option("1", "-b", "--parallel", help="sequences decoded together, comma-separated (e.g. 1,16)"),
    kv_dtype: Optional[str] = flags.option(None, "--kv-dtype",
                                           help="host KV precision(s), comma-separated: bf16,int8,int4 (default: the planner's)"),
    draft: str = flags.option("off", "--draft", help="speculative decoding, comma-separated: off, ngram, or KEPT/DRAFTED "
                                                       "(e.g. 3/4: an acceptance fed in, for random weights; 0/auto: drafts of the adaptive "
                                                       "length, none kept)"),
    output: str = flags.choice_opt("md", "-o", "--output", values=("md", "json", "csv"), help="table format"),
    threads: Optional[int] = flags.threads(),
    weights: str = flags.weights(),
    device: str = flags.device(),
    gpu_mem: Optional[int] = flags.gpu_mem(),
    cpu_mem: Optional[int] = flags.cpu_mem(),
    gpu_kv_tokens: Optional[int] = flags.gpu_kv_tokens(),
    n_cpu_moe: int = flags.n_cpu_moe(),
    weight_mode: str = flags.weight_mode(),
    verbose: bool = flags.option(False, "-v", "--verbose", help="log the engine's steps"),
) -> None:
    """Measure prompt and generation tokens/s (llama-bench style), one row per combination."""
    import sys

    import hetero
    from hetero.app.bench import BenchSpec, parse_list, render, run_bench

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    try:
        bad = [d for d in (kv_dtype or "").split(",") if kv_dtype and d not in flags.KV_DTYPES]
        if bad:
            raise UserError(f"--kv-dtype {bad[0]!r} is not one of {', '.join(flags.KV_DTYPES)}")
        if random and (model or model_arg):
            raise UserError("give a MODEL or --random SHAPE, not both")
        spec = BenchSpec(n_prompt=n_prompt, n_gen=n_gen, depths=parse_list(depth, "-d"), reps=reps,
                         batches=parse_list(parallel, "-b"),
                         kv_dtypes=tuple(kv_dtype.split(",")) if kv_dtype else (None,),
                         drafts=tuple(d.strip() for d in draft.split(",") if d.strip()) or ("off",))
        source = model or model_arg
        if random:
            import torch

            from hetero.random_weights import RandomCheckpoint, random_shape

            on_gpu = device != "cpu" and torch.cuda.is_available()
            source = RandomCheckpoint(random_shape(random), device="cuda" if on_gpu else "cpu")
        load = functools.partial(hetero.load, source, device=device, weights=weights, threads=threads, gpu_mem=gpu_mem,
                                 cpu_mem=cpu_mem, gpu_kv_tokens=gpu_kv_tokens, n_cpu_moe=n_cpu_moe,
                                 weight_mode=weight_mode)
        rows = run_bench(load, spec, on_row=lambda r: err.print(f"[dim]{r.test} batch {r.n_batch} {r.kv_dtype} "
                                                                f"draft {r.draft}: "
                                                                f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f} t/s[/dim]"))
        sys.stdout.write(render(rows, output) + "\n")
    except UserError as e:
        _fail(e)


def monitor_cmd(
    url: str = typer.Argument("http://127.0.0.1:8080", help="the hetero server to watch"),
    once: bool = flags.option(False, "--once", help="print one frame as plain text and exit"),
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


def profile_experts_cmd(
    model_arg: Optional[str] = flags.model_arg(),
    model: Optional[str] = flags.model(),
    prompts: str = flags.option(..., "--prompts", metavar="FILE", help="prompts, one a line (plain text)"),
    out: Optional[str] = flags.option(None, "-o", "--out", metavar="FILE",
                                      help="where to write the statistics (default: where the planner looks)"),
    ctx_size: int = flags.ctx_size(),
    device: str = flags.device(),
    gpu_mem: Optional[int] = flags.gpu_mem(),
    threads: Optional[int] = flags.threads(),
) -> None:
    """Count how often each expert of a mixture-of-experts model is routed to over prompts; later plans
    for the model keep the most used experts on the GPU."""
    from pathlib import Path

    import hetero
    from hetero.app.routing import profile_experts

    try:
        try:
            texts = Path(prompts).read_text().splitlines()
        except OSError as e:
            raise UserError(f"cannot read the prompts {prompts}: {e}") from e
        engine = hetero.load(model or model_arg, ctx_size=ctx_size, device=device, gpu_mem=gpu_mem, threads=threads)
        path, counts, tokens = profile_experts(engine, texts, Path(out) if out else None)
    except UserError as e:
        _fail(e)
    k = engine.cfg.num_experts_per_tok
    top = sorted(counts[min(counts)], reverse=True)
    half = sum(top[: len(top) // 2]) / max(1, sum(top))
    print(f"{tokens} tokens of {len(texts)} prompts routed to {k} of {engine.cfg.num_experts} experts a layer; "
          f"in layer {min(counts)} the most used half took {100 * half:.0f}% of the slots")
    print(f"wrote {path}: `hetero plan` and the engine now keep the most used experts on the GPU")
