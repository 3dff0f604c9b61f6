"""The cost model: seconds per decode step and per prefill chunk for a placement.

Every term is bytes (or flops) over a rate from the `HardwareProfile`. Each equation is
written once, in the function that computes it; `decode_step` and `prefill` only combine
them. Symbols: B batch, n sub-batches, T_g / T_c tokens a sequence has on the GPU / host
tier, kvb(dt) KV bytes per token per layer, W bytes of a weight group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cpu_attention.layout import KVDtype
from gpu_ops.runs import programs_per_run
from hetero.config import ModelConfig
from planner.plan import KVPlan, Mode, Placement
from planner.hardware import HardwareProfile
from planner.tensors import (Group, Kind, WDtype, cpu_dtype, expert_bytes, experts_touched, kv_bytes_per_token_layer,
                              router_bytes, weight_groups)

GB = 1e9
# Share of the measured PCIe rate streamed host KV gets inside a decode step. Measured about half
# (H100 host, 2026-11-22: 753 MB a step in 26 ms at 8k), but planning with 0.5 chose less streaming
# and measured slower (8k bf16 30.5 vs 38.2 tok/s, 32k bf16 13.1 vs 16.2), so plans use the full rate.
STREAM_PCIE_SHARE = 1.0
# One sub-batch: a layer's copy starts when the layer two before frees its staging slot, so this share of the
# shorter of the stream and the serial chain adds (batch rows −15%, +13%; −8%, +24% at 0: H200, 2026-11-30).
STREAM_SERIAL = 0.12
# Streamed KV is read from DRAM while the CPU attends: the CPU gets what DRAM has left, the PCIe rate spread
# over the CPU's phase where that is longer (53 GB/s against 68 alone: H100, 2026-11-23, 32k bf16; 1 × 128k
# int4 54 GB/s beside a ~41 GB/s stream, DRAM 96, 40.6 under the whole rate: H200, 2026-11-30). At least:
MIN_CPU_DRAM_SHARE = 0.25
# Per layer per sub-batch where a decode step runs the runtime's general loop through torch (weights
# streamed or computed by the CPU): graph replays, events, the worker hand-off, ~15 torch calls.
# Fitted on the H100 host, 2026-11-22 (the lean loop's is the profile's `layer_overhead_s`).
GENERAL_LOOP_OVERHEAD_S = 200e-6
# Per layer and sub-batch of a two-sub-batch step in the lean loop (offload/inline.py), on the CPU's
# path: the main thread's launches and waits (~55 µs, timed) and the pipeline's bubbles; fitted to
# 7.3–9.7 ms a step beyond the CPU's kernels (16 × 8k, 32 × 2k; H200 host, 2026-11-29, 3 machines).
LEAN_PAIR_PART_S = 110e-6
# Per layer of a step that runs whole on the GPU as one CUDA graph (no host-tier KV, every weight
# resident): the layer's small kernels (norms, RoPE, the KV write, the attention's split merge)
# beyond the GEMVs' and the attention's bytes. Stated; bench/budget.py prints it beside the measurement.
GRAPH_LAYER_OVERHEAD_S = 12e-6
# Many rows (a prefill chunk, a step whose host experts go up) run a MoE layer's experts in grouped
# 4-bit GEMMs (gpu_ops.moe_prefill): GB/s of expert bytes, the device's NF4 (524 µs for 128 Qwen3
# experts of ~32 rows) and a host int4 expert after its copy up (229 µs for 24; H100, 2026-11-28).
PREFILL_EXPERT_GBPS = 650.0
PREFILL_HOST_EXPERT_GBPS = 280.0
# Per MoE layer whose experts are split between the devices: the call's hand-off (a flag the side
# stream sets and a pool thread polls: cpu_attention.experts_pool). And the CPU's experts run in a
# step at a share of their rate alone: 55–71 GB/s against 69–102 at 8 GiB, 67 against 72 at 14 GiB
# (bench/moe.py, the Qwen3-30B-A3B shape, H200 host, 2026-11-29, four calls).
HOST_EXPERTS_CALL_S = 5e-6
HOST_EXPERTS_STEP_SHARE = 0.85
# Per MoE layer in the GPU's step: routing (the router GEMV, then one kernel: gpu_ops.moe_route)
# and the weighted sum, small kernels beyond the experts' bytes. Fitted on the all-GPU row of the
# same shape (2.99–3.11 ms a step, H200 host, 2026-11-29).
MOE_LAYER_OVERHEAD_S = 27e-6
# Per MoE layer whose host experts share the CPU with the host KV tier's attention: OpenMP's threads
# spin after each attention region while the experts' own spinning pool and its flag-polling thread
# want the same cores. A host tier of 256 tokens forced beside 73–84 host experts a layer (Qwen3 at
# 8 GiB, H200 host, 2026-11-29): 194 ms a step at one row against 25 predicted without this term,
# 396–433 at 8 rows against 108. The planner takes such a plan only where nothing else fits.
HOST_TIER_BESIDE_EXPERTS_S = 3.5e-3
HOST_TIER_BESIDE_EXPERTS_ROW_S = 0.4e-3


@dataclass(frozen=True)
class StepCost:
    seconds: float
    terms: dict[str, float]  # seconds on each resource over the step ("gpu weights", "cpu attention", ...)
    nbytes: dict[str, float]  # bytes each resource reads or moves over the step


def read_bytes(g: Group, p: Placement, tokens: int) -> float:
    """Weight bytes `tokens` tokens read from a group: W, except the embedding (one bf16 row a
    token) and experts (the router and the experts the tokens route to)."""
    if g.kind is Kind.EMBED:
        return tokens * WDtype.BF16.nbytes(g.active_params)
    if g.kind is Kind.EXPERTS:
        if p.experts is not None:  # a part of a split group: the router goes with the device's part
            return (router_bytes(g) if p.on_gpu else 0) + touched_experts(g, p, tokens) * expert_bytes(g, p.dtype)
        router = router_bytes(g)
        return router + touched_experts(g, p, tokens) * (p.nbytes - router) / (g.params // g.expert_params)
    return p.nbytes


def gemv_seconds(nbytes: float, flops: float, gbps: float, gflops: float) -> float:
    """A matrix-vector product (or a thin GEMM) is bound by reading its weights or by its flops:
    max(W / rate, 2·params·tokens / flop rate)."""
    return max(nbytes / (gbps * GB), flops / (gflops * GB))


def attention_seconds(batch: int, tokens: int, dtype: KVDtype, cfg: ModelConfig, gbps: float, block_size: int) -> float:
    """Decode attention of one layer reads each cached token's K and V once: B · T · kvb(dt) / rate."""
    if tokens <= 0 or batch <= 0:
        return 0.0
    return batch * tokens * kv_bytes_per_token_layer(cfg, dtype, block_size) / (gbps * GB)


def hop_seconds(nbytes: float, hw: HardwareProfile) -> float:
    """One small PCIe copy: latency + bytes / rate."""
    return hw.pcie_latency_s + nbytes / (max(hw.pcie_h2d_gbps, 1e-9) * GB)


def layer_groups(cfg: ModelConfig, placements: Sequence[Placement]) -> dict[int, list[tuple[Group, Placement]]]:
    """Layer → its (group, placement) pairs; a split experts group pairs with each of its parts."""
    by_key: dict[tuple[int, Kind], list[Placement]] = {}
    for p in placements:
        by_key.setdefault((p.layer, p.kind), []).append(p)
    out: dict[int, list[tuple[Group, Placement]]] = {}
    for g in weight_groups(cfg):
        out.setdefault(g.layer, []).extend((g, p) for p in by_key[(g.layer, g.kind)])
    return out


def split_experts(p: Placement) -> bool:
    """A placement of part of an experts group: its experts computed beside the other device's."""
    return p.kind is Kind.EXPERTS and p.experts is not None


def tier_tokens(kv: KVPlan, context: int) -> tuple[int, int]:
    """A sequence's tokens fill the GPU tier first: (T_g, T_c) at `context` tokens."""
    gpu = min(context, kv.gpu_tokens)
    return gpu, min(context - gpu, kv.host_tokens)


def kv_reads(cfg: ModelConfig, rows: int, run_rows: int) -> tuple[int, int]:
    """(device-tier reads, host-tier reads) of the KV by `rows` rows in runs of `run_rows` rows of
    one sequence: a GPU attention program reads it for several rows of a run (`programs_per_run`);
    the CPU attends a run's earlier tokens once for all its rows (cpu_attention/decode_run.py),
    though not in one row's time (`decode_step`)."""
    seqs = -(-rows // run_rows)
    return seqs * programs_per_run(run_rows, max(1, cfg.num_heads // cfg.num_kv_heads)), seqs


def decode_step(
    cfg: ModelConfig, hw: HardwareProfile, placements: Sequence[Placement], kv: KVPlan,
    batch: int, context: int, threads: int, sub_batches: int, run_rows: int = 1,
) -> StepCost:
    """One decode step of `batch` rows at `context` tokens each: `batch` sequences, or runs of
    `run_rows` rows of one sequence (a speculative step), whose KV is read as `kv_reads` says.

    Per layer, with n sub-batches of B/n sequences:
      g = Σ_sub (GPU GEMVs of resident and streamed groups) + GPU attention over T_g (+ T_s)
      c = Σ_sub (CPU GEMVs of CPU-mode groups) + CPU attention over T_c − T_s (+ a fixed cost per call),
          at min(kernel rate, DRAM − PCIe · min(1, stream / CPU time)) when T_s > 0; a run
          of rows at the profile's measured multiple of one row (`HardwareProfile.cpu_run_cost`),
          and each sequence past one at its measured cost a kv head (`cpu_items_seconds`)
      p = streamed W / PCIe + B · T_s · kvb / PCIe  (copy streams, prefetched a layer or two ahead)
      d = B · T_c · kvb / DRAM read                 (host KV leaves DRAM once, to the CPU or to PCIe)
      x = n · (q down + o, lse up) hops, + hidden-state hops around CPU-mode groups
      n = 1: t = max(g_lin + max(g_att, c_att + x_att), p, d) + c_w + x_w
             + STREAM_SERIAL · min(that chain, the streamed KV's share of p)
             (attention overlaps across devices; CPU-mode weights stall the GPU)
      n = 2: t = max(g, c + x, p, d)   (sub-batch A's GPU work hides B's CPU work, NEO-style)
      t += per-layer overhead (one sub-batch: the lean loop's; else n · the general loop's, or in
           the lean loop n · its main thread's share, added to c instead; for a layer whose host
           experts share the CPU with the host tier's attention, their contention)
    step = Σ_layers t + head (final norm, lm_head, embedding lookup) in the same way.
    T_s: each sequence's host-tier first tokens the GPU attends over after copying them up (rows of one sequence each).
    """
    # the runtime's lean loop (offload/inline.py): one or two sub-batches, no weights moving during the step
    lean = sub_batches <= 2 and all(p.mode is Mode.RESIDENT or p.kind is Kind.EMBED or split_experts(p)
                                    for p in placements)
    T_g, T_c = tier_tokens(kv, context)
    if lean and not T_c:  # the whole step as one graph of every row (offload/steps.py), sub-batches or not
        sub_batches = 1
    T_s = min(kv.stream_tokens, T_c) if run_rows == 1 and hw.has_gpu else 0
    BS = kv.block_size
    sub = [batch // sub_batches + (1 if i < batch % sub_batches else 0) for i in range(sub_batches)]
    attn_rate = hw.cpu_attention_rate(kv.host_dtype, threads)
    run_cost = hw.cpu_run_cost(kv.host_dtype, threads, run_rows)  # a run's rows: arithmetic grows with them
    reads_g, reads_c = kv_reads(cfg, batch, run_rows)
    if T_s and hw.dram_read_gbps:  # DRAM shared with the stream (MIN_CPU_DRAM_SHARE)
        # the stream's share of the CPU's phase: (B · T_s · kvb / PCIe) / (reads · T_cpu · kvb / CPU rate)
        duty = min(1.0, batch * T_s * attn_rate / max(reads_c * (T_c - T_s) * hw.pcie_h2d_gbps, 1e-9))
        attn_rate = min(attn_rate, max(hw.dram_read_gbps - duty * STREAM_PCIE_SHARE * hw.pcie_h2d_gbps,
                                       MIN_CPU_DRAM_SHARE * hw.dram_read_gbps))
    terms = dict.fromkeys(("gpu weights", "gpu attention", "cpu attention", "cpu weights", "cpu experts",
                           "pcie weights", "pcie kv", "transfers", "overhead"), 0.0)
    per_layer, weight_bytes = _weight_terms(cfg, hw, placements, tuple(sub))
    nbytes = dict.fromkeys(terms, 0.0) | weight_bytes
    # a layer's attention (every layer's alike)
    a_att = a_c = a_x = a_s = a_d = 0.0
    T_cpu = T_c - T_s
    kvb_g, kvb_h = kv_bytes_per_token_layer(cfg, kv.gpu_dtype, BS), kv_bytes_per_token_layer(cfg, kv.host_dtype, BS)
    for b in sub:
        b_g, b_c = kv_reads(cfg, b, run_rows)
        a_att += attention_seconds(b_g, T_g, kv.gpu_dtype, cfg, hw.gpu_attention_rate(kv.gpu_dtype) or 1.0, BS)
        a_att += attention_seconds(b_g, T_s, kv.host_dtype, cfg, hw.gpu_attention_rate(kv.host_dtype) or 1.0, BS)
        if T_cpu:
            a_c += attention_seconds(b_c, T_cpu, kv.host_dtype, cfg, attn_rate, BS) * run_cost \
                + hw.cpu_items_seconds(kv.host_dtype, threads, b_c, cfg.num_kv_heads) + hw.cpu_attention_call_s
        if T_cpu and hw.has_gpu:  # q [b, Hq, D] f32 down; o [b, Hq, D] f32 + lse [b, Hq] up
            a_x += hop_seconds(b * cfg.q_size * 4, hw) + hop_seconds(b * (cfg.q_size + cfg.num_heads) * 4, hw)
    a_s = batch * T_s * kvb_h / (STREAM_PCIE_SHARE * max(hw.pcie_h2d_gbps, 1e-9) * GB)
    if T_s:
        a_d = batch * T_c * kvb_h / (max(hw.dram_read_gbps, 1e-9) * GB)
    # a layer's loop overhead, by the runtime's decode strategy: the whole-step graph, the lean loop, the general loop
    loop_s = GRAPH_LAYER_OVERHEAD_S if lean and not T_c else sub_batches * GENERAL_LOOP_OVERHEAD_S if not lean \
        else hw.layer_overhead_s if sub_batches == 1 else sub_batches * LEAN_PAIR_PART_S
    total = 0.0
    for layer, (g_lin, c_w, p, x_w, g_e, c_e, x_e) in per_layer:  # layers, then the head
        g_att = c_att = x_att = s_up = d = over = 0.0  # the head: no attention, no layer overhead
        if layer >= 0:
            g_att, c_att, x_att, s_up, d, over = a_att, a_c, a_x, a_s, a_d, loop_s
            nbytes["gpu attention"] += reads_g * (T_g * kvb_g + T_s * kvb_h)
            nbytes["cpu attention"] += reads_c * T_cpu * kvb_h
            nbytes["pcie kv"] += batch * T_s * kvb_h
            if cfg.moe_layers[layer]:
                over += MOE_LAYER_OVERHEAD_S
                if T_cpu and c_e:
                    over += HOST_TIER_BESIDE_EXPERTS_S + (batch - 1) * HOST_TIER_BESIDE_EXPERTS_ROW_S
        e = max(g_e, c_e + x_e)
        if sub_batches == 1:
            chain = g_lin + max(g_att, c_att + x_att) + e
            t = max(chain, p + s_up, d) + STREAM_SERIAL * min(chain, s_up) + c_w + x_w + over
        else:  # the lean loop's own work is the CPU's thread's
            c_all = c_att + c_w + c_e + x_att + x_w + x_e
            t = max(g_lin + g_att + g_e, c_all + over, p + s_up, d) if lean else \
                max(g_lin + g_att + g_e, c_all, p + s_up, d) + over
        total += t
        for k, v in (("gpu weights", g_lin + g_e), ("gpu attention", g_att), ("cpu attention", c_att),
                     ("cpu weights", c_w), ("cpu experts", c_e), ("pcie weights", p), ("pcie kv", s_up),
                     ("transfers", x_att + x_w + x_e), ("overhead", over)):
            terms[k] += v
    return StepCost(total, terms, nbytes)


# `_weight_terms` of the placements last costed: a search costs one placement at many KV splits and
# contexts, and its weights' terms do not depend on them (the entry keeps its arguments, so ids are
# not reused while it lives)
_WEIGHT_TERMS: dict[tuple, tuple] = {}


def _weight_terms(cfg: ModelConfig, hw: HardwareProfile, placements: Sequence[Placement], sub: tuple[int, ...]
                  ) -> tuple[list[tuple[int, tuple[float, ...]]], dict[str, float]]:
    """`decode_step`'s weight terms, per layer (layers, then the head) for sub-batches of `sub`
    rows: (g_lin, c_w, p, x_w, g_e, c_e, x_e) seconds, and the bytes each resource reads."""
    key = (id(cfg), id(hw), id(placements), sub)
    hit = _WEIGHT_TERMS.get(key)
    if hit is not None and hit[0] is cfg and hit[1] is hw and hit[2] is placements:
        return hit[3]
    gpu_gflops = hw.gpu_tflops * 1000 or 1e9
    nbytes = dict.fromkeys(("gpu weights", "cpu weights", "cpu experts", "pcie weights"), 0.0)
    out = []
    for layer, groups in sorted(layer_groups(cfg, placements).items(), key=lambda kv_: kv_[0] < 0):
        g_lin = c_w = p = x_w = g_e = c_e = x_e = 0.0
        for g, pl in groups:
            for b in sub:
                rb = read_bytes(g, pl, b)
                flops = 2.0 * g.active_params * b
                if split_experts(pl) and pl.mode is Mode.CPU:  # beside the GPU's experts, off the GIL
                    # the host's kernel decodes an expert's rows once a token routed to it, and the
                    # decode bounds it: its time follows the (token, expert) pairs, not the experts read;
                    # from some rows on, the experts go up to the GPU instead (`host_experts_seconds`)
                    t_e, up = host_experts_seconds(g, pl, hw, b)
                    if up:
                        p += t_e
                        nbytes["pcie weights"] += len(pl.experts) * expert_bytes(g, pl.dtype)
                    else:
                        c_e += t_e
                        nbytes["cpu experts"] += rb
                        if hw.has_gpu:  # the host's share read over PCIe by the sum's kernel (its
                            # input is written down by the routing kernel: posted writes)
                            x_e += hop_seconds(b * cfg.hidden_size * 4, hw)
                elif split_experts(pl):
                    g_e += gemv_seconds(rb, flops, hw.gpu_linear_gbps(b, pl.dtype), gpu_gflops)
                    nbytes["gpu weights"] += rb
                elif pl.mode is Mode.CPU:
                    c_w += gemv_seconds(rb, flops, hw.cpu_gemv_gbps, hw.cpu_gflops)
                    nbytes["cpu weights"] += rb
                    if g.kind is not Kind.EMBED and hw.has_gpu:
                        x_w += 2 * hop_seconds(b * cfg.hidden_size * 2, hw)
                else:
                    g_lin += gemv_seconds(rb, flops, hw.gpu_linear_gbps(b, pl.dtype), gpu_gflops)
                    nbytes["gpu weights"] += rb
            if pl.mode is Mode.STREAM:
                p += pl.nbytes / (hw.pcie_h2d_gbps * GB)
                nbytes["pcie weights"] += pl.nbytes
        out.append((layer, (g_lin, c_w, p, x_w, g_e, c_e, x_e)))
    result = (out, nbytes)
    if isinstance(placements, tuple):  # a list could change under the same id
        if len(_WEIGHT_TERMS) > 64:
            _WEIGHT_TERMS.clear()
        _WEIGHT_TERMS[key] = (cfg, hw, placements, result)
    return result


def host_experts_seconds(g: Group, p: Placement, hw: HardwareProfile, rows: int) -> tuple[float, bool]:
    """A step of `rows` rows through the host's part p of a split experts group: (seconds, whether
    its experts go up to the GPU). The CPU decodes an expert's weights once a token routed to it
    (rows · k · share of them at its kernel's rate, plus the call's hand-off); a copy up reads each
    of the part's experts once (their bytes over PCIe), the GPU's grouped GEMM applying each piece
    while the next one's copy is in flight. The runtime takes the cheaper for each step's rows
    (`host_experts_upload_rows`: from how many rows that is the copy)."""
    flops = 2.0 * g.active_params * rows * _share(g, p)
    decoded = _routed(g, p, rows) * expert_bytes(g, p.dtype)
    cpu = gemv_seconds(max(read_bytes(g, p, rows), decoded), flops, hw.cpu_experts_rate * HOST_EXPERTS_STEP_SHARE,
                       hw.cpu_gflops) + HOST_EXPERTS_CALL_S
    if not hw.has_gpu or not hw.pcie_h2d_gbps:
        return cpu, False
    up = max(len(p.experts) * expert_bytes(g, p.dtype) / (hw.pcie_h2d_gbps * GB),
             touched_experts(g, p, rows) * expert_bytes(g, p.dtype) / (PREFILL_HOST_EXPERT_GBPS * GB))
    return (up, True) if up < cpu else (cpu, False)


def host_experts_upload_rows(cfg: ModelConfig, hw: HardwareProfile, placements: Sequence[Placement],
                             most: int = 1 << 16) -> int:
    """The fewest rows from which a step's host experts go up to the GPU rather than being computed
    by the CPU (`host_experts_seconds`), over the layers that split their experts (the median
    layer's); 0 where none does or there is no GPU. At one copy of the host's experts against one
    decode of an expert a routed token, that is about E · CPU rate / (k · PCIe rate) rows (18–25 for
    Qwen3-30B-A3B on the GPU host)."""
    rows = []
    for g, p in (gp for groups in layer_groups(cfg, placements).values() for gp in groups):
        if split_experts(p) and p.mode is Mode.CPU and p.experts:
            lo, hi = 0, most  # the CPU's at lo rows, the copy's at hi (or none before `most`)
            while hi - lo > 1:  # the copy's cost levels off as the CPU's grows with the rows: bisect
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if host_experts_seconds(g, p, hw, mid)[1] else (mid, hi)
            rows.append(hi)
    return sorted(rows)[len(rows) // 2] if rows and hw.has_gpu else 0


def _experts_k(g: Group) -> tuple[int, int]:
    """(experts, experts a token routes to) of an experts group."""
    return g.params // g.expert_params, round((g.active_params - g.small_params) / g.expert_params)


def _share(g: Group, p: Placement) -> float:
    """The share of the group's routing that lands on placement p's experts (its measured share, else
    its count over all; 1 for a whole group)."""
    if p.experts is None:
        return 1.0
    return p.share if p.share is not None else len(p.experts) / _experts_k(g)[0]


def _routed(g: Group, p: Placement, tokens: int) -> float:
    """(token, expert) pairs of `tokens` tokens that land on placement p's experts: tokens · k · share."""
    return tokens * _experts_k(g)[1] * _share(g, p)


def touched_experts(g: Group, p: Placement, tokens: int) -> float:
    """Experts of placement p (a whole experts group or a split part) that `tokens` tokens route to."""
    return experts_touched(*_experts_k(g), tokens) * _share(g, p)


def bottleneck(cfg: ModelConfig, hw: HardwareProfile, cost: StepCost, kv: KVPlan, sub_batches: int, threads: int,
               gpu_dtype: WDtype, batch: int = 1) -> str:
    """The step's largest term, in words: what it moves, how much, at what rate."""
    t, b = cost.terms, cost.nbytes
    key = max(t, key=t.get)
    share = f" ({100 * t[key] / cost.seconds:.0f}% of the step)"
    gb = lambda k: f"{b[k] / 1e9:.2f} GB"  # noqa: E731
    if key == "gpu weights":
        rows = -(-batch // sub_batches)
        return f"GPU weights: {gb(key)} of {gpu_dtype.value} at {hw.gpu_linear_gbps(rows, gpu_dtype):.0f} GB/s" + share
    if key == "gpu attention":
        return f"GPU attention: {gb(key)} of {kv.gpu_dtype.value} KV at {hw.gpu_attention_rate(kv.gpu_dtype):.0f} GB/s" + share
    if key == "cpu attention":
        rate = hw.cpu_attention_rate(kv.host_dtype, threads)
        return f"CPU attention: {gb(key)} of {kv.host_dtype.value} KV at {rate:.0f} GB/s" + share
    if key == "cpu weights":
        dt = cpu_dtype(gpu_dtype).value
        return f"CPU weights: {gb(key)} of {dt} at {hw.cpu_gemv_gbps:.0f} GB/s" + share
    if key == "cpu experts":
        dt = cpu_dtype(gpu_dtype, Kind.EXPERTS).value
        return (f"CPU experts: {gb(key)} of {dt} experts at {hw.cpu_experts_rate * HOST_EXPERTS_STEP_SHARE:.0f} GB/s "
                f"in a step ({hw.cpu_experts_rate:.0f} alone)" + share)
    if key == "pcie weights":
        return f"PCIe weight streaming: {gb(key)} at {hw.pcie_h2d_gbps:.0f} GB/s" + share
    if key == "pcie kv":
        return f"PCIe KV streaming: {gb(key)} of host {kv.host_dtype.value} KV at {hw.pcie_h2d_gbps:.0f} GB/s" + share
    if key == "transfers":
        return f"PCIe round trips: {cfg.num_layers * sub_batches} layers' q/o copies at {hw.pcie_latency_s * 1e6:.0f} µs each" + share
    per = f"{cfg.num_layers} × {t[key] / cfg.num_layers * 1e6:.0f} µs"
    if t["cpu experts"] and t["cpu attention"]:  # HOST_TIER_BESIDE_EXPERTS_S in it
        return f"the host KV tier's attention and the host experts contending for the CPU's cores: {per}" + share
    return f"per-layer overhead: {per}" + share


def speculative_gain(cfg: ModelConfig, hw: HardwareProfile, p, rate: float,
                     max_draft: int = 7) -> tuple[int, float]:
    """(draft length k, predicted speed-up over plain decoding) for one sequence whose drafts are
    kept at `rate` each: a step of k drafts yields (1 − rate^(k+1)) / (1 − rate) tokens and costs
    `decode_step` at a run of k + 1 rows (its KV read as `kv_reads` says; the host's own-part rows,
    the run's last tokens, are left out)."""
    wl = p.workload
    base = decode_step(cfg, hw, p.placements, p.kv, 1, wl.decode_context, p.threads, 1).seconds
    best = (0, 1.0)
    a = min(max(rate, 0.0), 0.999)
    for k in range(1, max_draft + 1):
        step = decode_step(cfg, hw, p.placements, p.kv, k + 1, wl.decode_context, p.threads, 1, run_rows=k + 1).seconds
        gain = (1 - a ** (k + 1)) / (1 - a) * base / step
        if gain > best[1]:
            best = (k, gain)
    return best
