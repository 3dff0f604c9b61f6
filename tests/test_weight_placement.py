"""Weights the plan leaves on the host: streamed to the device a layer ahead, or computed by the CPU.

The model runs on the CPU stand-in for the GPU: "streaming" copies each layer's weights from
their host buffer into one of two staging slots, with the schedule the GPU uses, so a slot
overwritten too early gives wrong tokens here. Every placement must give the all-resident run's
greedy tokens, and logits within the stored format's tolerance.
"""
import dataclasses

import pytest
import torch

import hetero
from conftest import forced_plan, rel_err
from hetero.errors import UserError
from hetero.model import Dense
from offload.host_compute import HostFFN, HostLinear
from offload.placement import check_plan_supported
from offload.weights import TensorRef, WeightStreamer
from planner.plan import Device, Mode
from planner.tensors import Kind, WDtype

PROMPT = [3, 17, 42, 99, 5, 150, 7, 8, 64, 33, 2, 11, 90, 91, 92, 93, 94, 95, 1, 2]
PROMPTS = [PROMPT, PROMPT[::-1]]
OFF = (0, 1, 3)  # three streamed layers cycle through the two slots; layer 2 stays resident


def _run(folder, p, n=12):
    e = hetero.load(folder, device="cpu", plan=p, tokenizer=False, ctx_size=64)
    toks = [[] for _ in PROMPTS]
    for c in e.generate(PROMPTS, max_new_tokens=n, temperature=0.0):
        toks[c.index].append(c.token)
    return e, toks, e.logits(PROMPT)


@pytest.fixture(scope="module")
def folder(tiny):
    return tiny("llama_4l")[0]


@pytest.fixture(scope="module")
def resident(folder):
    e, toks, logits = _run(folder, forced_plan(folder))
    assert e.runner.weights is None and e.runner.host_compute is None
    return toks, logits


@pytest.mark.parametrize("sub_batches", [1, 2])
@pytest.mark.parametrize("mode", [Mode.STREAM, Mode.CPU])
@pytest.mark.parametrize("kind", [Kind.MLP, Kind.ATTN])
def test_groups_off_the_device_give_resident_tokens(folder, resident, kind, mode, sub_batches):
    p = forced_plan(folder, {(i, kind): mode for i in OFF}, sub_batches=sub_batches)
    e, toks, logits = _run(folder, p)
    assert toks == resident[0]
    assert rel_err(logits, resident[1]) <= 1e-6
    lw = e.model.layers
    if mode is Mode.STREAM:
        sv = e.runner.weights
        assert sv.order == list(OFF)
        # the layers' matrices are views of the slots: layer k-th streamed in slot k % 2
        lin = (lambda i: lw[i].gate_up) if kind is Kind.MLP else (lambda i: lw[i].qkv)
        for k, i in enumerate(OFF):
            slot = sv.slots[k % 2]
            assert slot.data_ptr() <= lin(i).weight.data_ptr() < slot.data_ptr() + slot.numel()
        assert not isinstance(lin(2), HostLinear) and lin(2).weight.data_ptr() != lin(0).weight.data_ptr()
        # three layers through two slots: each pass copies layers up again
        once = sum(b.numel() for b in sv.host.values())
        assert sv.bytes_up > 2 * once
    else:
        assert e.runner.host_compute.calls > 0
        if kind is Kind.MLP:
            assert all(isinstance(lw[i].ffn, HostFFN) and lw[i].gate_up is None for i in OFF) and lw[2].ffn is None
        else:
            assert all(isinstance(lw[i].qkv, HostLinear) and isinstance(lw[i].o, HostLinear) for i in OFF)
            assert isinstance(lw[2].qkv, Dense)


def test_mixed_placement_with_the_head_norms_and_streamed_kv(folder, resident):
    """Head streamed (the pass's last 'layer'), one layer's norms streamed, attention and MLP on the
    CPU elsewhere, the KV split over both tiers and partly streamed to the device."""
    force = {(-1, Kind.LM_HEAD): Mode.STREAM, (-1, Kind.FINAL_NORM): Mode.STREAM, (2, Kind.NORMS): Mode.STREAM,
             (2, Kind.MLP): Mode.STREAM, (1, Kind.ATTN): Mode.CPU, (3, Kind.MLP): Mode.CPU, (0, Kind.NORMS): Mode.CPU}
    e, toks, logits = _run(folder, forced_plan(folder, force, gpu_tokens=4, stream_tokens=8))
    assert toks == resident[0]
    assert rel_err(logits, resident[1]) <= 1e-6
    assert e.runner.weights.order == [2, 4]  # layer 2 and the head (key L = 4)
    assert e.runner.host_compute.calls > 0


def test_bf16_groups_off_the_device_give_resident_tokens(folder):
    want_toks, want = _run(folder, forced_plan(folder, weights=WDtype.BF16))[1:]
    force = {(0, Kind.MLP): Mode.STREAM, (1, Kind.MLP): Mode.CPU, (2, Kind.ATTN): Mode.STREAM, (3, Kind.ATTN): Mode.CPU}
    e, toks, logits = _run(folder, forced_plan(folder, force, weights=WDtype.BF16, sub_batches=2))
    assert toks == want_toks
    assert rel_err(logits, want) <= 1e-6


@pytest.mark.parametrize("kind", [Kind.MLP, Kind.ATTN])
def test_int8_cpu_groups_within_tolerance(folder, resident, kind):
    """A 4-bit plan keeps CPU-computed groups in int8 (the Numba GEMV of cpu_attention.linear): logits
    within int8's error of the float32 run, and decode runs through the same groups."""
    p = forced_plan(folder, {(i, kind): Mode.CPU for i in range(4)}, host_dtype=WDtype.INT8)
    e, toks, logits = _run(folder, p, n=4)
    assert 0 < rel_err(logits, resident[1]) <= 5e-2
    assert e.runner.host_compute.calls > 0


@pytest.mark.parametrize("mode", [Mode.STREAM, Mode.CPU])
def test_moe_experts_off_the_device(tiny, mode):
    folder = tiny("qwen3_moe")[0]
    want_toks, want = _run(folder, forced_plan(folder))[1:]
    force = {(0, Kind.EXPERTS): mode, (1, Kind.EXPERTS): mode, (0, Kind.ATTN): mode}
    e, toks, logits = _run(folder, forced_plan(folder, force, sub_batches=2))
    assert toks == want_toks
    assert rel_err(logits, want) <= 1e-6


def test_a_pass_cut_short_leaves_the_staging_usable(folder, resident):
    """An error between a layer's ready and release (Ctrl+C mid-prefill) must not wedge the slots."""
    e = hetero.load(folder, device="cpu", plan=forced_plan(folder, {(i, Kind.MLP): Mode.STREAM for i in OFF}),
                    tokenizer=False, ctx_size=64)
    model, post = e.runner.model, e.runner.model.post_attention

    def boom(i, x, attn):
        if i == 1:
            raise KeyboardInterrupt
        return post(i, x, attn)

    model.post_attention = boom
    with pytest.raises(KeyboardInterrupt):
        e.logits(PROMPT)
    del model.post_attention
    assert rel_err(e.logits(PROMPT), resident[1]) <= 1e-6


def _streamer(n_layers: int):
    class W:
        pass

    owners = [W() for _ in range(n_layers)]
    for i, w in enumerate(owners):
        w.t = torch.full((100 + i,), float(i))
    return WeightStreamer({i: [TensorRef(w, "t")] for i, w in enumerate(owners)}, torch.device("cpu")), owners


def test_streamer_schedule_two_live_layers_at_most():
    sv, w = _streamer(3)
    assert len(sv.slots) == 2 and w[0].t.data_ptr() == w[2].t.data_ptr()  # layers 0 and 2 share slot 0
    sv.reset()
    sv.ready(0)
    assert w[0].t[0] == 0
    sv.ready(1)  # two sub-batches: layer 1 starts before layer 0 is released
    assert w[1].t[0] == 1 and w[0].t[0] == 0  # layer 2 must not have replaced layer 0 yet
    with pytest.raises(RuntimeError, match="more than two"):
        sv.ready(2)
    sv.release(0)
    assert w[2].t[0] == 2 and w[2].t.shape == (102,)  # prefetched into the freed slot
    sv.release(1)
    sv.ready(2)
    sv.release(2)
    assert w[0].t[0] == 0  # the next pass's first layer is back, the second still in place
    assert w[1].t[0] == 1


def test_streamer_with_two_layers_copies_once():
    sv, w = _streamer(2)
    for _ in range(3):
        sv.reset()
        for i in range(2):
            sv.ready(i)
            sv.release(i)
    assert sv.bytes_up == sum(b.numel() for b in sv.host.values())
    assert w[0].t[0] == 0 and w[1].t[0] == 1


def test_unsupported_plans_say_what_to_change(folder):
    p = forced_plan(folder)
    bad = dataclasses.replace(p, placements=tuple(
        dataclasses.replace(x, device=Device.CPU) if (x.layer, x.kind) == (1, Kind.MLP) else x for x in p.placements))
    with pytest.raises(UserError, match="layers.1.mlp is resident but stored on cpu"):
        check_plan_supported(bad)
    int8 = forced_plan(folder, {(1, Kind.MLP): Mode.STREAM})
    int8 = dataclasses.replace(int8, placements=tuple(
        dataclasses.replace(x, dtype=WDtype.INT8) if x.mode is Mode.STREAM else x for x in int8.placements))
    with pytest.raises(UserError, match="int8 is computed by the CPU only"):
        check_plan_supported(int8)
    with pytest.raises(UserError, match="--device cpu"):
        check_plan_supported(dataclasses.replace(p, device=Device.CPU))
    with pytest.raises(UserError, match="--weight-mode"):
        hetero.load(folder, device="cpu", weight_mode="disk", tokenizer=False)


def test_n_cpu_moe_puts_the_first_layers_experts_on_the_cpu(tiny):
    """`--n-cpu-moe 1` (llama.cpp's knob): layer 0's experts computed by the CPU, everything else
    where the planner put it (here: all on the GPU); the same tokens and logits as all on the GPU."""
    folder = tiny("qwen3_moe")[0]
    want_toks, want = _run(folder, forced_plan(folder))[1:]
    p = forced_plan(folder, n_cpu_moe=1)
    where = {(x.layer, x.kind): x.mode for x in p.placements}
    assert where[0, Kind.EXPERTS] is Mode.CPU and where[1, Kind.EXPERTS] is Mode.RESIDENT
    assert where[0, Kind.ATTN] is Mode.RESIDENT
    assert any(c.setting == "--n-cpu-moe" for c in p.choices)
    e, toks, logits = _run(folder, p)
    assert toks == want_toks and rel_err(logits, want) <= 1e-6
    assert e.runner.host_compute is not None and e.runner.host_compute.calls > 0


def test_n_cpu_moe_needs_experts(folder):
    with pytest.raises(UserError, match="mixture-of-experts"):
        forced_plan(folder, n_cpu_moe=1)
    with pytest.raises(UserError, match="--plan"):
        hetero.load(folder, device="cpu", plan=forced_plan(folder), n_cpu_moe=1, tokenizer=False)


def test_cpu_plans_are_checked_like_gpu_plans(folder):
    """A CPU plan runs on the CPU only, and every group of it must be stored and computed there."""
    from hetero.checkpoint import open_checkpoint
    from planner import Budget, HardwareProfile, Overrides, Workload, plan

    cfg = open_checkpoint(folder).config
    p = plan(cfg, HardwareProfile.synthetic(None), Budget(0, 8 * 2**30), Workload(64), Overrides(device=Device.CPU))
    check_plan_supported(p, torch.device("cpu"))
    with pytest.raises(UserError, match="--device cpu"):
        check_plan_supported(p, torch.device("cuda"))
    moved = dataclasses.replace(p, placements=tuple(
        dataclasses.replace(x, device=Device.CUDA, mode=Mode.RESIDENT) if (x.layer, x.kind) == (0, Kind.MLP) else x
        for x in p.placements))
    with pytest.raises(UserError, match="layers.0.mlp"):
        check_plan_supported(moved, torch.device("cpu"))


def test_a_cpu_start_never_measures_the_machine(folder, tmp_path, monkeypatch):
    """Without a cached profile the CPU's plan comes from this host's memory and cores."""
    from planner import profile as profile_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(profile_mod, "measure", lambda quick=False: pytest.fail("measured at a CPU start"))
    e = hetero.load(folder, device="cpu", tokenizer=False, ctx_size=64)
    assert e.plan.device is Device.CPU and e.plan.kv.gpu_tokens == 0
