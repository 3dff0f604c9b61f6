"""`hetero.load`: from a path and options to a ready Engine."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cpu_attention import INT4_GROUP, KVDtype
from hetero.checkpoint import open_checkpoint
from hetero.context import Overflow
from hetero.demo import DEMO_SAMPLING, demo_model_path
from hetero.app.engine import Engine
from hetero.errors import UserError
from offload.loader import WeightFormat, load_model
from hetero.random_weights import RandomCheckpoint
from hetero.sampling import defaults_from_generation_config
from hetero.tokenizer import Tokenizer
from hetero.validate import check_vocab
from offload.kv_cache import TieredKVCache
from offload.runner import Runner

if TYPE_CHECKING:
    from planner.plan import Plan

log = logging.getLogger(__name__)


def load(
    model: str | Path | RandomCheckpoint | None = None,
    *,
    device: str = "auto",
    weights: str = "auto",
    kv_dtype: str | None = None,
    gpu_kv_dtype: str | None = None,
    ctx_size: int = 0,
    parallel: int = 4,
    threads: int | None = None,
    block_size: int = 32,
    gpu_kv_tokens: int | None = None,
    stream_tokens: int | None = None,
    sub_batches: int | None = None,
    weight_mode: str | None = None,
    gpu_mem: str | int | None = None,
    cpu_mem: str | int | None = None,
    plan: "str | Path | Plan | None" = None,
    tokenizer: bool = True,
    context_overflow: str = "drop-turns",
    **sampling,
) -> Engine:
    """Load a HF folder or .gguf (default: the embedded demo model), or a `RandomCheckpoint`, into an Engine.

    With CUDA (device auto or cuda) the planner places weights and KV from the measured machine
    and the budgets (gpu_mem / cpu_mem: bytes or "8GiB"), or `plan` (a Plan or its JSON file)
    is carried out exactly; every option left None is the planner's choice.
    device: auto|cpu|cuda; weights: auto|4bit|int8|bf16|f32; kv_dtype: bf16|int8|int4|f32 (the host
    tier's); gpu_kv_dtype: bf16|int8|int4|f32 (the device tier's; with device cpu, the stand-in's);
    ctx_size: tokens per sequence (0: the model's, capped at 4096 unless asked);
    parallel: sequences the KV cache holds at full context; gpu_kv_tokens: each sequence's
    first tokens kept on the device tier (the rest on the host tier; with device cpu the
    device tier is a CPU stand-in); stream_tokens: at batch 1, how many of the host tier's first
    tokens the device attends over after copying them up each step (None: the planner's choice;
    with device cpu, the stand-in device); sub_batches: 1 or 2 (None: automatic); weight_mode:
    stream|cpu, how weights that do not fit the GPU budget run (None/"auto": the planner's choice);
    context_overflow: drop-turns|shift|stop, what `Engine.chat` does when a conversation outgrows
    the context (`hetero.context`); sampling: default sampling parameters (temperature, top_k, top_p, min_p, repeat_penalty, seed,
    max_new_tokens). With device cpu and a `plan`, the plan runs with the CPU standing in for the GPU
    (its device-tier KV and weights in host memory; slow for 4-bit weights, meant for tests).
    """
    overflow = Overflow.parse(context_overflow)
    for name, value, lo in (("ctx_size", ctx_size, 0), ("parallel", parallel, 1), ("threads", threads, 1),
                            ("block_size", block_size, 1), ("gpu_kv_tokens", gpu_kv_tokens, 0),
                            ("stream_tokens", stream_tokens, 0)):
        if value is not None and (not isinstance(value, int) or value < lo):
            raise UserError(f"{name} {value!r} is out of range: use a whole number ≥ {lo}")
    if isinstance(model, RandomCheckpoint):  # built in memory: no files, no tokenizer
        ck, tokenizer = model, False
        path = ck.path
    else:
        path = Path(model) if model else demo_model_path()
        ck = open_checkpoint(path)
    cfg = ck.config
    dev = _device(device)
    kv_dtype, gpu_kv_dtype = (None if d == "auto" else d for d in (kv_dtype, gpu_kv_dtype))
    kv = _kv_dtype(kv_dtype or "bf16", "--kv-dtype", cfg)
    gpu_kv = _kv_dtype(gpu_kv_dtype, "--gpu-kv-dtype", cfg) if gpu_kv_dtype else None
    if weight_mode not in (None, "auto", "stream", "cpu"):
        raise UserError(f"--weight-mode {weight_mode!r} is not one of auto, stream, cpu")
    limit = cfg.context_limit
    ctx = cfg.context(ctx_size)
    if ctx > limit:
        raise UserError(f"--ctx-size {ctx} exceeds what {path.name} supports ({limit} tokens)")
    tok = Tokenizer(path, ck.format == "gguf", cfg.eos_token_ids) if tokenizer else None
    if tok is not None:
        check_vocab(cfg, len(tok.hf), path)
    defaults = defaults_from_generation_config(path if path.is_dir() else None)
    defaults = defaults.update(**(DEMO_SAMPLING if model is None else {})).update(**sampling)
    if dev.type == "cuda" or plan is not None:
        # the planner imports hetero.config: imported here, not at module level, to keep the cycle open
        from offload.build import check_plan_supported, fence_gpu_memory, load_from_plan, runtime_from_plan
        from offload.placement import FORMATS
        from planner.report import summary_line

        p = _plan(cfg, plan, ctx, parallel, gpu_mem, cpu_mem, weights=weights, kv_dtype=kv_dtype,
                  gpu_kv_dtype=gpu_kv_dtype, threads=threads,
                  sub_batches=sub_batches, block_size=block_size, weight_mode=weight_mode,
                  gpu_kv_tokens=None if gpu_kv_tokens is None else min(gpu_kv_tokens, ctx),
                  stream_tokens=stream_tokens)
        check_plan_supported(p)
        if dev.type == "cuda":
            fence_gpu_memory(p.budget.gpu_bytes, dev)
        fmt = FORMATS[p.weights]
        log.info("loading %s: %s weights on %s; %s", path, fmt.value, dev, summary_line(p))
        m, placed = load_from_plan(ck, p, dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # quantization temporaries: give their blocks back before the KV pools
        runner = runtime_from_plan(m, p, weights=placed)
        info = {"model": str(path), "device": str(dev), "weights": fmt.value, "ctx_size": ctx,
                "plan": summary_line(p), "predicted": f"{p.prediction.decode_tok_s:.1f} tok/s decode "
                f"({p.prediction.bottleneck})"}
        engine = Engine(runner.model, tok, runner, ctx, defaults, info=info, plan=p)
        engine.overflow = overflow
        return engine
    fmt = WeightFormat.parse(weights, dev)
    log.info("loading %s: %s weights on %s, %s KV, context %d", path, fmt.value, dev, kv.value, ctx)
    m = load_model(ck, fmt, dev)
    gpu_tok = min(gpu_kv_tokens or 0, ctx)
    cache = TieredKVCache(cfg, host_tokens=(ctx - gpu_tok) * parallel + block_size * parallel,
                          gpu_tokens=gpu_tok * parallel, host_dtype=kv, gpu_tokens_per_seq=gpu_tok, device=dev,
                          block_size=block_size, pin=False, gpu_dtype=gpu_kv, max_seqs=parallel)
    runner = Runner(m, cache, threads=threads, sub_batches=sub_batches, max_batch=parallel, max_context=ctx,
                    stream_tokens=stream_tokens or 0)
    info = {"model": str(path), "device": str(dev), "weights": fmt.value, "kv_dtype": kv.value, "ctx_size": ctx,
            "kv_tiers": f"{gpu_tok} tokens/seq on {dev.type} ({cache.gpu.kv_dtype.value if cache.gpu else '-'}), "
                        f"the rest on the host ({kv.value})"}
    engine = Engine(m, tok, runner, ctx, defaults, info=info)
    engine.overflow = overflow
    return engine


def _kv_dtype(value: str, flag: str, cfg) -> KVDtype:
    try:
        kv = KVDtype(value)
    except ValueError:
        raise UserError(f"{flag} {value!r} is not one of {', '.join(k.value for k in KVDtype)}") from None
    if kv is KVDtype.INT4 and cfg.head_dim % INT4_GROUP:
        raise UserError(f"{flag} int4 needs a head dim divisible by {INT4_GROUP} ({cfg.name} has "
                        f"{cfg.head_dim}): use {flag} int8")
    return kv


def _plan(cfg, plan, ctx, parallel, gpu_mem, cpu_mem, **options):
    """The saved plan, exactly, or the planner's for this machine and these options."""
    from planner.options import budget_from, overrides_from
    from planner.plan import Plan, Workload
    from planner.profile import load_or_measure
    from planner.search import plan as make_plan

    if isinstance(plan, Plan):
        return plan
    if plan is not None:
        try:
            return Plan.from_json(Path(plan).read_text())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"cannot read the plan {plan}: {e}") from e
    hw = load_or_measure()
    wl = Workload(ctx_size=ctx, batch=parallel, prompt_tokens=max(1, ctx // 2), gen_tokens=max(1, ctx // 4))
    ov = overrides_from(device="cuda", **options)
    return make_plan(cfg, hw, budget_from(hw, gpu_mem, cpu_mem), wl, ov)


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r} is not one of auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but CUDA is not available; use --device cpu")
    return torch.device(device)
