"""The command line's options, each defined once: the same name, choices, default, range and
help in every command that takes it (`hetero chat`, `plan`, `profile` and those to come).

Each value is checked where it is read — ranges, choices, memory sizes — so a bad one stops
the command before any work with one message naming the option, and exit code 2. Every option
also reads the environment variable HETERO_<LONG NAME> (the flag wins).
"""
from __future__ import annotations

from typing import Any, Callable

import typer

from hetero.errors import UserError
from planner.units import parse_size

KV_DTYPES = ("auto", "bf16", "int8", "int4", "f32")
WEIGHTS = ("auto", "4bit", "q4", "int8", "bf16", "f32")
DEVICES = ("auto", "cpu", "cuda")
WEIGHT_MODES = ("auto", "stream", "cpu")
OVERFLOWS = ("drop-turns", "shift", "stop")
DEFAULT_MAX_NEW_TOKENS = 512


def option(default: Any, *names: str, help: str, **kw) -> Any:
    """An option with the shared conventions: its HETERO_ variable, its default shown."""
    env = "HETERO_" + names[-1].lstrip("-").replace("-", "_").upper()
    return typer.Option(default, *names, envvar=env, help=help, show_default=True, **kw)


def size(text: str | int) -> int:
    """'8GiB' → bytes, for --gpu-mem and --cpu-mem."""
    if isinstance(text, int):
        return text
    try:
        n = parse_size(text)
    except UserError as e:
        raise typer.BadParameter(str(e)) from None
    if n <= 0:
        raise typer.BadParameter(f"{text!r}: a budget must be more than 0 bytes, e.g. 8GiB")
    return n


def whole(lo: int) -> Callable[[str], int]:
    """A whole number ≥ lo (the message names the bad value and the range)."""
    def parse(text: str | int) -> int:
        try:
            n = int(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a whole number; use one ≥ {lo}") from None
        if n < lo:
            raise typer.BadParameter(f"{n} is out of range; use a whole number ≥ {lo}")
        return n

    return parse


def number(lo: float, hi: float | None = None, hi_open: bool = False) -> Callable[[str], float]:
    """A number in [lo, hi] (or [lo, hi) with hi_open)."""
    span = f"≥ {lo}" if hi is None else f"in [{lo}, {hi}{')' if hi_open else ']'}"

    def parse(text: str | float) -> float:
        try:
            x = float(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a number; use one {span}") from None
        if x < lo or hi is not None and (x > hi or hi_open and x == hi):
            raise typer.BadParameter(f"{x:g} is out of range; use a number {span}")
        return x

    return parse


def one_of(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise typer.BadParameter(f"{text!r} is not one of {', '.join(values)}")
        return text

    return parse


def fraction(text: str | float) -> float:
    """A probability in (0, 1], for --top-p."""
    try:
        x = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number; use a value in (0, 1], e.g. 0.9") from None
    if not 0 < x <= 1:
        raise typer.BadParameter(f"{x} is outside (0, 1]; use e.g. 0.9 (1 turns it off)")
    return x


def whole_opt(default: int | None, *names: str, lo: int, help: str) -> Any:
    return option(default, *names, parser=whole(lo), metavar="N", help=help)


def choice_opt(default: str, *names: str, values: tuple[str, ...], help: str) -> Any:
    return option(default, *names, parser=one_of(*values), metavar="|".join(values), help=help)


# ----------------------------------------------------------------------------- the model
def model_arg() -> Any:
    return typer.Argument(None, metavar="[MODEL]", help="HF folder or .gguf (default: the demo model)")


def model() -> Any:
    return option(None, "-m", "--model", help="HF folder or .gguf (default: the demo model)")


def plan_file() -> Any:
    return option(None, "--plan", metavar="FILE", help="run exactly this saved plan (`hetero plan --json > plan.json`)")


# ----------------------------------------------------------------------------- workload
def parallel(default: int = 1) -> Any:
    return whole_opt(default, "-np", "--parallel", lo=1, help="sequences decoded together (each gets a full context of KV)")


def ctx_size() -> Any:
    return option(0, "-c", "--ctx-size", parser=whole(0), metavar="N", help="context length per sequence; 0 = the model's, capped at 4096")


def max_new_tokens() -> Any:
    return option(DEFAULT_MAX_NEW_TOKENS, "-n", "--max-new-tokens", parser=whole(1), metavar="N", help="tokens to generate per answer")


def threads() -> Any:
    return option(None, "-t", "--threads", parser=whole(1), metavar="N", help="CPU threads for host attention (default: physical cores)")


def context_overflow() -> Any:
    return choice_opt("drop-turns", "--context-overflow", values=OVERFLOWS,
                      help="when a conversation outgrows the context: drop the oldest turns (the system "
                           "prompt stays), shift out the oldest tokens, or stop")


def draft() -> Any:
    return choice_opt("off", "--draft", values=("off", "ngram"),
                      help="speculative decoding: ngram drafts from the conversation's own tokens (prompt "
                           "lookup), verified in one step; the output is the same, faster where answers "
                           "repeat their context")


def draft_model() -> Any:
    return option(None, "--draft-model", metavar="PATH",
                  help="speculative decoding with drafts from this small model (same tokenizer; on the GPU it plans "
                       "within a quarter of --gpu-mem, the model with the rest)")


# ----------------------------------------------------------------------------- placement
def gpu_mem() -> Any:
    return option(None, "--gpu-mem", parser=size, metavar="SIZE",
                help="GPU budget, a hard limit, e.g. 6GiB (default: free memory minus a margin)")


def cpu_mem() -> Any:
    return option(None, "--cpu-mem", parser=size, metavar="SIZE",
                help="host budget, e.g. 48GiB (default: available memory minus a margin)")


def kv_dtype() -> Any:
    return choice_opt("auto", "--kv-dtype", values=KV_DTYPES,
                      help="host-tier KV precision (auto: the planner's choice; bf16 on the CPU)")


def gpu_kv_dtype() -> Any:
    return choice_opt("auto", "--gpu-kv-dtype", values=KV_DTYPES,
                      help="GPU-tier KV precision (auto: bf16 when the whole KV fits the GPU, else the "
                           "planner's fastest, int8 over int4 within 10%)")


def weights() -> Any:
    return choice_opt("auto", "--weights", values=WEIGHTS,
                      help="weight precision (auto: 4bit with CUDA, int8 on the CPU; int8 runs on the CPU only; "
                           "q4: a linear 4-bit format the GPU decodes faster than 4bit's NF4, same size)")


def device() -> Any:
    return choice_opt("auto", "--device", values=DEVICES, help="where the model runs (auto: CUDA when present)")


def weight_mode() -> Any:
    return choice_opt("auto", "--weight-mode", values=WEIGHT_MODES,
                      help="weights that do not fit the GPU: streamed from pinned host memory, or computed "
                           "by the CPU (auto: the planner's prediction picks)")


def n_cpu_moe() -> Any:
    return option(0, "--n-cpu-moe", parser=whole(0), metavar="N",
                help="mixture-of-experts models: the experts of the first N layers are computed by the CPU "
                     "(llama.cpp's --n-cpu-moe; 0: the planner places them)")


def gpu_kv_tokens() -> Any:
    return option(None, "--gpu-kv-tokens", parser=whole(0), metavar="N", help="KV tokens per sequence kept on the GPU (default: planner)")


def stream_tokens() -> Any:
    return option(None, "--kv-stream-tokens", parser=whole(0), metavar="N",
                help="of each sequence's host KV, the first N tokens the GPU attends over after copying them "
                     "up each step (one sub-batch) (default: planner)")


# ----------------------------------------------------------------------------- sampling
def temperature() -> Any:
    return option(None, "--temp", "--temperature", parser=number(0.0), metavar="FLOAT",
                help="sampling temperature, 0 = greedy (default: the model's; demo model 0.2)")


def top_k() -> Any:
    return option(None, "--top-k", parser=whole(0), metavar="N", help="keep the k likeliest tokens, 0 = off (default: the model's, else 40)")


def top_p() -> Any:
    return option(None, "--top-p", parser=fraction, metavar="FLOAT",
                help="keep the likeliest tokens up to this probability mass, in (0, 1] "
                     "(default: the model's; demo model 0.9)")


def min_p() -> Any:
    return option(None, "--min-p", parser=number(0.0, 1.0, hi_open=True), metavar="FLOAT",
                help="drop tokens less likely than this fraction of the likeliest, in [0, 1) "
                     "(default: the model's, else 0.05)")


def repeat_penalty() -> Any:
    return option(None, "--repeat-penalty", parser=number(0.01), metavar="FLOAT", help="divide repeated tokens' logits by this, 1 = off "
                                                         "(default: the model's, else 1)")


def seed() -> Any:
    return option(None, "--seed", parser=whole(0), metavar="N", help="sampling seed (default: random)")
