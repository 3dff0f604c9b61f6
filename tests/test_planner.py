"""Planner: budgets, priorities, monotone predictions, JSON round trips, no-fit messages."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cpu_attention.layout import KVDtype
from hetero.config import LLAMA3_8B, Arch, ModelConfig
from hetero.errors import UserError
from planner import Budget, HardwareProfile, Overrides, Plan, Workload, format_size, parse_size, plan
from planner.cost import decode_step
from planner.plan import Device, Mode
from planner.tensors import (
    Kind, WDtype, experts_touched, kv_bytes_per_seq_layer, kv_bytes_per_token_layer, total_params, weight_groups,
)

GIB = 1024**3
QWEN3_30B_A3B = ModelConfig(
    arch=Arch.QWEN3_MOE, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
    num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, max_position_embeddings=40960, name="qwen3-30b-a3b-shape",
)
LLAMA3_70B = ModelConfig(
    arch=Arch.LLAMA, vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
    num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=131072, name="llama-3-70b-shape",
)
CONFIGS = [LLAMA3_8B, QWEN3_30B_A3B, LLAMA3_70B]
HOSTS = {g: HardwareProfile.synthetic(g, pcie_gbps=25, dram_gbps=60, host_gib=192) for g in (8, 12, 24, None)}
WL = Workload(ctx_size=16384, batch=2, gen_tokens=256)


def test_param_counts_match_the_published_sizes():
    assert total_params(LLAMA3_8B) == pytest.approx(8.03e9, rel=0.01)
    assert total_params(QWEN3_30B_A3B) == pytest.approx(30.5e9, rel=0.01)
    assert total_params(LLAMA3_70B) == pytest.approx(70.6e9, rel=0.01)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("gpu", [8, 12, 24, None])
def test_budgets_respected(cfg, gpu):
    hw = HOSTS[gpu]
    p = plan(cfg, hw, workload=WL)
    m = p.memory
    assert m.gpu_used <= m.gpu_budget < hw.gpu_free_bytes or not hw.has_gpu
    assert m.host_used <= m.host_budget < hw.host_available_bytes
    assert p.kv.gpu_tokens + p.kv.host_tokens >= WL.ctx_size
    assert m.gpu_weights == sum(x.nbytes for x in p.placements if x.on_gpu)
    assert p.prediction.decode_tok_s > 0 and p.prediction.prefill_tok_s > 0
    assert p.prediction.bottleneck
    if not hw.has_gpu:
        assert p.device is Device.CPU and m.gpu_used == 0 and p.kv.gpu_tokens == 0
        assert all(x.mode is Mode.CPU for x in p.placements)
    else:
        assert p.device is Device.CUDA


def test_small_model_fills_gpu_with_weights_then_kv():
    p = plan(LLAMA3_8B, HOSTS[8], workload=Workload(32768), overrides=Overrides(gpu_kv_dtype=KVDtype.BF16))
    layer_groups = [x for x in p.placements if x.layer >= 0]
    assert all(x.on_gpu and x.dtype in (WDtype.NF4, WDtype.BF16) for x in layer_groups)
    assert p.placement(-1, Kind.LM_HEAD).on_gpu
    assert 0 < p.kv.gpu_tokens < 32768 and p.kv.host_tokens > 0
    assert p.gpu_layers == 32


def test_dense_priority_mlp_before_attention_before_kv():
    p = plan(LLAMA3_70B, HOSTS[24], workload=WL)
    on = lambda k: [x.on_gpu for x in p.placements if x.kind is k]  # noqa: E731
    assert p.placement(-1, Kind.LM_HEAD).on_gpu
    assert sum(on(Kind.MLP)) > 0 and not all(on(Kind.ATTN))
    # first fit in priority order: an attention group is on the GPU only if the MLP groups that
    # are off it were too big for the room left
    mlp_off = [x for x in p.placements if x.kind is Kind.MLP and not x.on_gpu]
    attn_on = [x for x in p.placements if x.kind is Kind.ATTN and x.on_gpu]
    if mlp_off and attn_on:
        assert min(x.nbytes for x in attn_on) < min(x.nbytes for x in mlp_off)
    # GPU-tier KV only gets what no weight group fits into
    off = [x.nbytes for x in p.placements if not x.on_gpu and x.kind is not Kind.EMBED]
    if off:
        assert p.kv.gpu_bytes < min(off)


def test_moe_counts_activated_experts():
    assert experts_touched(128, 8, 1) == pytest.approx(8)
    assert 8 < experts_touched(128, 8, 4) < 32
    p = plan(QWEN3_30B_A3B, HOSTS[24], workload=Workload(4096, batch=1))
    one = decode_step(QWEN3_30B_A3B, HOSTS[24], p.placements, p.kv, 1, 2048, 8, 1)
    four = decode_step(QWEN3_30B_A3B, HOSTS[24], p.placements, p.kv, 4, 2048, 8, 1)
    experts = sum(x.nbytes for x in p.placements if x.kind is Kind.EXPERTS)
    assert one.nbytes["gpu weights"] < 0.2 * experts  # 8 of 128 experts a token
    assert one.nbytes["gpu weights"] < four.nbytes["gpu weights"]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_more_gpu_memory_never_predicts_slower(cfg):
    """With the KV formats held (the automatic choice trades speed for precision when memory allows:
    full precision once the whole KV fits in bf16)."""
    hw = HardwareProfile.synthetic(80, host_gib=256)
    last = 0.0
    for gib in [2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64]:
        try:
            p = plan(cfg, hw, Budget(gib * GIB, 200 * GIB), WL, Overrides(kv_dtype=KVDtype.BF16, gpu_kv_dtype=KVDtype.BF16))
        except UserError:
            continue
        assert p.prediction.decode_tok_s >= last * (1 - 1e-9), f"{gib} GiB"
        last = p.prediction.decode_tok_s
    assert last > 0


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_plan_json_round_trip(cfg):
    for hw in HOSTS.values():
        p = plan(cfg, hw, workload=WL)
        q = Plan.from_json(p.to_json())
        assert q == p


def test_profile_json_round_trip():
    for hw in HOSTS.values():
        assert HardwareProfile.from_json(hw.to_json()) == hw


def test_user_values_are_never_changed():
    ov = Overrides(kv_dtype=KVDtype.INT4, threads=3, sub_batches=1, gpu_kv_tokens=1024, weight_mode=Mode.CPU)
    p = plan(LLAMA3_70B, HOSTS[12], Budget(10 * GIB, 150 * GIB), WL, ov)
    assert p.kv.host_dtype is KVDtype.INT4 and p.threads == 3 and p.sub_batches == 1 and p.kv.gpu_tokens == 1024
    assert p.budget == Budget(10 * GIB, 150 * GIB)
    assert all(x.mode is not Mode.STREAM for x in p.placements)
    auto = {c.setting for c in p.choices}
    assert not auto & {"--kv-dtype", "--threads", "sub-batches", "GPU-tier KV", "--gpu-mem", "--cpu-mem",
                       "weights off the GPU"}
    p = plan(LLAMA3_8B, HOSTS[24], workload=WL, overrides=Overrides(device=Device.CPU))
    assert p.device is Device.CPU and p.memory.gpu_used == 0


def test_streamed_host_kv_within_the_budget_and_one_sub_batch():
    """With the KV on the host, the GPU takes a share of each sequence's host tier over PCIe when
    that predicts faster: at batch 1, and at larger batches in one sub-batch (staging for every
    row within the budget), or two where the user sets them; never without a GPU; a user's value
    stands."""
    hw = HOSTS[8]
    wl = Workload(32768, batch=1, gen_tokens=256)
    p = plan(LLAMA3_8B, hw, Budget(6 * GIB, 150 * GIB), wl, Overrides(gpu_kv_tokens=0))
    assert 0 < p.kv.stream_tokens < p.kv.host_tokens and p.kv.stream_tokens % p.kv.block_size == 0
    assert p.memory.gpu_used <= p.memory.gpu_budget
    off = plan(LLAMA3_8B, hw, Budget(6 * GIB, 150 * GIB), wl, Overrides(gpu_kv_tokens=0, stream_tokens=0))
    assert off.kv.stream_tokens == 0
    assert p.prediction.decode_tok_s > off.prediction.decode_tok_s
    assert any(c.setting == "streamed host KV" for c in p.choices)
    batch = plan(LLAMA3_8B, hw, Budget(6 * GIB, 150 * GIB), WL, Overrides(gpu_kv_tokens=0))
    assert WL.batch > 1 and batch.kv.stream_tokens > 0 and batch.sub_batches == 1
    assert batch.memory.gpu_used <= batch.memory.gpu_budget
    unstreamed = plan(LLAMA3_8B, hw, Budget(6 * GIB, 150 * GIB), WL, Overrides(gpu_kv_tokens=0, stream_tokens=0))
    assert batch.prediction.decode_tok_s > unstreamed.prediction.decode_tok_s
    two = plan(LLAMA3_8B, hw, Budget(6 * GIB, 150 * GIB), WL, Overrides(gpu_kv_tokens=0, sub_batches=2))
    assert two.sub_batches == 2 and two.kv.stream_tokens > 0 and two.memory.gpu_used <= two.memory.gpu_budget
    assert two.prediction.decode_tok_s > plan(LLAMA3_8B, hw, Budget(6 * GIB, 150 * GIB), WL, Overrides(
        gpu_kv_tokens=0, sub_batches=2, stream_tokens=0)).prediction.decode_tok_s  # streamed where it predicts faster
    set_ = plan(LLAMA3_8B, hw, Budget(6 * GIB, 150 * GIB), WL, Overrides(gpu_kv_tokens=0, sub_batches=2, stream_tokens=64))
    assert (set_.kv.stream_tokens, set_.sub_batches) == (64, 2)
    assert plan(LLAMA3_8B, HOSTS[None], workload=wl).kv.stream_tokens == 0
    with pytest.raises(UserError, match="kv-stream-tokens"):
        plan(LLAMA3_8B, hw, Budget(6 * GIB, 150 * GIB), wl, Overrides(gpu_kv_tokens=0, stream_tokens=10**7))


def test_stream_options_reach_the_answers_later_steps():
    """A conversation's later steps hold more host-tier tokens than its mean step: the streamed
    counts tried go past the mean step's host tier (a sequence streams at most what it holds), up
    to what the staging room takes, and never past it."""
    from planner.kv_tiers import kv_plan, stream_options, stream_staging_bytes

    wl = Workload.conversation(2048, 32)
    kv = kv_plan(LLAMA3_8B, wl, 32, 1056, KVDtype.INT4, KVDtype.INT4)
    left = 62 * 2**20
    opts = stream_options(LLAMA3_8B, HOSTS[8], wl, Overrides(), kv, left)
    tokens = [n for n, _, _ in opts]
    assert max(tokens) > wl.decode_context - kv.gpu_tokens
    assert all(need <= left and n % kv.block_size == 0 for n, need, _ in opts)
    a_block = stream_staging_bytes(LLAMA3_8B, KVDtype.INT4, kv.block_size, kv.block_size, wl.batch)
    assert left - max(need for _, need, _ in opts) < a_block  # the room filled to a block
    assert stream_options(LLAMA3_8B, HOSTS[None], wl, Overrides(), kv, left) == [(0, 0, opts[0][2])]


def test_no_fit_says_by_how_much_where_and_which_option():
    with pytest.raises(UserError) as e:
        plan(LLAMA3_8B, HOSTS[None], Budget(0, 12 * GIB), Workload(131072))  # the KV cache does not fit
    msg = str(e.value)
    assert "host" in msg and "short by" in msg and "--ctx-size" in msg and "--cpu-mem" in msg
    with pytest.raises(UserError) as e:
        plan(LLAMA3_70B, HOSTS[None], Budget(0, 48 * GIB), WL)  # the weights alone do not: no context helps
    msg = str(e.value)
    assert "weights alone" in msg and "short by" in msg and "--ctx-size" not in msg and "--cpu-mem" in msg
    with pytest.raises(UserError) as e:
        plan(LLAMA3_8B, HOSTS[8], Budget(200 * 2**20, 48 * GIB), WL)
    msg = str(e.value)
    assert "cuda:0" in msg and "short by" in msg and "--gpu-mem" in msg
    with pytest.raises(UserError, match="--kv-dtype int8"):
        plan(LLAMA3_8B, HOSTS[8], Budget(6 * GIB, 12 * GIB), Workload(131072), Overrides(kv_dtype=KVDtype.BF16))
    with pytest.raises(UserError, match="--device cpu"):
        plan(LLAMA3_8B, HOSTS[None], workload=WL, overrides=Overrides(device=Device.CUDA))


def test_host_kv_dtype_falls_back_to_what_fits():
    """bf16 host KV (16 GiB at 128k) does not fit a 12 GiB host budget: a quantized host tier, its
    choice printed with the prediction."""
    p = plan(LLAMA3_8B, HOSTS[8], Budget(6 * GIB, 12 * GIB), Workload(131072))
    assert p.kv.host_dtype in (KVDtype.INT8, KVDtype.INT4) and p.memory.host_used <= p.budget.host_bytes
    assert any(c.setting == "--kv-dtype" and "tok/s" in c.reason for c in p.choices)
    with pytest.raises(UserError, match="on the host"):
        plan(LLAMA3_8B, HOSTS[8], Budget(6 * GIB, 12 * GIB), Workload(131072), Overrides(kv_dtype=KVDtype.BF16))


def test_kv_bytes_match_the_host_pool_layout():
    """The planner's bytes are the pool's real ones, at every block size: int4's per-block key
    scales and tail-slot table spread over the block, and the tail a sequence being filled holds."""
    from cpu_attention.pool import HostKVPool

    cfg = dataclasses.replace(LLAMA3_8B, num_layers=2)
    for dt in KVDtype:
        for bs in (7, 16, 32):
            pool = HostKVPool(2, 4, 8, bs, 128, dtype=dt)
            assert kv_bytes_per_token_layer(cfg, dt, bs) * 2 == pytest.approx(pool.bytes_per_token), (dt, bs)
            if dt is KVDtype.INT4:  # one sequence mid-block in both layers: one tail slot's bytes each
                pool.write(0, torch.arange(3), torch.randn(3, 8, 128), torch.randn(3, 8, 128))
                pool.write(1, torch.arange(3), torch.randn(3, 8, 128), torch.randn(3, 8, 128))
                used = pool.tails.k.shape[0] - int(pool.tails.n_free[0])
                assert used * pool.tails.k[0].nbytes * 2 == 2 * kv_bytes_per_seq_layer(cfg, dt, bs)
            else:
                assert kv_bytes_per_seq_layer(cfg, dt, bs) == 0


def test_weight_groups_cover_every_parameter():
    gs = weight_groups(LLAMA3_8B)
    assert [g.kind for g in gs[:4]] == [Kind.EMBED, Kind.ATTN, Kind.MLP, Kind.NORMS]
    assert gs[-1].kind is Kind.LM_HEAD
    assert WDtype.NF4.nbytes(64) == 32 + 4


def test_sizes():
    assert parse_size("8GiB") == 8 * GIB
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("24G") == 24 * GIB and parse_size("1.5GB") == 1_500_000_000 and parse_size("100") == 100
    with pytest.raises(UserError, match="8GiB"):
        parse_size("eight")
    assert format_size(8 * GIB) == "8.00 GiB" and format_size(1002 * 2**20) == "1002 MiB" and format_size(12) == "12 B"


def test_staging_holds_a_whole_layer_of_streamed_groups():
    """Streamed weights move a layer at a time into two device slots (offload/weights.py): the
    reservation is twice the largest layer's streamed groups together, not the largest group."""
    from planner.search import _PRIORITY, _fill

    groups = weight_groups(LLAMA3_70B)
    pl, staging = _fill(groups, WDtype.NF4, (Mode.STREAM, Mode.STREAM), 20 * GIB, _PRIORITY, True)
    per_layer: dict[int, int] = {}
    for x in pl:
        if x.mode is Mode.STREAM:
            per_layer[x.layer] = per_layer.get(x.layer, 0) + x.nbytes
    both = [i for i in per_layer if {Kind.ATTN, Kind.MLP} <= {x.kind for x in pl if x.layer == i and x.mode is Mode.STREAM}]
    assert both  # some layers stream attention and MLP together
    assert staging == 2 * max(per_layer.values())
    assert sum(x.nbytes for x in pl if x.on_gpu) + staging <= 20 * GIB


def test_cpu_plans_keep_bf16_kv_while_it_fits_and_say_why():
    """On the CPU the host tier's KV is bf16 unless it does not fit the host budget: then int8, then int4."""
    cfg = LLAMA3_8B
    hw = HardwareProfile.synthetic(None, host_gib=256)
    wl = Workload(32768, batch=1)
    roomy = plan(cfg, hw, Budget(0, 200 * 2**30), wl, Overrides(device=Device.CPU))
    assert roomy.kv.host_dtype is KVDtype.BF16 and roomy.kv.gpu_tokens == 0
    assert any(c.setting == "--kv-dtype" and "fits host memory" in c.reason for c in roomy.choices)
    weights = roomy.memory.host_weights
    bf16_kv = roomy.memory.host_kv
    tight = plan(cfg, hw, Budget(0, weights + bf16_kv * 3 // 4), wl, Overrides(device=Device.CPU))
    assert tight.kv.host_dtype is KVDtype.INT8


def test_a_run_on_the_host_tier_costs_what_the_profile_measured():
    """The host kernels read the KV once for a run, but its rows' arithmetic grows with them: a
    run of 8 costs the profile's measured multiple of one row (linear in between), not one read."""
    from planner.hardware import RUN_COST

    hw = HardwareProfile.synthetic(12, host_gib=256)
    assert hw.cpu_run_cost(KVDtype.INT8, hw.physical_cores, 8) == RUN_COST  # unmeasured
    rates = tuple(dataclasses.replace(r, run_cost=3.1) for r in hw.cpu_attention)
    hw = dataclasses.replace(hw, cpu_attention=rates)
    assert hw.cpu_run_cost(KVDtype.INT8, hw.physical_cores, 1) == 1.0
    assert hw.cpu_run_cost(KVDtype.INT8, hw.physical_cores, 8) == pytest.approx(3.1)
    assert hw.cpu_run_cost(KVDtype.INT8, hw.physical_cores, 4) == pytest.approx(1 + 3 * 2.1 / 7)
    p = plan(LLAMA3_8B, hw, Budget(6 * GIB, 200 * GIB), Workload(131072, prompt_tokens=130000, gen_tokens=256))
    assert p.kv.host_tokens > 100000
    kv = dataclasses.replace(p.kv, stream_tokens=0)  # (a step of runs streams nothing: one row alike here)
    step = lambda rows: decode_step(LLAMA3_8B, hw, p.placements, kv, rows, 130000, p.threads, 1,  # noqa: E731
                                    run_rows=rows).terms["cpu attention"]
    call = hw.cpu_attention_call_s * LLAMA3_8B.num_layers
    assert step(8) - call == pytest.approx(3.1 * (step(1) - call), rel=1e-6)


def test_a_host_tier_batch_costs_its_measured_time_a_sequence_beyond_the_bytes():
    """The profile times 32 short sequences against one long one of the same bytes; what a
    (sequence, kv head) costs beyond its bytes is added per sequence past the first, per sub-batch."""
    hw = HardwareProfile.synthetic(12, host_gib=256)
    p = plan(LLAMA3_8B, hw, Budget(6 * GIB, 200 * GIB), Workload(2048, batch=32))
    assert p.kv.host_tokens
    slow = dataclasses.replace(hw, cpu_attention=tuple(dataclasses.replace(r, item_s=2e-6) for r in hw.cpu_attention))
    terms = [decode_step(LLAMA3_8B, h, p.placements, p.kv, 32, 2000, p.threads, p.sub_batches).terms["cpu attention"]
             for h in (hw, slow)]
    subs = [32 // p.sub_batches + (i < 32 % p.sub_batches) for i in range(p.sub_batches)]
    extra = LLAMA3_8B.num_layers * sum(b - 1 for b in subs) * LLAMA3_8B.num_kv_heads * 2e-6
    assert terms[1] - terms[0] == pytest.approx(extra, rel=1e-6)


def test_a_run_of_rows_reads_the_kv_as_the_kernels_do():
    """A speculative step's run of k + 1 rows: the GPU reads the device tier once for every 16 / G
    rows (Llama-3-8B's G = 4: once for 4 rows, twice for 5), the CPU its tier once; the linears
    still see every row, so the run costs less than as many sequences and more than one row."""
    from planner.cost import kv_reads

    assert kv_reads(LLAMA3_8B, 1, 1) == (1, 1)
    assert kv_reads(LLAMA3_8B, 4, 4) == (1, 1)
    assert kv_reads(LLAMA3_8B, 5, 5) == (2, 1)
    assert kv_reads(LLAMA3_8B, 10, 5) == (4, 2)  # two sequences' runs
    assert kv_reads(LLAMA3_8B, 3, 1) == (3, 3)  # three sequences
    hw = HardwareProfile.synthetic(80, host_gib=256)
    p = plan(LLAMA3_8B, hw, Budget(6 * GIB, 200 * GIB), Workload(32768, prompt_tokens=32000, gen_tokens=256))
    assert p.kv.gpu_tokens and not p.kv.host_tokens
    step = lambda rows, run: decode_step(LLAMA3_8B, hw, p.placements, p.kv, rows, 32000, p.threads, 1,  # noqa: E731
                                         run_rows=run)
    one, run, apart = step(1, 1), step(5, 5), step(5, 1)
    assert run.nbytes["gpu attention"] == 2 * one.nbytes["gpu attention"]
    assert apart.nbytes["gpu attention"] == 5 * one.nbytes["gpu attention"]
    assert one.seconds < run.seconds < apart.seconds
