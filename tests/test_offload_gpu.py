"""The split runtime with real CUDA tiers: streams, pinned staging, the CPU worker thread."""
import dataclasses
import importlib.util

import pytest
import torch

import hetero
from hetero.speculative import NgramDrafter
from conftest import forced_plan, greedy_batch, rel_err
from cpu_attention.layout import KVDtype
from planner.plan import Mode
from planner.tensors import Kind, WDtype

pytestmark = pytest.mark.gpu
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
PROMPT = [3, 17, 42, 99, 5, 150, 7, 8, 64, 33, 2, 11, 90, 91, 92, 93, 94, 95, 1, 2]


_greedy = greedy_batch


@pytest.fixture(scope="module")
def folder(tiny):
    return tiny("llama")[0]


@pytest.fixture(scope="module")
def reference(folder):
    e = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False, block_size=4)
    return _greedy(e, [PROMPT, PROMPT[::-1]]), e.logits(PROMPT)


@pytest.mark.parametrize("gpu_tokens", [0, 5, 12, 1000])
@pytest.mark.parametrize("sub_batches", [1, 2])
def test_cuda_split_matches_cpu(folder, reference, gpu_tokens, sub_batches):
    e = hetero.load(folder, device="cuda", weights="f32", kv_dtype="f32", tokenizer=False, block_size=4,
                    gpu_kv_tokens=gpu_tokens, sub_batches=sub_batches)
    assert _greedy(e, [PROMPT, PROMPT[::-1]]) == reference[0]
    assert rel_err(e.logits(PROMPT), reference[1]) <= 1e-4


@pytest.mark.parametrize("kv", ["f32", "int8"])
@pytest.mark.parametrize("gpu_tokens", [0, 5])
def test_cuda_streamed_host_kv_matches_cpu(folder, reference, kv, gpu_tokens):
    """Batch 1 with the host tier's first blocks copied up on the streamer's stream and attended on
    the GPU (CUDA graphs for the layer segments): the CPU run's tokens."""
    e = hetero.load(folder, device="cuda", weights="f32", kv_dtype=kv, tokenizer=False, block_size=4,
                    gpu_kv_tokens=gpu_tokens, stream_tokens=12, parallel=1)
    want = reference[0][0] if kv == "f32" else _greedy(
        hetero.load(folder, device="cpu", weights="f32", kv_dtype=kv, tokenizer=False, block_size=4), [PROMPT])[0]
    assert _greedy(e, [PROMPT]) == [want]
    assert len(e.runner.streamer.blocks) == 3
    assert e.runner.streamer.bytes_up > 0


@pytest.mark.parametrize("kv,stream,gpu_tokens", [("f32", 0, 0), ("bf16", 12, 0), ("int8", 12, 5), ("int4", 8, 0)])
def test_driver_loop_matches_the_torch_loop(tiny, kv, stream, gpu_tokens):
    """One sub-batch's lean layer loop (offload/inline.py: driver launches and events, numpy views)
    against the general loop through torch, on the same captured graphs and buffers: the same
    tokens, the same bytes counted each way."""
    folder = tiny("llama_hd32")[0]  # int4 KV groups need head dim 32
    kw = dict(device="cuda", weights="f32", kv_dtype=kv, tokenizer=False, block_size=4, gpu_kv_tokens=gpu_tokens,
              stream_tokens=stream, parallel=1)
    lean, general = hetero.load(folder, **kw), hetero.load(folder, **kw)
    general.runner.lean_step = None  # the general loop (offload/steps.py's PipelinedStep)
    assert _greedy(lean, [PROMPT]) == _greedy(general, [PROMPT])
    assert lean.runner.lean_step.loops  # the lean loop ran
    a, b = lean.runner.metrics.total, general.runner.metrics.total
    assert (a.d2h_bytes, a.h2d_bytes) == (b.d2h_bytes, b.h2d_bytes) and a.d2h_bytes > 0


@pytest.mark.parametrize("kv,gpu_tokens", [("f32", 5), ("int8", 0), ("int8", 5), ("int4", 0), ("int4", 8)])
def test_driver_loop_of_two_sub_batches_matches_the_torch_loop(tiny, kv, gpu_tokens):
    """Two sub-batches skewed in the lean loop (the CPU attending for one while the device runs the
    other's segments) against the general loop's worker thread: the same tokens and bytes; the CPU
    run's tokens where the device tier holds exact KV or none (a quantized device tier's kernel
    rounds otherwise than the CPU's, which may turn a near tie of this random model)."""
    folder = tiny("llama_hd32")[0]
    prompts = [PROMPT * 2, PROMPT[:7], PROMPT[3:] * 3, PROMPT]
    kw = dict(weights="f32", kv_dtype=kv, tokenizer=False, block_size=4, parallel=4)
    want = _greedy(hetero.load(folder, device="cpu", **kw), prompts)
    lean, general = (hetero.load(folder, device="cuda", gpu_kv_tokens=gpu_tokens, sub_batches=2, **kw)
                     for _ in range(2))
    general.runner.lean_step = None
    got = _greedy(lean, prompts)
    assert got == _greedy(general, prompts)
    assert got == want or (kv != "f32" and gpu_tokens)
    assert len(lean.runner.lean_step.loops) >= 2  # both sub-batches' captured sets ran in the lean loop
    a, b = lean.runner.metrics.total, general.runner.metrics.total
    assert (a.d2h_bytes, a.h2d_bytes) == (b.d2h_bytes, b.h2d_bytes) and a.d2h_bytes > 0


@pytest.mark.parametrize("kv", ["int8", "int4"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_cuda_streamed_rotated_host_kv_matches_cpu(tiny, kv, block_size):
    """Host blocks stored rotated, streamed up and dequantized on the GPU, inside the captured
    graphs: int8 (keys and values left rotated, q rotated in, the output rotated back), int4
    (keys per channel and block, values left rotated, the output rotated back): the CPU run's
    tokens. Block 16 takes the Triton paged kernel, block 4 the torch one."""
    folder = tiny("llama_hd32")[0]
    prompt = PROMPT * 3
    kw = dict(weights="f32", kv_dtype=kv, tokenizer=False, block_size=block_size)
    want = _greedy(hetero.load(folder, device="cpu", **kw), [prompt])
    e = hetero.load(folder, device="cuda", gpu_kv_tokens=0, stream_tokens=2 * block_size, parallel=1, **kw)
    assert _greedy(e, [prompt]) == want
    assert len(e.runner.streamer.blocks) == 2
    assert e.runner.streamer.bytes_up > 0


@pytest.mark.parametrize("kv,block_size,gpu_tokens", [("f32", 4, 0), ("int8", 16, 8), ("int4", 16, 0)])
@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("sub_batches", [1, 2])
def test_cuda_streamed_host_kv_of_a_batch_matches_cpu(tiny, kv, block_size, gpu_tokens, lean, sub_batches):
    """Four sequences of different lengths in one sub-batch (or two, the second's rows from the
    staging's middle row), each row's first host blocks copied up (one kernel a layer reading the
    page-locked pool) and attended on the GPU inside the captured sets, in the lean loop and the
    general one: the CPU run's tokens."""
    folder = tiny("llama_hd32")[0]
    prompts = [PROMPT * 3, PROMPT[:7], PROMPT[3:] * 4, PROMPT * 2]
    kw = dict(weights="f32", kv_dtype=kv, tokenizer=False, block_size=block_size, parallel=4)
    want = _greedy(hetero.load(folder, device="cpu", **kw), prompts)
    e = hetero.load(folder, device="cuda", gpu_kv_tokens=gpu_tokens, stream_tokens=2 * block_size,
                    sub_batches=sub_batches, **kw)
    if not lean:
        e.runner.lean_step = None
    assert _greedy(e, prompts) == want
    assert e.runner.streamer.bytes_up > 0
    assert e.runner.streamer._drv is not None  # the pool is page-locked, and reached at its own addresses:
    assert e.runner.streamer._gather is not None  # one kernel a layer reads the pieces
    assert not lean or e.runner.lean_step.loops


def test_forced_swap_mid_generation_changes_no_token(folder, reference):
    e = hetero.load(folder, device="cuda", weights="f32", kv_dtype="f32", tokenizer=False, block_size=4,
                    gpu_kv_tokens=24, parallel=1)
    got = [[], []]
    for c in e.generate([PROMPT, PROMPT[::-1]], max_new_tokens=16, temperature=0.0):
        got[c.index].append(c.token)
        if len(got[0]) == 5 and len(got[1]) == 5:  # force a swap out and back in mid-generation
            seq = max(e.cache.seqs, key=lambda s: len(e.cache.seqs[s].gpu.blocks))
            assert e.cache.swap_out(seq, 2) > 0
            assert e.cache.swap_in(seq, 1) > 0
    assert got == reference[0]


def test_gpu_budget_is_a_hard_limit(folder):
    from offload.build import fence_gpu_memory

    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    budget = torch.cuda.memory_reserved() + 256 * 2**20  # the fence counts what the allocator reserves
    try:
        e = hetero.load(folder, device="cuda", weights="f32", kv_dtype="bf16", tokenizer=False, gpu_kv_tokens=64,
                        gpu_mem=budget)
        _greedy(e, [PROMPT])
        assert torch.cuda.max_memory_reserved() <= budget  # what the allocator took, cached blocks included
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(budget, dtype=torch.uint8, device="cuda")
    finally:
        fence_gpu_memory(torch.cuda.get_device_properties(0).total_memory, torch.device("cuda"))


@pytest.mark.parametrize("gpu_kv", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("host_kv", ["bf16", "int8", "int4"])
def test_planned_kv_formats_are_built_within_the_budget(tiny, gpu_kv, host_kv):
    """The device pool is built in the planned format, both tiers hold tokens, and the peak stays
    within --gpu-mem (the fence would raise past it)."""
    from offload.build import fence_gpu_memory

    folder = tiny("llama_hd32")[0]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    budget = torch.cuda.memory_reserved() + 192 * 2**20
    try:
        e = hetero.load(folder, device="cuda", weights="bf16", kv_dtype=host_kv, gpu_kv_dtype=gpu_kv, tokenizer=False,
                        gpu_kv_tokens=16, ctx_size=256, parallel=2, gpu_mem=budget)
        assert e.plan.kv.gpu_dtype is KVDtype(gpu_kv) and e.cache.gpu.kv_dtype is KVDtype(gpu_kv)
        assert e.cache.host.dtype is KVDtype(host_kv)
        seen = []
        for c in e.generate([PROMPT, PROMPT[::-1]], max_new_tokens=12, temperature=0.0):
            seen.append(e.cache.tier_tokens())
        assert max(g for g, _ in seen) > 0 and max(h for _, h in seen) > 0
        assert torch.cuda.max_memory_reserved() <= budget
    finally:
        fence_gpu_memory(torch.cuda.get_device_properties(0).total_memory, torch.device("cuda"))


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_cuda_quantized_device_tier_matches_the_stand_in(tiny, kv):
    """Decode through the whole-step graph over an int8 / int4 device tier (tails written in the
    graph, blocks sealed between steps; int8 attended by the Triton kernel, int4 at this head dim
    32 by the torch twin, `quant_shapes_ok`): the CPU stand-in's logits over 60 positions, both
    reading the same bytes."""
    from hetero.app.evaluate import teacher_forced_logits

    folder = tiny("llama_hd32")[0]
    kw = dict(weights="f32", kv_dtype=kv, gpu_kv_dtype=kv, tokenizer=False, block_size=16, gpu_kv_tokens=256,
              ctx_size=256, parallel=1)
    ids = (PROMPT * 3)[:60]
    want = teacher_forced_logits(hetero.load(folder, device="cpu", **kw), ids)
    e = hetero.load(folder, device="cuda", **kw)
    got = teacher_forced_logits(e, ids)
    assert e.runner.graph_step.decoder is not None
    assert rel_err(got.cpu(), want) < 1e-2


def test_load_follows_the_planner_and_saved_plans(folder, tmp_path):
    from planner.plan import Plan

    e = hetero.load(folder, tokenizer=False, weights="bf16", gpu_mem="2GiB", ctx_size=256)
    assert e.plan is not None and e.plan.budget.gpu_bytes == 2 * 2**30
    tokens = [c.token for c in e.generate(PROMPT, max_new_tokens=8, temperature=0.0)]
    saved = tmp_path / "plan.json"
    saved.write_text(e.plan.to_json())
    e2 = hetero.load(folder, tokenizer=False, plan=saved, ctx_size=256)
    assert e2.plan == Plan.from_json(saved.read_text())
    assert [c.token for c in e2.generate(PROMPT, max_new_tokens=8, temperature=0.0)] == tokens


# ------------------------------------------------------------------ weights the plan leaves on the host
LONG = [(7 * i + 3) % 160 for i in range(480)]  # reaches the context (512) after 32 new tokens


def test_cuda_swap_in_when_room_frees(folder):
    """Three sequences share a device tier sized for two; when the long one finishes, the next
    decode step copies the swapped-out blocks back up (copy stream, pinned staging) by itself."""
    prompts = [PROMPT, PROMPT[::-1], LONG]
    cpu = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False, block_size=4)
    want = _greedy(cpu, prompts, n=40)
    e = hetero.load(folder, device="cuda", weights="f32", kv_dtype="f32", tokenizer=False, block_size=4,
                    gpu_kv_tokens=24, parallel=2)
    assert _greedy(e, prompts, n=40) == want
    assert e.cache.swapped_out_blocks > 0 and e.cache.swapped_in_blocks > 0
    assert e.metrics.swapped_in_blocks == e.cache.swapped_in_blocks


@pytest.fixture(scope="module")
def folder4(tiny):
    return tiny("llama_4l")[0]


@pytest.fixture(scope="module")
def reference4(folder4):
    e = hetero.load(folder4, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False, block_size=4)
    return _greedy(e, [PROMPT, PROMPT[::-1]]), e.logits(PROMPT)


@pytest.mark.parametrize("sub_batches", [1, 2])
@pytest.mark.parametrize("mode", [Mode.STREAM, Mode.CPU])
@pytest.mark.parametrize("kind", [Kind.MLP, Kind.ATTN])
def test_cuda_weights_off_the_gpu_match_cpu(folder4, reference4, kind, mode, sub_batches):
    """f32 weights: layers 0, 1, 3 of `kind` streamed (three layers through two device slots, copied on
    the weight streamer's stream a layer ahead, read by the captured layer graphs) or computed on
    the CPU (eager, activations over pinned buffers): the all-CPU float32 run's tokens and logits."""
    from offload.host_compute import HostLinear

    p = forced_plan(folder4, {(i, kind): mode for i in (0, 1, 3)}, sub_batches=sub_batches)
    e = hetero.load(folder4, device="cuda", plan=p, tokenizer=False, ctx_size=64)
    assert _greedy(e, [PROMPT, PROMPT[::-1]]) == reference4[0]
    assert rel_err(e.logits(PROMPT), reference4[1]) <= 1e-4
    r = e.runner
    if mode is Mode.STREAM:
        assert r.weights.order == [0, 1, 3] and r.weights.bytes_up > 0
        assert all(b.is_pinned() for b in r.weights.host.values())
        assert all(s.is_cuda for s in r.weights.slots)
        assert r.segments is not None and r.segments._sets  # the layer graphs ran over the slots
        assert r.graph_step is None  # the whole-step graph cannot wait for copies inside itself
    else:
        assert r.host_compute.calls > 0 and r.host_compute.bytes_down > 0
        assert r.segments is None  # eager: the CPU's share is waited for mid-layer
        lin = e.model.layers[0].qkv if kind is Kind.ATTN else e.model.layers[0].ffn.host.gate_up
        inner = lin.inner if isinstance(lin, HostLinear) else lin
        assert inner.weight.device.type == "cpu"


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
@pytest.mark.parametrize("kind", [Kind.MLP, Kind.ATTN])
@pytest.mark.parametrize("weights", [WDtype.NF4, WDtype.Q4])
def test_cuda_nf4_streamed_matches_resident_and_int8_cpu_is_close(folder4, reference4, kind, weights, tmp_path,
                                                                   monkeypatch):
    """4-bit plans (NF4, and the linear q4): streamed 4-bit groups are the resident ones' bytes (same
    tokens, logits); CPU groups are int8 (cpu_linear's GEMV) and stay within int8's error of the
    float32 run more than the 4-bit format does."""
    from planner.tensors import cpu_dtype

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    resident = hetero.load(folder4, device="cuda", plan=forced_plan(folder4, weights=weights, kv="bf16"),
                           tokenizer=False, ctx_size=64)
    want, want_logits = _greedy(resident, [PROMPT, PROMPT[::-1]]), resident.logits(PROMPT)
    p = forced_plan(folder4, {(i, kind): Mode.STREAM for i in range(4)}, weights=weights, kv="bf16")
    e = hetero.load(folder4, device="cuda", plan=p, tokenizer=False, ctx_size=64)
    assert _greedy(e, [PROMPT, PROMPT[::-1]]) == want
    assert rel_err(e.logits(PROMPT), want_logits) <= 1e-3
    p = forced_plan(folder4, {(i, kind): Mode.CPU for i in range(4)}, weights=weights, kv="bf16",
                    host_dtype=cpu_dtype(weights))
    e = hetero.load(folder4, device="cuda", plan=p, tokenizer=False, ctx_size=64)
    _greedy(e, [PROMPT], n=4)
    got = e.logits(PROMPT)
    assert rel_err(got, reference4[1]) < rel_err(want_logits, reference4[1])  # int8 groups err less than nf4


def _weight_bytes_on_gpu(model) -> int:
    """Bytes of the distinct CUDA storages the model's weights live in (staging slots counted once)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.is_cuda:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()

    def linear(lin):
        for name in ("weight", "bias", "packed", "absmax"):
            add(getattr(lin, name, None))

    for lw in model.layers:
        for t in (lw.attn_norm, lw.mlp_norm, lw.q_norm, lw.k_norm, lw.router):
            add(t)
        for lin in (lw.qkv, lw.o, lw.gate_up, lw.down):
            if lin is not None:
                linear(lin)
    linear(model.lm_head)
    add(model.norm)
    add(model.embed_w)
    return total


def test_cuda_streamed_weights_keep_the_budget(tiny):
    """A budget the planner can meet only by streaming (--weight-mode stream): the run stays under it
    (the fence would raise otherwise), gives the all-resident run's tokens, and the GPU holds two
    staging slots instead of the streamed layers."""
    import gc

    from offload.build import fence_gpu_memory
    from planner import Budget, Overrides, Workload, load_or_measure, plan
    from planner.workspace import workspace_bytes
    from hetero.checkpoint import open_checkpoint
    from hetero.errors import UserError

    folder = tiny("llama_wide")[0]
    cfg = open_checkpoint(folder).config
    hw, wl = load_or_measure(), Workload(256, batch=1, prompt_tokens=128, gen_tokens=64)
    # the KV on the host in both runs (same attention arithmetic, so the same tokens)
    ov = Overrides(weights=WDtype.BF16, weight_mode=Mode.STREAM, kv_dtype=KVDtype.BF16, block_size=16,
                   gpu_kv_tokens=0, stream_tokens=0)
    full = plan(cfg, hw, Budget(4 * 2**30, 8 * 2**30), wl, ov)
    resident = hetero.load(folder, device="cuda", plan=full, tokenizer=False, ctx_size=256)
    want = _greedy(resident, [PROMPT], n=16)
    all_weights = _weight_bytes_on_gpu(resident.model)
    del resident
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    tight = None
    for mib in range(0, 1000, 4):  # about the smallest budget that fits: the most streaming
        try:
            tight = plan(cfg, hw, Budget(workspace_bytes(cfg, wl) + (mib + 16) * 2**20, 8 * 2**30), wl, ov)
            break
        except UserError:
            continue
    streamed = [x for x in tight.placements if x.mode is Mode.STREAM]
    assert len({x.layer for x in streamed}) >= 3, streamed
    budget = base + tight.budget.gpu_bytes  # what this process held before counts against the fence
    tight = dataclasses.replace(tight, budget=Budget(budget, tight.budget.host_bytes))
    torch.cuda.reset_peak_memory_stats()
    try:
        e = hetero.load(folder, device="cuda", plan=tight, tokenizer=False, ctx_size=256)
        assert _greedy(e, [PROMPT], n=16) == want
        assert torch.cuda.max_memory_allocated() <= budget
        assert torch.cuda.max_memory_reserved() <= budget
        sv = e.runner.weights
        on_gpu = _weight_bytes_on_gpu(e.model)
        host = sum(b.numel() for b in sv.host.values())
        assert on_gpu <= all_weights - host + sv.nbytes + 64 * 2**10  # streamed layers: only their slots
        assert sv.nbytes <= 2 * max(b.numel() for b in sv.host.values())
    finally:
        fence_gpu_memory(torch.cuda.get_device_properties(0).total_memory, torch.device("cuda"))


@pytest.mark.parametrize("kv,block_size", [("int4", 16), ("int4", 32), ("int8", 16), ("int8", 32), ("bf16", 16)])
def test_planned_staging_covers_the_streamers_peak(kv, block_size):
    """What the planner sets aside for streamed host KV (`stream_staging_bytes`) covers what the
    streamer takes on the device: its two slots in the host's format, read as they are by the
    paged attention (no dequantized copy)."""
    from cpu_attention import HostKVPool
    from hetero.config import LLAMA3_8B
    from offload.stream import KVStreamer
    from planner.kv_tiers import stream_staging_bytes

    cfg, dt, dev = LLAMA3_8B, KVDtype(kv), torch.device("cuda")
    tokens = 2048 // block_size * block_size
    host = HostKVPool(2, tokens // block_size + 1, cfg.num_kv_heads, block_size, cfg.head_dim, dt)
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    s = KVStreamer(host, tokens, dev)
    s.begin([list(range(tokens // block_size))])
    for layer in (0, 1):
        s.prefetch(layer)
        s.attend(layer, q, cfg.head_dim ** -0.5)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    planned = stream_staging_bytes(cfg, dt, tokens, block_size)
    assert peak <= planned + 4 * 2**20, (peak, planned)  # + q, the outputs and the rotation's tensors
    assert planned <= 1.5 * peak + 4 * 2**20, (peak, planned)  # and does not set aside far more


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_streamer_graphs_gather_scattered_blocks(kv):
    """The streamer's gather, captured as a graph a layer over a table of fixed width, brings a
    row's blocks up wherever they lie in the pinned pool: one run of blocks, then three runs (more
    pieces than the table had columns: captured again, wider), and the device attends over them
    as the float64 twin does over the host's blocks."""
    import math

    from cpu_attention import HostKVPool, decode_attention_ref
    from offload import pinned
    from offload.stream import KVStreamer

    gen = torch.Generator().manual_seed(8)
    L, H, BS, D = 2, 2, 16, 64  # shapes the quantized paged kernels take
    host = HostKVPool(L, 8, H, BS, D, KVDtype(kv), allocate=pinned.zeros)
    n = 7 * BS  # blocks 0..6, complete
    slots = torch.arange(n)
    for layer in range(L):
        k = torch.randn(n, H, D, generator=gen) + 3 * torch.randn(D, generator=gen)  # channel offsets
        host.write(layer, slots, k, torch.randn(n, H, D, generator=gen))
    sv = KVStreamer(host, 4 * BS, torch.device("cuda"))
    q = torch.randn(1, 3 * H, D, generator=gen).bfloat16().float()  # the activations' dtype, as a step's q
    widths = []
    for blocks in ([0, 1, 2], [5, 1, 3, 4]):
        sv.begin([blocks])
        widths.append(sv._table[1].shape[1])
        for layer in range(L):
            sv.prefetch(layer)
            o, lse = sv.attend(layer, q.cuda().bfloat16(), 1 / math.sqrt(D))
            ro, rl = decode_attention_ref(host, layer, q, torch.tensor([blocks], dtype=torch.int32),
                                          torch.tensor([len(blocks) * BS]), 1 / math.sqrt(D))
            assert rel_err(o.cpu(), ro) < 1e-2 and (lse.cpu() - rl).abs().max() < 5e-2
    assert len(sv._launch) == L and widths[1] > widths[0]  # graphs, captured again for the wider table


REPEATS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8], PROMPT]


@pytest.mark.parametrize("kv,gpu_kv,gpu_tokens,sub_batches,bs", [
    ("f32", None, 1000, None, 4),  # every token on the device: the whole-step graph
    ("f32", None, 0, 1, 4),  # the host tier: the lean loop
    ("f32", None, 6, 2, 4),  # both tiers, two sub-batches
    ("int8", None, 0, None, 4),
    ("int4", "int4", 16, 1, 16),  # quantized blocks: drafts stop short of completing one (larger blocks: more room)
    ("bf16", "int8", 1000, None, 16),  # a quantized device tier in the whole-step graph
])
def test_cuda_drafting_changes_no_token(tiny, kv, gpu_kv, gpu_tokens, sub_batches, bs):
    """Prompt-lookup drafts verified as runs of rows in every decode strategy: plain decoding's tokens."""
    kw = dict(device="cuda", weights="f32", kv_dtype=kv, tokenizer=False, block_size=bs, gpu_kv_tokens=gpu_tokens,
              sub_batches=sub_batches, parallel=2, **({"gpu_kv_dtype": gpu_kv} if gpu_kv else {}))
    folder = tiny("llama_hd32")[0]  # head dim 32: int4's groups
    plain, spec = hetero.load(folder, **kw), hetero.load(folder, draft="ngram", **kw)
    spec.drafter = NgramDrafter(min_ngram=1)  # 1-token matches too: more drafts to verify
    spec.drafter.length = 4  # fixed: what is drafted does not depend on timings
    assert _greedy(spec, REPEATS, n=24) == _greedy(plain, REPEATS, n=24)
    assert spec.last_stats.accepted > 0


def test_cuda_draft_model_shares_the_budget_and_changes_no_token(tiny, tmp_path):
    """--draft-model on the GPU: both engines on CUDA, the model's plan made with what the draft's
    plan leaves, the allocator within --gpu-mem for both, plain decoding's tokens."""
    from conftest import make_tiny
    from offload.build import fence_gpu_memory

    folder = tiny("llama_hd32")[0]
    make_tiny(tmp_path / "draft", "llama_hd32", seed=1)  # the same shapes and vocabulary, other weights
    kw = dict(device="cuda", weights="f32", tokenizer=False, parallel=2)
    plain = hetero.load(folder, **kw)
    want = _greedy(plain, REPEATS, n=20)
    del plain
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    budget = torch.cuda.memory_reserved() + 512 * 2**20  # the fence counts what the allocator reserves
    try:
        spec = hetero.load(folder, draft_model=tmp_path / "draft", gpu_mem=budget, **kw)
        small = spec.drafter.e
        assert small.runner.model.device.type == "cuda" and spec.runner.model.device.type == "cuda"
        assert spec.plan.budget.gpu_bytes == budget - small.plan.memory.gpu_used
        spec.drafter.length = 3
        assert _greedy(spec, REPEATS, n=20) == want
        assert spec.last_stats.drafted > 0
        assert torch.cuda.max_memory_reserved() <= budget
    finally:
        fence_gpu_memory(torch.cuda.get_device_properties(0).total_memory, torch.device("cuda"))
