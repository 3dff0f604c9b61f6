"""Placement search: `plan(model_cfg, hardware, budget, workload, overrides) -> Plan`.

GPU memory goes first to the norms and lm_head, then MLP or expert weights, then attention
weights, then the embedding (a lookup reads one row a token, so it gains least), then GPU-tier
KV. Weights that do not fit are streamed over PCIe or computed by the CPU, whichever the cost
model predicts faster. Every candidate is scored by predicted decode tokens/s at the
workload's context; a value the user set is never changed, only checked.
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, replace

from cpu_attention.layout import KVDtype
from hetero.config import ModelConfig
from hetero.errors import UserError
from planner.cost import StepCost, bottleneck, decode_step, host_experts_upload_rows
from planner.prefill_cost import prefill_seconds
from planner.kv_tiers import gpu_token_options, kv_plan, stream_options
from planner.plan import (Budget, Choice, Device, KVPlan, Memory, Mode, Overrides, Placement, Plan,
                          Prediction, Workload)
from planner.hardware import KV_BLOCK, HardwareProfile, default_budget
from planner.experts import expert_parts, experts_choice, spread_experts, upload_choice
from planner.tensors import GPU_4BIT, Group, Kind, WDtype, cpu_dtype, kv_bytes_per_token_layer, weight_groups
from planner.workspace import workspace_bytes
from planner.units import format_size as fs

GIB = 1024**3
BLOCK_SIZE = KV_BLOCK
_PRIORITY = {Kind.NORMS: 0, Kind.FINAL_NORM: 0, Kind.LM_HEAD: 1, Kind.MLP: 2, Kind.EXPERTS: 2, Kind.ATTN: 3, Kind.EMBED: 4}
_ATTN_FIRST = {**_PRIORITY, Kind.ATTN: 2, Kind.MLP: 3, Kind.EXPERTS: 3}


@dataclass(frozen=True)
class _Candidate:
    placements: tuple[Placement, ...]
    kv: KVPlan
    sub_batches: int
    memory: Memory
    cost: StepCost  # at the workload's decode_context
    order: str
    kv_reason: str = ""
    stream_reason: str = ""
    mean_s: float = 0.0  # a step's mean time over the answer (Workload.decode_contexts): what candidates compare


def plan(
    model_cfg: ModelConfig, hardware: HardwareProfile, budget: Budget | None = None,
    workload: Workload | None = None, overrides: Overrides | None = None,
    routing: dict[int, list[float]] | None = None,
) -> Plan:
    """routing: a MoE model's routing statistics (`planner.experts`), layer → per-expert counts."""
    cfg, hw, ov = model_cfg, hardware, overrides or Overrides()
    choices: list[Choice] = []
    wl = workload or Workload(ctx_size=0)
    if wl.ctx_size <= 0:
        wl = Workload(cfg.max_position_embeddings, wl.batch, 0, wl.gen_tokens, wl.ubatch)
        choices.append(Choice("--ctx-size", str(wl.ctx_size), "the model's max_position_embeddings"))
    if budget is None:
        budget, ch = default_budget(hw)
        choices += ch
    device = ov.device or (Device.CUDA if hw.has_gpu else Device.CPU)
    if ov.device is None:
        choices.append(Choice("--device", device.value, f"found {hw.gpu_name}" if hw.has_gpu else "no CUDA device found"))
    if device is Device.CUDA and not hw.has_gpu:
        raise UserError("--device cuda was given but the profile found no CUDA device: use --device cpu or auto")
    weights = ov.weights or (hw.gpu_4bit(wl.batch) if device is Device.CUDA else WDtype.INT8)
    if ov.weights is None:
        why = "4-bit on the GPU: decode reads every weight each step" if device is Device.CUDA else \
            "the CPU's int8 kernel reads a quarter of f32's bytes"
        if device is Device.CUDA and hw.gpu_gemv_q4_gbps:
            rates = [f"{hw.gpu_linear_gbps(wl.batch, w):.0f}" for w in (WDtype.Q4, WDtype.NF4)]
            why += (f"; the linear q4 format measured {rates[0]} GB/s at {wl.batch} row{'s' * (wl.batch > 1)} "
                    f"against NF4's {rates[1]}")
        choices.append(Choice("--weights", "4bit" if weights is WDtype.NF4 else weights.value, why))
    if device is Device.CPU and weights in GPU_4BIT:
        choices.append(Choice("--weights", "4bit", "on the CPU, 4-bit weights are dequantized by torch at every use "
                              "(slow: a stand-in for the GPU; --weights int8 is the CPU's fast format)"))
    if device is Device.CUDA and weights is WDtype.INT8:
        raise UserError("--weights int8 runs on the CPU only; use --weights 4bit or bf16 with --device cuda")
    if ov.n_cpu_moe and not cfg.is_moe:
        raise UserError(f"--n-cpu-moe applies to mixture-of-experts models; {cfg.name or 'this model'} has no experts")
    if ov.n_cpu_moe:
        n = min(ov.n_cpu_moe, cfg.num_layers)
        choices.append(Choice("--n-cpu-moe", str(n), f"asked: the experts of layers 0–{n - 1} are computed by the CPU"))
    threads = ov.threads or hw.best_threads()
    if ov.threads is None:
        choices.append(Choice("--threads", str(threads), "physical cores (SMT siblings share the memory bus)"))
    block = ov.block_size or BLOCK_SIZE
    groups = weight_groups(cfg)
    every = [KVDtype.BF16, KVDtype.INT8, KVDtype.INT4]
    host_dtypes = [ov.kv_dtype] if ov.kv_dtype else every
    if device is Device.CPU and ov.kv_dtype is None:  # the CPU reads its KV where it lies: bf16 unless asked
        weight_bytes = sum(g.nbytes(g.dtype_for(weights)) for g in groups)
        host_dtypes = [next(d for d in every if _fits_host(cfg, hw, budget, wl, block, d, weight_bytes))]
        choices.append(Choice("--kv-dtype", host_dtypes[0].value, "the most exact format that fits host memory "
                              "(int8 and int4 read fewer bytes a step: --kv-dtype)"))
    stand_in = KVDtype.F32 if ov.kv_dtype is KVDtype.F32 else KVDtype.BF16  # a CPU's device tier: tests only
    gpu_dtypes = [ov.gpu_kv_dtype] if ov.gpu_kv_dtype else (every if device is Device.CUDA else [stand_in])

    def run(ov_: Overrides, host_dtype: KVDtype, gpu_dtype: KVDtype) -> _Candidate:
        return _search(cfg, hw, budget, wl, ov_, device, weights, threads, block, groups, gpu_dtype, host_dtype,
                       routing)

    scored: dict[tuple[KVDtype, KVDtype], _Candidate] = {}
    errors: list[UserError] = []
    for gpu_dtype, host_dtype in itertools.product(gpu_dtypes, host_dtypes):
        try:
            scored[gpu_dtype, host_dtype] = run(ov, host_dtype, gpu_dtype)
        except UserError as e:
            errors.append(e)
    if not scored:
        raise errors[-1]  # the last pair tried needs the least memory: its shortfall is the one to fix
    best, why = choose_kv_dtypes(scored, wl.batch)
    for flag, tier, user in (("--gpu-kv-dtype", "gpu", ov.gpu_kv_dtype), ("--kv-dtype", "host", ov.kv_dtype)):
        if user is None and getattr(best.kv, f"{tier}_tokens") and device is Device.CUDA:
            choices.append(Choice(flag, getattr(best.kv, f"{tier}_dtype").value, why))
    choices += _explain(cfg, best, ov, wl, run)
    return _finish(cfg, hw, best, wl, budget, device, weights, threads, choices)


# KV formats from the most to the least exact; the planner takes a less exact one only for more
# than QUALITY_MARGIN of predicted speed
_PRECISION = {KVDtype.F32: 0, KVDtype.BF16: 0, KVDtype.INT8: 1, KVDtype.INT4: 2}
QUALITY_MARGIN = 0.10


def choose_kv_dtypes(scored: dict[tuple[KVDtype, KVDtype], _Candidate], batch: int) -> tuple[_Candidate, str]:
    """The (device tier, host tier) KV formats: full precision when the whole KV fits on the GPU in
    bf16; otherwise the fastest pair, except that a more exact pair within QUALITY_MARGIN of its
    speed is preferred (int8 over int4, bf16 over int8). Returns the candidate and the reason."""
    def loss(c: _Candidate) -> tuple[int, int]:  # the precision given up, over the tiers holding tokens
        used = [_PRECISION[d] for d, n in ((c.kv.gpu_dtype, c.kv.gpu_tokens), (c.kv.host_dtype, c.kv.host_tokens)) if n]
        return max(used, default=0), sum(used)

    exact = [c for c in scored.values() if not c.kv.host_tokens and loss(c)[0] == 0]
    if exact:
        return max(exact, key=lambda c: _tok_s(c, batch)), "the whole KV fits on the GPU at full precision"
    fastest = max(scored.values(), key=lambda c: _tok_s(c, batch))
    top = _tok_s(fastest, batch)
    near = [c for c in scored.values() if _tok_s(c, batch) >= (1 - QUALITY_MARGIN) * top]
    best = min(near, key=lambda c: (loss(c), -_tok_s(c, batch)))
    where = f"{best.kv.gpu_tokens} GPU ({best.kv.gpu_dtype.value}) / {best.kv.host_tokens} host ({best.kv.host_dtype.value})"
    why = f"the fastest KV placement: {where} tokens a sequence predicts {_tok_s(best, batch):.1f} tok/s"
    if best is not fastest:
        f = fastest.kv
        why += (f"; {f.gpu_dtype.value}/{f.host_dtype.value} would predict {top:.1f}, within "
                f"{QUALITY_MARGIN:.0%}, at a larger accuracy cost")
    return best, why


def _search(cfg, hw, budget, wl, ov, device, weights, threads, block, groups, gpu_kv_dtype, host_dtype,
            routing=None) -> _Candidate:
    """The best candidate for one (device tier, host tier) KV dtype pair, or UserError if none fits."""
    if device is Device.CPU:  # everything in host memory; a device tier only as a stand-in, when asked
        pl = tuple(Placement(g.layer, g.kind, Device.CPU, g.dtype_for(weights), Mode.CPU, g.nbytes(g.dtype_for(weights)))
                   for g in groups)
        kv = kv_plan(cfg, wl, block, min(ov.gpu_kv_tokens or 0, wl.ctx_size), gpu_kv_dtype, host_dtype)
        kv = replace(kv, stream_tokens=ov.stream_tokens or 0)
        mem = _memory(hw, budget, pl, kv, 0)
        _check_host(mem, wl, host_dtype, ov)
        subs = ov.sub_batches or 1
        cost = decode_step(cfg, hw, pl, kv, wl.batch, wl.decode_context, threads, subs)
        return _Candidate(pl, kv, subs, mem, cost, "cpu")
    # (mode for experts, mode for everything else) of the weights that miss the GPU; for MoE also
    # the llama.cpp habit: experts on the CPU (only routed ones are read), the rest streamed
    modes = [(ov.weight_mode, ov.weight_mode)] if ov.weight_mode else \
        [(Mode.STREAM, Mode.STREAM), (Mode.CPU, Mode.CPU)] + ([(Mode.CPU, Mode.STREAM)] if cfg.is_moe else [])
    subs = [ov.sub_batches] if ov.sub_batches else ([1, 2] if wl.batch >= 2 else [1])
    orders = [("mlp first", _PRIORITY)] + ([("attention first", _ATTN_FIRST)] if cfg.is_moe else [])
    work = workspace_bytes(cfg, wl)
    # Prefill reads a layer's earlier KV into one bf16 buffer pair (offload/prefill.py); reserve twice that (its
    # peak beside SDPA's at long context is not measured) first, whenever the KV cannot sit beside every weight.
    readback = int(2 * wl.ctx_size * kv_bytes_per_token_layer(cfg, KVDtype.BF16, block))
    all_weights = sum(g.nbytes(g.dtype_for(weights)) for g in groups if g.kind is not Kind.EMBED)  # the table may stay on the host
    # the device tier's bytes at a token count a sequence, a quantized tier's bf16 tails included
    tier_bytes = lambda tokens: kv_plan(cfg, wl, block, tokens, gpu_kv_dtype, host_dtype).gpu_bytes  # noqa: E731
    full_kv = tier_bytes(wl.ctx_size)
    if budget.gpu_bytes - work - all_weights < full_kv or ov.gpu_kv_tokens is not None and ov.gpu_kv_tokens < wl.ctx_size:
        work += readback
        readback = 0
    user_kv = tier_bytes(ov.gpu_kv_tokens) if ov.gpu_kv_tokens else 0
    # experts split per expert take the GPU's room left after the other weights: also try leaving
    # room for the whole batch's KV first (KV read every step against experts read as routed)
    # (the CPU's int4 expert kernel takes rows of whole 64-weight groups)
    split_ok = cfg.is_moe and not (cfg.hidden_size % 64 or cfg.moe_intermediate_size % 64)
    reserves = [0]
    if cfg.is_moe and ov.gpu_kv_tokens is None and budget.gpu_bytes - work - all_weights < full_kv:
        reserves.append(full_kv)
    best, err = None, None
    for mode, (order_name, order), embed_gpu, reserve in itertools.product(modes, orders, (True, False), reserves):
        pl, staging = _fill(groups, weights, mode, budget.gpu_bytes - work - user_kv - reserve, order, embed_gpu,
                            ov.n_cpu_moe, split_ok, routing)
        left = budget.gpu_bytes - work - staging - sum(p.nbytes for p in pl if p.on_gpu)
        if left < 0:
            need = work + staging + sum(p.nbytes for p in pl if p.on_gpu)
            raise UserError(
                f"needs at least {fs(need)} on cuda:0 (activations and prefill buffers {fs(work)}, staging "
                f"{fs(staging)}), budget {fs(budget.gpu_bytes)}: short by {fs(need - budget.gpu_bytes)}; lower "
                f"--ubatch-size, --ctx-size or --parallel, raise --gpu-mem, or use --device cpu"
            )
        for gpu_tokens, extra, kv_reason in gpu_token_options(cfg, hw, wl, ov, left, block, gpu_kv_dtype,
                                                               host_dtype, threads, readback):
            kv0 = kv_plan(cfg, wl, block, gpu_tokens, gpu_kv_dtype, host_dtype)
            for stream, s_bytes, s_reason in stream_options(cfg, hw, wl, ov, kv0, left - kv0.gpu_bytes - extra):
                kv = replace(kv0, stream_tokens=stream)
                mem = _memory(hw, budget, pl, kv, work + staging + extra + s_bytes)
                try:
                    _check_host(mem, wl, host_dtype, ov)
                except UserError as e:
                    err = err or e
                    continue
                # streaming in one sub-batch, or two where --sub-batches says so (not measured to gain yet)
                for n in subs if not stream or ov.sub_batches else [1]:
                    mean = statistics.fmean(decode_step(cfg, hw, pl, kv, wl.batch, c, threads, n).seconds
                                            for c in wl.decode_contexts())
                    if best is None or mean < best.mean_s * (1 - 1e-9):
                        cost = decode_step(cfg, hw, pl, kv, wl.batch, wl.decode_context, threads, n)
                        best = _Candidate(pl, kv, n, mem, cost, order_name, kv_reason, s_reason, mean)
    if best is None:
        raise err
    return best


def _fits_host(cfg, hw, budget, wl, block, dtype: KVDtype, weight_bytes: int) -> bool:
    """Whether the whole batch's KV in `dtype` fits the host budget beside the weights (int4 fits or
    nothing does: then the plan's own check says by how much)."""
    kv = kv_plan(cfg, wl, block, 0, dtype, dtype).host_bytes
    return dtype is KVDtype.INT4 or weight_bytes + kv <= min(budget.host_bytes, hw.host_available_bytes)


def _fill(
    groups: list[Group], weights: WDtype, modes: tuple[Mode, Mode], cap: int, order: dict, embed_gpu: bool,
    n_cpu_moe: int = 0, split_ok: bool = False, routing: dict[int, list[float]] | None = None,
) -> tuple[tuple[Placement, ...], int]:
    """First fit in priority order; streamed weights need two GPU staging slots (double buffering,
    offload/weights.py) each as large as the largest layer's streamed groups together (the head —
    final norm and lm_head — counting as one layer), so refill with that reserved until stable.

    Experts the CPU computes (4-bit weights, split_ok) are placed one by one: the other groups
    first, then what room is left (`planner.experts.spread_experts`), the most routed to first."""
    split = split_ok and modes[0] is Mode.CPU and weights in GPU_4BIT
    cpu_experts = {i for i, g in enumerate(groups) if g.kind is Kind.EXPERTS and (g.layer < n_cpu_moe or split)}
    staging = 0
    for _ in range(4):
        room = cap - staging
        on: set[int] = set()
        for i in sorted(range(len(groups)), key=lambda i: (order[groups[i].kind], groups[i].layer)):
            n = groups[i].nbytes(groups[i].dtype_for(weights))
            if n <= room and (embed_gpu or groups[i].kind is not Kind.EMBED) and i not in cpu_experts:
                on.add(i)
                room -= n
        off = [groups[i] for i in range(len(groups)) if i not in on and groups[i].kind is not Kind.EMBED]
        per_layer: dict[int, int] = {}
        for g in off:
            if _mode(g, modes) is Mode.STREAM and not (g.kind is Kind.EXPERTS and g.layer < n_cpu_moe):
                per_layer[g.layer] = per_layer.get(g.layer, 0) + g.nbytes(g.dtype_for(weights))
        need = 2 * max(per_layer.values(), default=0)
        if need <= staging:
            break
        staging = need
    gpu_experts = spread_experts(groups, weights, room, n_cpu_moe) if split else {}
    out = []
    for i, g in enumerate(groups):
        if i in gpu_experts:
            out += expert_parts(g, weights, gpu_experts[i], (routing or {}).get(g.layer))
        elif i in on:
            dt = g.dtype_for(weights)
            out.append(Placement(g.layer, g.kind, Device.CUDA, dt, Mode.RESIDENT, g.nbytes(dt)))
        elif g.kind is Kind.EMBED or _mode(g, modes) is Mode.CPU or i in cpu_experts:  # a lookup stays put
            dt = g.dtype_for(cpu_dtype(weights))  # a whole group the CPU computes: int8 (offload.host_compute)
            out.append(Placement(g.layer, g.kind, Device.CPU, dt, Mode.CPU, g.nbytes(dt)))
        else:
            dt = g.dtype_for(weights)
            out.append(Placement(g.layer, g.kind, Device.CPU, dt, Mode.STREAM, g.nbytes(dt)))
    return tuple(out), staging


def _mode(g: Group, modes: tuple[Mode, Mode]) -> Mode:
    return modes[0] if g.kind is Kind.EXPERTS else modes[1]


def _memory(hw, budget, pl, kv, workspace) -> Memory:
    return Memory(
        gpu_budget=budget.gpu_bytes, gpu_free=hw.gpu_free_bytes,
        gpu_weights=sum(p.nbytes for p in pl if p.on_gpu), gpu_kv=kv.gpu_bytes,
        gpu_workspace=int(workspace) if hw.has_gpu else 0,
        host_budget=budget.host_bytes, host_available=hw.host_available_bytes,
        host_weights=sum(p.nbytes for p in pl if not p.on_gpu), host_kv=kv.host_bytes,
    )


def _check_host(mem: Memory, wl: Workload, host_dt: KVDtype, ov: Overrides) -> None:
    if mem.host_used <= mem.host_budget:
        return
    if mem.host_weights > mem.host_budget:  # no context or KV setting can help
        raise UserError(
            f"the weights alone need {fs(mem.host_weights)} on the host, more than its budget "
            f"{fs(mem.host_budget)} (short by {fs(mem.host_weights - mem.host_budget)}) before any KV cache: "
            + ("raise --cpu-mem, " if mem.host_budget < mem.host_available else "")
            + "use fewer bits per weight (--weights 4bit, int8), a GPU with more memory (--gpu-mem), "
              "or a smaller model"
        )
    knobs = [f"lower --ctx-size (now {wl.ctx_size})"]
    if wl.batch > 1:
        knobs.append(f"--parallel (now {wl.batch})")
    if host_dt is not KVDtype.INT4:
        knobs.append("use --kv-dtype " + ("int8" if host_dt is KVDtype.BF16 else "int4"))
    knobs.append("raise --cpu-mem" + ("" if mem.host_budget < mem.host_available else " (needs more RAM)"))
    raise UserError(
        f"needs {fs(mem.host_used)} on the host (weights {fs(mem.host_weights)}, {host_dt.value} KV "
        f"{fs(mem.host_kv)}), budget {fs(mem.host_budget)}: short by {fs(mem.host_used - mem.host_budget)}; "
        + ", ".join(knobs)
    )


def _tok_s(c: _Candidate, batch: int) -> float:
    """Tokens a second over the answer (a step's mean time, Workload.decode_contexts)."""
    return batch / (c.mean_s or c.cost.seconds)


def _explain(cfg, best: _Candidate, ov: Overrides, wl: Workload, run) -> list[Choice]:
    """One line per automatic choice, with the alternative's prediction where one was scored."""
    out: list[Choice] = []
    pl = best.placements
    off = [p for p in pl if not p.on_gpu and p.kind is not Kind.EMBED]
    embed = next(p for p in pl if p.kind is Kind.EMBED)
    me = _tok_s(best, wl.batch)

    def alt(host_dtype: KVDtype | None = None, **kw) -> float | None:
        try:
            return _tok_s(run(replace(ov, **kw), host_dtype or best.kv.host_dtype, best.kv.gpu_dtype), wl.batch)
        except UserError:
            return None

    if best.order == "cpu":
        return out
    if off and ov.weight_mode is None:
        what = []
        for mode, verb in ((Mode.STREAM, "streamed over PCIe each step"), (Mode.CPU, "computed by the CPU")):
            these = [p for p in off if p.mode is mode]
            if these:
                what.append(f"{len(these)} groups ({fs(sum(p.nbytes for p in these))}) {verb}")
        others = []
        for mode in (Mode.STREAM, Mode.CPU):
            if any(p.mode is not mode for p in off):
                other = alt(weight_mode=mode)
                others.append(f"all {mode.value} " + (f"{other:.1f} tok/s" if other else "does not fit the host budget"))
        out.append(Choice("weights off the GPU", "; ".join(what), f"predicts {me:.1f} tok/s; " + ", ".join(others)))
    elif not off:
        out.append(Choice("weights", "all on cuda", f"{fs(best.memory.gpu_weights)} fit the GPU budget"))
    if cfg.is_moe and off:
        out.append(experts_choice(cfg, pl, best.order))
    if not embed.on_gpu:
        out.append(Choice("embedding", "cpu", f"a lookup reads one row a token; its {fs(embed.nbytes)} serve better on "
                          "the GPU as weights or KV"))
    if ov.gpu_kv_tokens is None:
        out.append(Choice("GPU-tier KV", f"{best.kv.gpu_tokens} tokens a sequence", best.kv_reason))
    if ov.stream_tokens is None and best.kv.stream_tokens:
        other = alt(stream_tokens=0)
        vs = f"; {other:.1f} tok/s without" if other else ""
        out.append(Choice("streamed host KV", f"{best.kv.stream_tokens} tokens a sequence a step",
                          f"{best.stream_reason}: predicts {me:.1f} tok/s{vs}"))
    if wl.batch >= 2 and ov.sub_batches is None:  # the search streams in one sub-batch only
        n, kw = 3 - best.sub_batches, dict(stream_tokens=0) if best.sub_batches == 1 and ov.stream_tokens is None else {}
        other = alt(sub_batches=n, **kw)
        vs = f" vs {other:.1f} tok/s with {n}{' (not streamed)' if kw and best.kv.stream_tokens else ''}" if other else ""
        out.append(Choice("sub-batches", str(best.sub_batches), f"predicts {me:.1f} tok/s{vs}"))
    if ov.kv_dtype is None and best.kv.host_dtype is KVDtype.BF16 and best.kv.host_tokens:
        terms = best.cost.terms
        if max(terms, key=terms.get) == "cpu attention":
            faster = alt(KVDtype.INT8)
            if faster and faster > me * 1.05:
                out.append(Choice("hint", "--kv-dtype int8",
                                  f"would predict {faster:.1f} tok/s (+{100 * (faster / me - 1):.0f}%) at a small accuracy cost"))
    return out


def _finish(cfg, hw, c: _Candidate, wl, budget, device, weights, threads, choices) -> Plan:
    b = c.cost.nbytes
    cpu_b = b["cpu attention"] + b["cpu weights"] + b["cpu experts"]
    gpu_b = b["gpu attention"] + b["gpu weights"]
    prefill = prefill_seconds(cfg, hw, c.placements, c.kv, wl.prompt_tokens, wl.ubatch, threads)
    pred = Prediction(
        prefill_tok_s=wl.prompt_tokens / prefill if prefill else 0.0,
        decode_tok_s=wl.batch / c.cost.seconds,
        decode_step_ms=1e3 * c.cost.seconds,
        bottleneck=bottleneck(cfg, hw, c.cost, c.kv, c.sub_batches, threads, weights, wl.batch),
        step_terms_ms={k: 1e3 * v for k, v in c.cost.terms.items()},
        cpu_share=cpu_b / max(cpu_b + gpu_b, 1.0),
        gpu_share=gpu_b / max(cpu_b + gpu_b, 1.0),
    )
    upload = host_experts_upload_rows(cfg, hw, c.placements)
    choices = [*choices, upload_choice(hw, upload)] if upload else choices
    return Plan(
        model=cfg.name, num_layers=cfg.num_layers, device=device, weights=weights, threads=threads,
        sub_batches=c.sub_batches, placements=c.placements, kv=c.kv, workload=wl, budget=budget,
        memory=c.memory, prediction=pred, choices=tuple(choices), moe_upload_rows=upload,
    )
