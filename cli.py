"""`hetero` command line: thin typer commands over library calls.

Every option can also come from an environment variable HETERO_<NAME> (the flag wins).
Errors a user can fix print one message and exit with code 2.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import sys
from typing import Optional

import os
from pathlib import Path

from cpu_attention import warm  # light: the package's kernels load on first use


def _start_compiles(args: list[str]) -> None:
    """For a command that will measure the machine (`hetero profile --refresh`, or `hetero profile` /
    `hetero plan` without a cached profile and, for plan, without `--profile FILE`), start the CPU
    kernels' compiles (10–25 s on a fresh machine) in background processes before this process
    spends ~4 s importing torch and the planner; the measurement takes them over."""
    words = [a for a in args if not a.startswith("-")]
    if words[:1] not in (["profile"], ["plan"]) or (words[0] == "plan" and _given(args, "--profile")):
        return
    from hetero.paths import profile_path

    refresh = words[0] == "profile" and _given(args, "--refresh")
    if refresh or not Path(profile_path()).is_file():
        warm.start_early()


def _given(args: list[str], flag: str) -> bool:
    """flag on the command line (`--flag X` or `--flag=X`) or in its HETERO_ environment variable."""
    env = os.environ.get("HETERO_" + flag.lstrip("-").replace("-", "_").upper(), "")
    given = any(a == flag or a.startswith(flag + "=") for a in args)
    return given or env.strip().lower() not in ("", "0", "false", "no", "off")


_start_compiles(sys.argv[1:])

import torch  # noqa: E402,F401  (every command needs it: imported first, then frozen)

# torch's import leaves about a million objects that live as long as the process; out of the
# cyclic collector's sight (gc.freeze), the start-up's collections stop walking them: ~0.3 s
# less to the chat prompt on the 2-core machine
gc.freeze()

import typer  # noqa: E402
from rich.console import Console  # noqa: E402

from hetero.errors import UserError  # noqa: E402
from planner import flags  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=False, help="Run LLMs with the KV cache in host memory.")
err = Console(stderr=True, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"hetero {version('hetero')}")
        except PackageNotFoundError:
            typer.echo("hetero (not installed: run from a source tree)")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version and exit"),
) -> None:
    """hetero: 4-bit weights on the GPU, the KV cache in host memory attended by the CPU."""


@app.command()
def chat(
    model_arg: Optional[str] = flags.model_arg(),
    model: Optional[str] = flags.model(),
    ctx_size: int = flags.ctx_size(),
    max_new_tokens: int = flags.max_new_tokens(),
    context_overflow: str = flags.context_overflow(),
    draft: str = flags.draft(),
    draft_model: Optional[str] = flags.draft_model(),
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
    system: Optional[str] = typer.Option(None, "-s", "--system", envvar="HETERO_SYSTEM",
                                         help="system message (default: the template's)"),
    temperature: Optional[float] = flags.temperature(),
    top_k: Optional[int] = flags.top_k(),
    top_p: Optional[float] = flags.top_p(),
    min_p: Optional[float] = flags.min_p(),
    repeat_penalty: Optional[float] = flags.repeat_penalty(),
    seed: Optional[int] = flags.seed(),
    verbose: bool = typer.Option(False, "-v", "--verbose", envvar="HETERO_VERBOSE", help="log what loading does"),
) -> None:
    """Chat with a model (Ollama-style); with stdin not a terminal, each line is one message."""
    import hetero
    from hetero.app.repl import ChatSession, is_tty, run_chat

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    interactive = is_tty(sys.stdin)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repeat_penalty=repeat_penalty, seed=seed, max_new_tokens=max_new_tokens)
    with _user_errors():
        with _weights_bar(interactive) as progress:
            engine = hetero.load(model or model_arg, device=device, weights=weights,
                                 kv_dtype=kv_dtype, gpu_kv_dtype=gpu_kv_dtype, ctx_size=ctx_size, threads=threads,
                                 gpu_mem=gpu_mem, cpu_mem=cpu_mem, gpu_kv_tokens=gpu_kv_tokens, n_cpu_moe=n_cpu_moe,
                                 stream_tokens=stream_tokens, weight_mode=weight_mode, plan=plan,
                                 context_overflow=context_overflow, parallel=1,  # one conversation
                                 draft=draft, draft_model=draft_model, progress=progress)
        if interactive:
            err.print(f"[dim]{' · '.join(f'{k} {v}' for k, v in engine.info.items())}[/dim]")
        session = ChatSession(engine, sys.stdout, err, system=system,
                              **{k: v for k, v in sampling.items() if v is not None})
        run_chat(session, sys.stdin, interactive)


@contextlib.contextmanager
def _weights_bar(show: bool):
    """A transient bar on stderr while the weights are read and converted (a terminal only): the
    `progress` callback `hetero.load` takes, or None."""
    if not show:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[dim]loading weights[/dim]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("weights", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


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
    from hetero.app.commands import bench_cmd, monitor_cmd, profile_experts_cmd, serve_cmd

    app.command("serve")(serve_cmd)
    app.command("profile-experts")(profile_experts_cmd)
    app.command("monitor")(monitor_cmd)
    app.command("bench")(bench_cmd)


_register_app()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
