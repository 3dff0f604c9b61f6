"""`hetero.load` (a path and options → a plan) and `build` (a plan → a ready Engine), the only way
an engine is assembled."""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from hetero.checkpoint import Checkpoint, open_checkpoint
from hetero.context import Overflow
from hetero.demo import DEMO_SAMPLING, demo_model_path
from hetero.app.engine import Engine
from hetero.errors import UserError
from hetero.random_weights import RandomCheckpoint
from hetero.sampling import SamplingParams, defaults_from_generation_config
from hetero.speculative import ModelDrafter, make_drafter
from hetero.tokenizer import Tokenizer
from hetero.validate import check_vocab
from cpu_attention.layout import INT4_GROUP, KVDtype
from offload.build import fence_gpu_memory, load_from_plan, on_own_thread, runtime_from_plan
from offload.loader import Progress
from offload.placement import FORMATS, check_plan_supported
from planner.hardware import default_budget
from planner.options import WEIGHTS, budget_from, overrides_from
from planner.plan import Budget, Device, Plan, Workload
from planner.profile import HardwareProfile, load_or_estimate, load_or_measure
from planner.report import summary_line
from planner.experts import routing_for
from planner.search import plan as make_plan

log = logging.getLogger(__name__)


def _on_own_thread_with_cuda(load_fn):
    """`load_fn` running, where CUDA runs the engine, on a thread of its own that ends with it
    (`offload.build.on_own_thread`). During decode the CPU's kernels run from the CUDA driver's
    thread (MoE experts) or the CPU-attention worker; an OpenMP pool the loading (torch's CPU ops,
    the Numba kernels that quantize, measure and warm up) left on the main thread would stay beside
    theirs (`python3 -m bench.omp_pools`: three small regions 7.7 µs alone, 172-197 µs beside such
    a pool, on the 2-core machine)."""

    @functools.wraps(load_fn)
    def load(*args, **kwargs):
        if kwargs.get("device", "auto") == "cpu" or not torch.cuda.is_available():
            return load_fn(*args, **kwargs)
        return on_own_thread(load_fn, *args, **kwargs)

    return load


@_on_own_thread_with_cuda
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
    block_size: int | None = None,
    gpu_kv_tokens: int | None = None,
    n_cpu_moe: int = 0,
    stream_tokens: int | None = None,
    sub_batches: int | None = None,
    weight_mode: str | None = None,
    gpu_mem: str | int | None = None,
    cpu_mem: str | int | None = None,
    plan: "str | Path | Plan | None" = None,
    tokenizer: bool = True,
    context_overflow: str = "drop-turns",
    draft: str | None = None,
    draft_model: str | Path | RandomCheckpoint | None = None,
    progress: Progress | None = None,
    **sampling,
) -> Engine:
    """Load a HF folder or .gguf (default: the embedded demo model), or a `RandomCheckpoint`, into an
    Engine: make the plan (or read `plan`, a Plan or its JSON file), then `build` it.

    The planner places weights and KV from this machine's profile and the budgets (gpu_mem /
    cpu_mem: bytes or "8GiB"); every option left None is the planner's choice. Without CUDA (or
    with device cpu) the plan is the CPU's, made from the cached profile or this host's memory and
    cores (it never measures). device: auto|cpu|cuda; weights: auto|4bit|q4|int8|bf16|f32; kv_dtype:
    bf16|int8|int4|f32 (the host tier's); gpu_kv_dtype: bf16|int8|int4|f32 (the device tier's);
    ctx_size: tokens per sequence (0: the model's, capped at 4096 unless asked); parallel: sequences
    the KV cache holds at full context; block_size: tokens a KV block; gpu_kv_tokens: each
    sequence's first tokens kept on the device tier (the rest on the host tier; with device cpu the
    device tier is a CPU stand-in); stream_tokens: how many of each sequence's host-tier first
    tokens the device attends over after copying them up each step (one sub-batch); n_cpu_moe: the experts of the
    first n layers are computed by the CPU (MoE models); sub_batches: 1 or 2; weight_mode:
    stream|cpu, how weights that do not fit the GPU budget run; context_overflow:
    drop-turns|shift|stop, what `Engine.chat` does when a conversation outgrows the context
    (`hetero.context`); draft: ngram|off, speculative decoding's drafts (ngram: prompt lookup over
    the sequence's own tokens; hetero/speculative.py); draft_model: a small model with the same
    vocabulary that drafts instead (its own engine on the model's device; on the GPU it plans
    within a quarter of the budgets, `draft_share`); progress(done, total): called as the weights
    are converted, layer by layer (the CLI draws a bar with it); sampling: default sampling parameters (temperature, top_k, top_p, min_p,
    repeat_penalty, seed, max_new_tokens). With device cpu and a plan for the GPU, the plan runs
    with the CPU standing in for the GPU (slow for 4-bit weights, meant for tests).
    """
    overflow = Overflow.parse(context_overflow)
    make_drafter(draft)  # an unknown drafter is refused before anything loads
    if draft_model is not None and draft not in (None, "off"):
        raise UserError(f"--draft {draft} and --draft-model: give one source of drafts")
    for name, value, lo in (("ctx_size", ctx_size, 0), ("parallel", parallel, 1), ("threads", threads, 1),
                            ("block_size", block_size, 1), ("gpu_kv_tokens", gpu_kv_tokens, 0),
                            ("stream_tokens", stream_tokens, 0), ("n_cpu_moe", n_cpu_moe, 0)):
        if value is not None and (not isinstance(value, int) or value < lo):
            raise UserError(f"{name} {value!r} is out of range: use a whole number ≥ {lo}")
    if isinstance(model, RandomCheckpoint):  # built in memory: no files, no tokenizer
        ck, tokenizer = model, False
        path = ck.path
    else:
        path = Path(model) if model else demo_model_path()
        ck = open_checkpoint(path)
    cfg = ck.config
    draft_ck = _draft_checkpoint(draft_model, cfg) if draft_model is not None else None  # refused before loading
    dev = _device(device)
    kv_dtype, gpu_kv_dtype = (None if d == "auto" else d for d in (kv_dtype, gpu_kv_dtype))
    for value, flag in ((kv_dtype, "--kv-dtype"), (gpu_kv_dtype, "--gpu-kv-dtype")):
        if value is not None:
            _kv_dtype(value, flag, cfg)
    if weight_mode not in (None, "auto", "stream", "cpu"):
        raise UserError(f"--weight-mode {weight_mode!r} is not one of auto, stream, cpu")
    if weights != "auto" and weights not in WEIGHTS:
        raise UserError(f"--weights {weights!r} is not one of auto, {', '.join(WEIGHTS)}")
    ctx = cfg.context(ctx_size)
    if ctx > cfg.context_limit:
        raise UserError(f"--ctx-size {ctx} exceeds what {path.name} supports ({cfg.context_limit} tokens)")
    tok = Tokenizer(path, ck.format == "gguf", cfg.eos_token_ids) if tokenizer else None
    if tok is not None:
        check_vocab(cfg, len(tok.hf), path)
    defaults = defaults_from_generation_config(path if path.is_dir() else None)
    defaults = defaults.update(**(DEMO_SAMPLING if model is None else {})).update(**sampling)
    routing = None if isinstance(model, RandomCheckpoint) else routing_for(path, cfg)
    gpu_draft = None  # a draft model on the GPU: planned first, the model plans with what it leaves
    if draft_model is not None and dev.type == "cuda":
        if plan is not None:
            raise UserError("--draft-model with --plan on the GPU: a saved plan holds the whole GPU budget; "
                            "leave out --plan (the draft model's share is planned beside the model's)")
        gpu_draft = _plan_gpu_draft(draft_ck, ctx, parallel, gpu_mem, cpu_mem)
        gpu_mem, cpu_mem = gpu_draft.left.gpu_bytes, gpu_draft.left.host_bytes
    p = _plan(cfg, plan, dev, ctx, parallel, gpu_mem, cpu_mem, routing, weights=weights, kv_dtype=kv_dtype,
              gpu_kv_dtype=gpu_kv_dtype, threads=threads, sub_batches=sub_batches, block_size=block_size,
              weight_mode=weight_mode, gpu_kv_tokens=None if gpu_kv_tokens is None else min(gpu_kv_tokens, ctx),
              stream_tokens=stream_tokens, n_cpu_moe=n_cpu_moe, hw=gpu_draft.hw if gpu_draft is not None else None)
    if plan is not None and device == "auto" and p.device is Device.CPU:
        dev = torch.device("cpu")  # a saved CPU plan runs on the CPU
    fence = gpu_draft.whole.gpu_bytes if gpu_draft is not None else None  # the process's limit: both engines'
    engine = build(p, ck, device=dev, tokenizer=tok, sampling=defaults, overflow=overflow, draft=draft,
                   progress=progress, gpu_fence=fence)
    if gpu_draft is not None:
        engine.drafter = ModelDrafter(build(gpu_draft.plan, gpu_draft.checkpoint, device=dev, gpu_fence=fence))
    elif draft_model is not None:
        left = None  # with --cpu-mem, the draft engine plans within what the model's plan leaves of it
        if cpu_mem:
            left = p.budget.host_bytes - p.memory.host_used
            if left <= 0:
                raise UserError("--cpu-mem leaves no host memory for the draft model: raise --cpu-mem")
        engine.drafter = ModelDrafter(load(draft_model, device="cpu", ctx_size=ctx, parallel=parallel,
                                           threads=threads, tokenizer=False, cpu_mem=left))
    return engine


def build(plan: Plan, checkpoint: Checkpoint, *, device: torch.device | None = None,
          tokenizer: Tokenizer | None = None, sampling: SamplingParams | None = None,
          overflow: Overflow = Overflow.DROP_TURNS, draft: str | None = None,
          progress: Progress | None = None, gpu_fence: int | None = None) -> Engine:
    """The one way an engine is assembled: `plan` carried out exactly (weights where it puts them,
    the KV tiers it sizes, its threads and sub-batches), or refused up front with what to change.
    device: where the plan's GPU work runs (default: the plan's device; the CPU stands in for the
    GPU when given a GPU plan, for tests); draft: speculative decoding's drafter (`hetero.speculative`);
    gpu_fence: the process's GPU limit where engines share it (a draft model's), default the plan's budget."""
    dev = device or torch.device(plan.device.value)
    check_plan_supported(plan, dev)
    if dev.type == "cuda":
        fence_gpu_memory(gpu_fence or plan.budget.gpu_bytes, dev)
    fmt = FORMATS[plan.weights]
    log.info("loading %s: %s weights on %s; %s", checkpoint.path, fmt.value, dev, summary_line(plan))
    model, placed = load_from_plan(checkpoint, plan, dev, progress)
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # quantization temporaries: give their blocks back before the KV pools
    runner = runtime_from_plan(model, plan, weights=placed)
    kv = plan.kv
    info = {"model": str(checkpoint.path), "device": str(dev), "weights": fmt.value, "kv_dtype": kv.host_dtype.value,
            "ctx_size": plan.workload.ctx_size,
            "kv_tiers": f"{kv.gpu_tokens} tokens/seq on the device ({kv.gpu_dtype.value}), "
                        f"{kv.host_tokens} on the host ({kv.host_dtype.value})",
            "plan": summary_line(plan),
            "predicted": f"{plan.prediction.decode_tok_s:.1f} tok/s decode ({plan.prediction.bottleneck})"}
    engine = Engine(model, tokenizer, runner, plan.workload.ctx_size, sampling or SamplingParams(), info=info,
                    plan=plan, draft=draft)
    engine.overflow = overflow
    return engine


DRAFT_SHARE = 4  # a draft model on the GPU plans within a quarter of the budgets; the model plans with the rest


def draft_share(cfg, hw, whole: Budget, ctx: int, parallel: int) -> tuple[Plan, Budget]:
    """The draft model `cfg`'s plan within 1 / DRAFT_SHARE of the budgets `whole`, and what it
    leaves the model: `whole` less what that plan uses (a small model uses far less than its
    share: its weights, and its KV on the GPU while it fits)."""
    share = Budget(whole.gpu_bytes // DRAFT_SHARE, whole.host_bytes // DRAFT_SHARE)
    try:
        small = make_plan(cfg, hw, share, Workload.conversation(ctx, parallel), overrides_from(device="cuda"))
    except UserError as e:
        raise UserError(f"the draft model does not fit a quarter of the budgets ({e})") from None
    m = small.memory
    return small, Budget(whole.gpu_bytes - m.gpu_used, whole.host_bytes - m.host_used)


class GpuDraft(NamedTuple):
    """A draft model planned for the GPU beside the model: its plan and checkpoint, the budgets of
    both together, what the draft's plan leaves the model, and the profile both plan with."""
    plan: Plan
    checkpoint: Checkpoint
    whole: Budget
    left: Budget
    hw: HardwareProfile


def _plan_gpu_draft(ck: Checkpoint, ctx: int, parallel: int, gpu_mem, cpu_mem) -> GpuDraft:
    hw = load_or_measure()
    whole = budget_from(hw, gpu_mem, cpu_mem) or default_budget(hw)[0]
    small, left = draft_share(ck.config, hw, whole, ctx, parallel)
    return GpuDraft(small, ck, whole, left, hw)


def _draft_checkpoint(draft_model, cfg) -> Checkpoint:
    """The draft model's checkpoint, refused unless it shares the model's vocabulary."""
    ck = draft_model if isinstance(draft_model, RandomCheckpoint) else open_checkpoint(Path(draft_model))
    if ck.config.vocab_size != cfg.vocab_size:
        raise UserError(f"the draft model's vocabulary ({ck.config.vocab_size} tokens) is not the model's "
                        f"({cfg.vocab_size}): a draft model must share the tokenizer")
    return ck


def _kv_dtype(value: str, flag: str, cfg) -> KVDtype:
    try:
        kv = KVDtype(value)
    except ValueError:
        raise UserError(f"{flag} {value!r} is not one of {', '.join(k.value for k in KVDtype)}") from None
    if kv is KVDtype.INT4 and cfg.head_dim % INT4_GROUP:
        raise UserError(f"{flag} int4 needs a head dim divisible by {INT4_GROUP} ({cfg.name} has "
                        f"{cfg.head_dim}): use {flag} int8")
    return kv


def _plan(cfg, plan, dev: torch.device, ctx: int, parallel: int, gpu_mem, cpu_mem, routing,
          hw: HardwareProfile | None = None, **options) -> Plan:
    """The saved plan, exactly, or the planner's for this machine and these options (on the CPU
    from the cached profile or this host's facts: a CPU start never measures); routing: the
    model's saved routing statistics (`hetero profile-experts`), if any; hw: the profile, where
    the caller has read it already."""
    if plan is not None and options.get("n_cpu_moe"):
        raise UserError("--n-cpu-moe with --plan: a saved plan places the experts itself; make it with "
                        "`hetero plan --n-cpu-moe N --json`")
    if isinstance(plan, Plan):
        return plan
    if plan is not None:
        try:
            return Plan.from_json(Path(plan).read_text())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"cannot read the plan {plan}: {e}") from e
    hw = hw or (load_or_measure() if dev.type == "cuda" else load_or_estimate())
    ov = overrides_from(device=dev.type, **options)
    return make_plan(cfg, hw, budget_from(hw, gpu_mem, cpu_mem), Workload.conversation(ctx, parallel), ov, routing)


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r} is not one of auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but CUDA is not available; use --device cpu")
    return torch.device(device)
