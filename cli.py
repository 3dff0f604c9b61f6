"""`hetero` command line: thin typer commands over library calls.

Every option can also come from an environment variable HETERO_<NAME> (the flag wins).
Errors a user can fix print one message and exit with code 2.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional

from cpu_attention import warm  # light: the package's kernels load on first use

# `hetero profile` on a fresh machine compiles the CPU kernels (10–25 s): start that in background
# processes now, before this process spends ~4 s importing torch and the planner
warm.start_for_cli(sys.argv[1:])

import typer  # noqa: E402
from rich.console import Console  # noqa: E402

from hetero.errors import UserError  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=False, help="Run LLMs with the KV cache in host memory.")
err = Console(stderr=True, soft_wrap=True)


@app.callback()
def _root() -> None:
    """hetero: 4-bit weights on the GPU, the KV cache in host memory attended by the CPU."""


def _opt(default, *names: str, help: str = ""):
    env = "HETERO_" + names[-1].lstrip("-").replace("-", "_").upper()
    return typer.Option(default, *names, envvar=env, help=help, show_default=True)


@app.command()
def chat(
    model_arg: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="HF folder or .gguf (default: demo model)"),
    model: Optional[str] = _opt(None, "-m", "--model", help="HF folder or .gguf"),
    ctx_size: int = _opt(0, "-c", "--ctx-size", help="context length; 0 = the model's (capped at 4096)"),
    max_new_tokens: int = _opt(512, "-n", "--max-new-tokens", help="tokens to generate per answer"),
    threads: Optional[int] = _opt(None, "-t", "--threads", help="CPU threads for host attention"),
    kv_dtype: Optional[str] = _opt(None, "--kv-dtype", help="host KV precision: bf16|int8|int4|f32 (default: planner; bf16 on the CPU)"),
    weights: str = _opt("auto", "--weights", help="weight precision: auto|4bit|int8|bf16|f32"),
    device: str = _opt("auto", "--device", help="auto|cpu|cuda"),
    gpu_mem: Optional[str] = _opt(None, "--gpu-mem", help="GPU budget, a hard limit (e.g. 6GiB; default: free minus a margin)"),
    cpu_mem: Optional[str] = _opt(None, "--cpu-mem", help="host budget (e.g. 48GiB)"),
    gpu_kv_tokens: Optional[int] = _opt(None, "--gpu-kv-tokens", help="KV tokens per sequence kept on the GPU"),
    stream_tokens: Optional[int] = _opt(None, "--kv-stream-tokens",
                                        help="host KV tokens the GPU attends over after copying them up each step (batch 1; default: planner)"),
    weight_mode: str = _opt("auto", "--weight-mode", help="weights that do not fit the GPU: auto|stream|cpu"),
    plan: Optional[str] = _opt(None, "--plan", help="run exactly this saved plan (hetero plan --json > plan.json)"),
    system: Optional[str] = _opt(None, "-s", "--system", help="system message"),
    temperature: Optional[float] = _opt(None, "--temp", "--temperature"),
    top_k: Optional[int] = _opt(None, "--top-k"),
    top_p: Optional[float] = _opt(None, "--top-p"),
    min_p: Optional[float] = _opt(None, "--min-p"),
    repeat_penalty: Optional[float] = _opt(None, "--repeat-penalty"),
    seed: Optional[int] = _opt(None, "--seed"),
    verbose: bool = _opt(False, "-v", "--verbose"),
) -> None:
    """Chat with a model (Ollama-style); with stdin not a terminal, each line is one message."""
    import hetero
    from hetero.repl import ChatSession, is_tty, run_chat

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    interactive = is_tty(sys.stdin)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repeat_penalty=repeat_penalty, seed=seed, max_new_tokens=max_new_tokens)
    with _user_errors():
        if interactive:
            err.print("[dim]loading…[/dim]")
        engine = hetero.load(model or model_arg, device=device, weights=weights, kv_dtype=kv_dtype,
                             ctx_size=ctx_size, threads=threads, gpu_mem=gpu_mem, cpu_mem=cpu_mem,
                             gpu_kv_tokens=gpu_kv_tokens, stream_tokens=stream_tokens, weight_mode=weight_mode,
                             plan=plan)
        if interactive:
            err.print(f"[dim]{' · '.join(f'{k} {v}' for k, v in engine.info.items())}[/dim]")
        session = ChatSession(engine, sys.stdout, err, system=system,
                              **{k: v for k, v in sampling.items() if v is not None})
        run_chat(session, sys.stdin, interactive)


class _user_errors:
    """Print a UserError's message and exit 2, never a traceback."""

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if isinstance(exc, UserError):
            err.print(f"[bold red]error:[/bold red] {exc}", highlight=False)
            raise typer.Exit(2)
        return False


def _register_planner() -> None:
    from planner.commands import plan_cmd, profile_cmd

    app.command("plan")(plan_cmd)
    app.command("profile")(profile_cmd)


_register_planner()


def _register_app() -> None:
    from hetero.app.commands import bench_cmd, monitor_cmd, serve_cmd

    app.command("serve")(serve_cmd)
    app.command("monitor")(monitor_cmd)
    app.command("bench")(bench_cmd)


_register_app()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
