"""Mixture-of-experts layers with their experts split between the device and the host.

The model runs on the CPU stand-in for the GPU: the device's experts are its own linears (the
grouped CUDA kernels are gpu-marked tests), the host's are computed as they are on a GPU host (the
Numba int4 kernel, or the torch math for float plans). Any split must give the tokens of all
experts in one place; the int4 kernel must match its float64 twin.
"""
import ctypes
import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hetero
from hetero.checkpoint import open_checkpoint
from conftest import forced_plan, rel_err
from cpu_attention.layout import KVDtype
from cpu_attention.experts import HostExperts, Scratch, dequantize_int4, experts_ref, quantize_int4
from offload.moe import MoEFeedForward, TorchHostExperts
from planner import Budget, HardwareProfile, Workload, plan
from planner.plan import Device, Mode, Placement, Plan
from planner.report import render
from planner.tensors import Kind, WDtype, expert_bytes, weight_groups
from test_planner import QWEN3_30B_A3B

PROMPTS = [[3, 17, 42, 99, 5, 150, 7, 8, 64, 33, 2, 11], [5, 9, 120, 4, 4, 77, 31]]


def split_plan(p: Plan, E: int, on_gpu, host_dtype: WDtype) -> Plan:
    """p with each MoE layer's E experts split: on_gpu(layer, E) → the experts the device keeps (with
    the router), the rest host-computed in host_dtype."""
    out = []
    for x in p.placements:
        if x.kind is not Kind.EXPERTS:
            out.append(x)
            continue
        dev = tuple(sorted(on_gpu(x.layer, E)))
        host = tuple(e for e in range(E) if e not in dev)
        out.append(dataclasses.replace(x, experts=dev))
        out.append(Placement(x.layer, Kind.EXPERTS, Device.CPU, host_dtype, Mode.CPU, 0, host))
    return dataclasses.replace(p, placements=tuple(out))


def _run(folder, p, n=10):
    e = hetero.load(folder, device="cpu", plan=p, tokenizer=False, ctx_size=64)
    toks = [[] for _ in PROMPTS]
    for c in e.generate(PROMPTS, max_new_tokens=n, temperature=0.0):
        toks[c.index].append(c.token)
    return e, toks, e.logits(PROMPTS[0])


@pytest.fixture(scope="module", params=["qwen3_moe_64", "mixtral_64"])
def moe(request, tiny):
    folder, ref = tiny(request.param)
    p = forced_plan(folder)
    E = open_checkpoint(folder).config.num_experts
    e, toks, logits = _run(folder, p)
    return folder, p, E, toks, logits, ref


SPLITS = {
    "half": lambda layer, E: range(E // 2),
    "none on the device": lambda layer, E: (),
    "alternate, by layer": lambda layer, E: range(layer % 2, E, 2),
    "all but one": lambda layer, E: range(1, E),
}


@pytest.mark.parametrize("sub_batches", [1, 2])
@pytest.mark.parametrize("split", list(SPLITS))
def test_any_split_gives_the_tokens_of_all_experts_in_one_place(moe, split, sub_batches):
    folder, p, E, want_toks, want, _ = moe
    sp = split_plan(dataclasses.replace(p, sub_batches=sub_batches), E, SPLITS[split], WDtype.F32)
    e, toks, logits = _run(folder, sp)
    assert toks == want_toks
    assert rel_err(logits, want) <= 1e-5
    ffn = [lw.ffn for lw in e.model.layers]
    assert all(isinstance(f, MoEFeedForward) and isinstance(f.host, TorchHostExperts) for f in ffn)
    assert e.runner.host_compute is None  # the host's experts are not a stalling host group


def test_int4_host_experts_stay_near_transformers(moe):
    """The host's experts in the CPU's int4 format (the Numba kernel): logits within 4-bit error of
    transformers' float32 model, closer than the whole model in the device's 4-bit format (NF4) gets
    (tiny random models: their 4-bit errors are large)."""
    folder, p, E, _, _, ref = moe
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPTS[0]])).logits[0].float()
    sp = split_plan(p, E, SPLITS["half"], WDtype.INT4)
    e, _, logits = _run(folder, sp, n=4)
    assert all(isinstance(lw.ffn.host, HostExperts) for lw in e.model.layers)
    assert e.runner.metrics.total.cpu_experts > 0  # the engine's timers count the CPU's experts
    err = rel_err(logits, theirs)
    nf4 = _run(folder, forced_plan(folder, weights=WDtype.NF4), n=1)[2]
    assert 1e-4 < err < min(0.3, rel_err(nf4, theirs))


def test_streamed_host_experts_give_the_kernels_logits(moe):
    """Many rows (a prefill chunk) take the host's int4 experts up to the device instead of computing
    them on the CPU: the same arithmetic, so the same logits as the CPU kernel's."""
    folder, p, E, _, _, _ = moe
    sp = split_plan(p, E, SPLITS["alternate, by layer"], WDtype.INT4)
    want = hetero.load(folder, device="cpu", plan=sp, tokenizer=False, ctx_size=64).logits(PROMPTS[0])
    e = hetero.load(folder, device="cpu", plan=dataclasses.replace(sp, moe_upload_rows=1), tokenizer=False,
                    ctx_size=64)  # the plan's rows from which they go up: every step's
    assert all(lw.ffn.stream_rows == 1 and lw.ffn.graph_rows == 0 for lw in e.model.layers)
    assert rel_err(e.logits(PROMPTS[0]), want) <= 1e-5


@pytest.mark.parametrize("N", [1, 3, 9])
@pytest.mark.parametrize("H, F", [(128, 192), (256, 128)])  # float32 dot products; int8 x and vector integer code
def test_int4_kernel_matches_its_float64_twin(N, H, F):
    from cpu_attention.experts_kernels import vnni_shapes

    torch.manual_seed(N)
    E, k = 5, 3
    he = HostExperts(list(range(E)), H, F, k, threads=2)
    for j in range(E):
        he.set(j, torch.randn(2 * F, H) * 0.05, torch.randn(H, F) * 0.05)
    x = torch.randn(N, H)
    ids = torch.randint(-1, E, (N, k), dtype=torch.int32)
    ids[0] = torch.tensor([2, 2, -1])  # a repeated expert, a slot another device computes
    w = torch.rand(N, k)
    out = np.full((N, H), np.nan, np.float32)
    sc = Scratch(16, k, H, F, E)
    he(x.numpy(), ids.numpy(), w.numpy(), out, sc)
    quantized = vnni_shapes(H, F)
    assert quantized == (H == 256) or F % 128  # (a CPU without 8-lane integer vectors takes the float path)
    ref = experts_ref(x.double(), ids, w, *he.tensors(), quantized=quantized)
    assert rel_err(torch.from_numpy(out), ref) <= 1e-5
    if quantized:  # int8 activations: what they cost against the float path
        assert rel_err(torch.from_numpy(out), experts_ref(x.double(), ids, w, *he.tensors())) <= 3e-2
    # the same call through the C entry point a CUDA host node calls, without Python
    from cpu_attention import experts_kernels

    out2 = np.full((N, H), np.nan, np.float32)
    d = he.descriptor(x.numpy(), ids.numpy(), w.numpy(), out2, sc)
    sc.take_seconds()
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(experts_kernels.entry_address())(d.ctypes.data)
    assert np.array_equal(out, out2)
    assert sc.cycles[0] > 0 and 0 < sc.take_seconds() < 10 and sc.cycles[0] == 0  # its own clock, read once
    assert sc.take_pairs() == 2 * int((ids >= 0).sum()) and sc.take_pairs() == 0  # the Python call's and the C one's


@pytest.mark.parametrize("H, F", [(128, 192), (256, 128)])
def test_experts_pool_gives_the_kernels_result_call_after_call(H, F):
    """The C entry point on a pool of spinning threads (a CUDA host node's call): the OpenMP kernel's
    result to the bit, for changing rows and routes in the same buffers, none routed to the host
    included, and the workers gone once closed."""
    from cpu_attention.experts_pool import ExpertsPool

    torch.manual_seed(H)
    E, k, N = 6, 3, 9
    he = HostExperts(list(range(E)), H, F, k, threads=2)
    for j in range(E):
        he.set(j, torch.randn(2 * F, H) * 0.05, torch.randn(H, F) * 0.05)
    x, ids, w = np.zeros((N, H), np.float32), np.zeros((N, k), np.int32), np.zeros((N, k), np.float32)
    out, want = np.zeros((N, H), np.float32), np.zeros((N, H), np.float32)
    sc, pooled = Scratch(N, k, H, F, E), Scratch(N, k, H, F, E)
    pool = ExpertsPool(3)
    pooled.pool = pool
    call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ExpertsPool.entry_address())
    try:
        for n in range(30):
            x[:] = np.random.default_rng(n).standard_normal((N, H))
            ids[:] = torch.randint(-1, E, (N, k), dtype=torch.int32).numpy() if n % 10 else -1
            w[:] = np.random.default_rng(n).random((N, k))
            out.fill(np.nan)
            call(he.descriptor(x, ids, w, out, pooled).ctypes.data)
            he(x, ids, w, want, sc)
            assert np.array_equal(out, want), n
            assert pooled.take_pairs() == sc.take_pairs() == int((ids >= 0).sum()), n
            assert n % 10 or not out.any()
        assert pooled.take_seconds() > 0
        st = pool.stats()  # the pool's counters: calls, the workers that joined them, the caller's clocks
        assert st["calls"] == 30 and 0 <= st["joins"] <= st["calls"] * (pool.threads - 1)
        assert st["pass1"] > 0 and st["barriers"] >= 0 and st["finish"] >= 0
        time.sleep(0.1)  # past the workers' spinning and yielding: they nap
        cpu = time.process_time()
        time.sleep(0.3)
        assert time.process_time() - cpu < 0.05  # an idle pool holds no core (two spinning: ~0.6 s)
    finally:
        pool.close()
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("hetero-experts"))


def test_experts_pool_runs_calls_signalled_in_memory():
    """The flags' thread (as a GPU stream drives it: go[i] set, wait for done[i], clear it): each
    registered call runs when signalled, a call of no descriptor is a bare round trip, and the
    results are the OpenMP kernel's."""
    from cpu_attention.experts_pool import ExpertsPool

    torch.manual_seed(3)
    E, k, N, H, F = 4, 2, 3, 128, 64
    he = HostExperts(list(range(E)), H, F, k, threads=2)
    for j in range(E):
        he.set(j, torch.randn(2 * F, H) * 0.05, torch.randn(H, F) * 0.05)
    pool = ExpertsPool(3)
    go, done, table = np.zeros(8, np.int64), np.zeros(8, np.int64), np.zeros(8, np.int64)
    sc, pooled = Scratch(N, k, H, F, E), Scratch(N, k, H, F, E)
    pooled.pool = pool
    try:
        pool.serve_flags(go, done, table)
        bare = pool.register(0)
        bufs = [(np.random.default_rng(n).standard_normal((N, H)).astype(np.float32),
                 np.random.default_rng(n).integers(-1, E, (N, k)).astype(np.int32),
                 np.random.default_rng(n).random((N, k)).astype(np.float32), np.zeros((N, H), np.float32))
                for n in range(2)]
        calls = [pool.register(he.descriptor(*b, pooled).ctypes.data) for b in bufs]
        for rep in range(20):
            for i in [bare, *calls]:
                go[i] = 1
                end = time.monotonic() + 10
                while done[i] == 0:
                    assert time.monotonic() < end, f"call {i} never done"
                assert go[i] == 0
                done[i] = 0
        for x, ids, w, out in bufs:
            want = np.zeros_like(out)
            he(x, ids, w, want, sc)
            assert np.array_equal(out, want)
    finally:
        pool.close()
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("hetero-experts"))


def test_int4_linear_by_pieces_of_rows():
    from offload.moe import _linear_int4

    codes, scale = quantize_int4(torch.randn(96, 128))
    x = torch.randn(5, 128)
    want = x @ dequantize_int4(codes, scale).T
    assert torch.allclose(_linear_int4(x, codes, scale, piece=2 * 64 * 10), want, atol=1e-5)  # 10 rows a piece


def test_int4_format_round_trip():
    w = torch.randn(48, 256)
    codes, scale = quantize_int4(w)
    assert codes.shape == (48, 128) and codes.dtype == torch.uint8 and scale.shape == (48, 4)
    err = (dequantize_int4(codes, scale) - w).abs()
    assert (err <= scale.repeat_interleave(64, 1) / 2 + 1e-6).all()  # half a step at most
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_int4(torch.randn(4, 96))


# ------------------------------------------------------------------------------------- planner
H100 = HardwareProfile.synthetic(80, pcie_gbps=55, dram_gbps=73, host_gib=128, cores=16, hbm_gbps=2900)


def test_plan_spreads_experts_over_the_layers_within_the_budget():
    p = plan(QWEN3_30B_A3B, H100, Budget(8 * 2**30, 100 * 2**30), Workload(4096))
    m = p.memory
    assert m.gpu_used <= m.gpu_budget
    eb = expert_bytes(next(g for g in weight_groups(QWEN3_30B_A3B) if g.kind is Kind.EXPERTS), WDtype.NF4)
    counts = []
    for layer in range(48):
        parts = p.expert_placements(layer)
        dev, host = (next(x for x in parts if x.on_gpu == on) for on in (True, False))
        assert dev.mode is Mode.RESIDENT and dev.dtype is WDtype.NF4
        assert host.mode is Mode.CPU and host.dtype is WDtype.INT4
        assert sorted(dev.experts + host.experts) == list(range(128))
        counts.append(len(dev.experts))
    assert 0 < min(counts) and max(counts) - min(counts) <= 1 and max(counts) < 128
    # the room left could not hold another expert a layer
    assert m.gpu_budget - m.gpu_used < 48 * eb + eb
    assert p.prediction.decode_tok_s > 0 and "CPU experts" in "".join(c.reason for c in p.choices) + p.prediction.bottleneck
    # all of it on the GPU where it fits, and more room never predicts slower
    big = plan(QWEN3_30B_A3B, H100, Budget(24 * 2**30, 100 * 2**30), Workload(4096))
    assert all(x.experts is None and x.on_gpu for x in big.placements if x.kind is Kind.EXPERTS)
    assert big.prediction.decode_tok_s > p.prediction.decode_tok_s
    assert Plan.from_json(p.to_json()) == p


def test_plan_report_says_how_many_experts_sit_where():
    from rich.console import Console

    p = plan(QWEN3_30B_A3B, H100, Budget(8 * 2**30, 100 * 2**30), Workload(4096))
    con = Console(record=True, width=160)
    render(p, con)
    text = con.export_text()
    n = len(p.expert_placements(47)[0].experts)
    assert f"experts {n}/128 + router" in text and f"experts {128 - n}/128" in text
    counts = {len(next(x for x in p.expert_placements(layer) if x.on_gpu).experts) for layer in range(48)}
    assert max(counts) - min(counts) == 1 and 40 <= min(counts) <= 70  # spread evenly, a part of them
    assert f"offloaded 48/48 layers ({min(counts)}–{max(counts)} of their 128 experts each) to GPU" in text


def test_host_experts_cost_follows_the_tokens_routed_to_them():
    """The host's kernel decodes an expert once a token routed to it (its bound), so 8 tokens cost 8
    tokens' pairs, not the ~5× as many experts they touch: measured on the GPU host, batch 8 at 8 GiB
    took 119.8 ms of CPU experts a step where the touched experts predicted 77.6 (bench/RESULTS.md)."""
    from planner.cost import HOST_EXPERTS_CALL_S, decode_step

    p = plan(QWEN3_30B_A3B, H100, Budget(8 * 2**30, 100 * 2**30), Workload(4096, batch=8))
    host = sum(1 for x in p.placements if x.kind is Kind.EXPERTS and not x.on_gpu)
    one, eight = (decode_step(QWEN3_30B_A3B, H100, p.placements, p.kv, b, 2048, p.threads, 1).terms["cpu experts"]
                  - host * HOST_EXPERTS_CALL_S for b in (1, 8))
    assert eight == pytest.approx(8 * one, rel=1e-6)


def test_host_experts_go_up_from_the_rows_the_cost_model_chooses():
    """A step's host experts are computed by the CPU (a decode of an expert a token routed to it)
    or copied up once (PCIe): the plan takes the copy from the first row count at which the cost
    model prices it lower, says so, and prices larger steps that way."""
    from planner.cost import decode_step, host_experts_seconds

    p = plan(QWEN3_30B_A3B, H100, Budget(8 * 2**30, 100 * 2**30), Workload(4096))
    n = p.moe_upload_rows
    assert 2 <= n <= 512
    g = next(g for g in weight_groups(QWEN3_30B_A3B) if g.kind is Kind.EXPERTS and g.layer == 0)
    host = next(x for x in p.expert_placements(0) if not x.on_gpu)
    assert host_experts_seconds(g, host, H100, n)[1] and not host_experts_seconds(g, host, H100, n - 1)[1]
    assert any(c.setting == "host experts" and f"{n}+ rows" in c.value for c in p.choices)
    few, many = (decode_step(QWEN3_30B_A3B, H100, p.placements, p.kv, b, 2048, p.threads, 1) for b in (n - 1, n))
    assert few.terms["cpu experts"] > 0 and few.terms["pcie weights"] == 0
    assert many.terms["cpu experts"] == 0 and many.nbytes["pcie weights"] == pytest.approx(
        sum(len(x.experts) for x in p.placements if x.kind is Kind.EXPERTS and not x.on_gpu) * expert_bytes(g, WDtype.INT4))
    assert Plan.from_json(p.to_json()).moe_upload_rows == n
    whole = plan(QWEN3_30B_A3B, H100, Budget(24 * 2**30, 100 * 2**30), Workload(4096))
    assert whole.moe_upload_rows == 0  # nothing on the host


def test_a_prefill_fetches_the_next_layers_first_piece_of_host_experts_ahead():
    """The staging's bookkeeping (offload/moe_host.py): the piece fetched at a layer's end is the next
    host layer's first, taken once by that layer; the last layer fetches nothing. (The copies
    themselves run on CUDA: the GPU tests' MoE prefills.)"""
    from offload.moe_host import HostStaging

    cfg = QWEN3_30B_A3B
    st = HostStaging(cfg, torch.device("cpu"), 4)
    st.fetch = lambda he, a, b: (he, a, b)  # what went up, instead of the copy
    layers = [HostExperts(list(range(40)), cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, 1)
              for _ in range(3)]
    st.layers += layers
    first = st.pieces(layers[1])[0]
    assert first[0] == 0 and 0 < first[1] < 40  # 64 MiB of 40 experts' int4: a piece of them
    st.fetch_next(layers[0])
    assert st.take(layers[1]) == (layers[1], *first) and st.take(layers[1]) is None
    st.fetch_next(layers[0])
    assert st.take(layers[2]) is None  # fetched for another layer: dropped
    st.fetch_next(layers[2])
    assert st.take(layers[0]) is None


def test_n_cpu_moe_keeps_the_first_layers_experts_on_the_host():
    from planner import Overrides

    p = plan(QWEN3_30B_A3B, H100, Budget(8 * 2**30, 100 * 2**30), Workload(4096), Overrides(n_cpu_moe=4))
    for layer in range(48):
        dev = next(x for x in p.expert_placements(layer) if x.on_gpu)
        assert (len(dev.experts) == 0) == (layer < 4)


H200 = HardwareProfile.from_json((Path(__file__).parent / "data" / "h200_profile.json").read_text())  # measured there


@pytest.mark.parametrize("dtype", [KVDtype.INT8, KVDtype.INT4])
def test_a_set_device_tier_fits_beside_split_experts(dtype):
    """--gpu-kv-tokens with a quantized device tier beside experts split per expert: the experts leave
    room for its blocks and their bf16 tails (without the tails, every count at 8 rows is refused on
    the H200 host's profile, short by them), and the plan fits the budget."""
    from planner import Overrides
    from planner.kv_tiers import gpu_tail_bytes

    budget = Budget(8 * 2**30, 100 * 2**30)
    for rows in (1, 8):
        p = plan(QWEN3_30B_A3B, H200, budget, Workload(4096, batch=rows),
                 Overrides(gpu_kv_dtype=dtype, gpu_kv_tokens=3840))
        assert (p.kv.gpu_tokens, p.kv.gpu_dtype, p.kv.host_tokens) == (3840, dtype, 256)
        m = p.memory  # the device tier's bytes count the tails
        assert m.gpu_kv > gpu_tail_bytes(QWEN3_30B_A3B, dtype, p.kv.block_size, rows) > 0
        assert m.gpu_weights + m.gpu_kv + m.gpu_workspace <= budget.gpu_bytes


def test_a_host_tier_beside_host_experts_is_priced_and_avoided():
    """The host tier's attention and the host experts contend for the CPU's cores (planner.cost,
    measured ~3.5 ms a layer): a plan forced to both is priced so, and the planner's own choice at
    128k tokens on 8 GiB keeps the whole KV on the GPU with fewer experts there instead."""
    from planner import Overrides
    from planner.cost import HOST_TIER_BESIDE_EXPERTS_S, decode_step

    budget = Budget(8 * 2**30, 100 * 2**30)
    own = plan(QWEN3_30B_A3B, H200, budget, Workload(131072))
    assert (own.kv.gpu_tokens, own.kv.host_tokens) == (131072, 0)
    forced = plan(QWEN3_30B_A3B, H200, budget, Workload(4096), Overrides(gpu_kv_dtype=KVDtype.INT8, gpu_kv_tokens=3840, stream_tokens=0))
    tier, whole = (decode_step(QWEN3_30B_A3B, H200, forced.placements, kv, 1, 4088, forced.threads, 1)
                   for kv in (forced.kv, dataclasses.replace(forced.kv, gpu_tokens=4096, host_tokens=0)))
    assert tier.terms["cpu experts"] > 0 and "contending for the CPU's cores" in forced.prediction.bottleneck
    assert tier.terms["overhead"] - whole.terms["overhead"] >= sum(QWEN3_30B_A3B.moe_layers) * HOST_TIER_BESIDE_EXPERTS_S


# ----------------------------------------------------------------------------------------- GPU
def _nf4_stack(E, N, K, dev):
    from gpu_ops.nf4 import dequantize_nf4, quantize_nf4

    ws = [torch.randn(N, K, device=dev) * 0.05 for _ in range(E)]
    qs = [quantize_nf4(w) for w in ws]
    deq = [dequantize_nf4(p, a, (N, K)) for p, a in qs]
    return torch.stack([q[0] for q in qs]), torch.stack([q[1] for q in qs]), deq


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,bm,lo,experts", [(512, 128, 32, 0, 128), (2048, 128, 64, 0, 128),
                                               (300, 74, 16, 24, 25), (3, 128, 16, 0, 128)])
def test_gpu_sort_slots_kernel_matches_twin(T, E, bm, lo, experts):
    """The prefill's slot sort (one program) against its torch twin: the same blocks, slots and order."""
    from gpu_ops.moe_prefill import sort_slots, sort_slots_reference

    g = torch.Generator().manual_seed(T)
    local = torch.randint(-1, E, (T, 8), generator=g, dtype=torch.int32).cuda()
    local[: T // 2, 0] = lo
    slots, blocks = sort_slots(local, experts, bm, lo)
    want_slots, want_blocks = sort_slots_reference(local, experts, bm, lo)
    assert torch.equal(blocks, want_blocks)
    assert torch.equal(slots, want_slots)


@pytest.mark.gpu
@pytest.mark.parametrize("xdiv", [1, 3])
def test_gpu_grouped_experts_kernel_matches_dequantized(xdiv):
    from gpu_ops.nf4_gemv import nf4_experts_gemv

    torch.manual_seed(0)
    dev = torch.device("cuda")
    E, N, K, R = 5, 768, 2048, 2
    packed, absmax, deq = _nf4_stack(E, N, K, dev)
    x = torch.randn(R, K, device=dev).bfloat16()
    eids = torch.randint(-1, E, (R * xdiv,), dtype=torch.int32, device=dev)
    eids[0] = -1
    want = torch.stack([torch.zeros(N, device=dev) if e < 0 else deq[e] @ x[s // xdiv].float()
                        for s, e in enumerate(eids.tolist())])
    y = nf4_experts_gemv(x, eids, packed, absmax, (N, K), xdiv)
    assert y.shape == (R * xdiv, N) and y[0].abs().max() == 0
    assert rel_err(y.float(), want) <= 1e-2
    g, u = want.chunk(2, dim=-1)
    sw = nf4_experts_gemv(x, eids, packed, absmax, (N, K), xdiv, swiglu=True)
    assert rel_err(sw.float(), torch.nn.functional.silu(g) * u) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("E,k,norm", [(128, 8, True), (8, 2, False), (60, 3, True)])
def test_gpu_routing_and_sum_kernels_match_their_torch_twins(E, k, norm):
    """gpu_ops.moe_route against offload.moe's route and combine: a top k of the same logits in weight
    order (bf16 logits tie: which of tied experts is free), the same weights and slot maps, and the
    host's input staged in page-locked memory; the sum with and without the host's share, on the
    device and in page-locked memory."""
    from gpu_ops import moe_route
    from offload.moe import combine, route

    torch.manual_seed(E)
    dev = torch.device("cuda")
    N, H = 5, 2048
    h = torch.randn(N, H, device=dev).bfloat16()
    router = (torch.randn(E, H, device=dev) * H**-0.5).bfloat16()
    gpu_map = torch.randint(-1, 5, (E,), dtype=torch.int32, device=dev)
    host_map = torch.where(gpu_map < 0, torch.arange(E, device=dev), -1).to(torch.int32)
    stage = torch.full((N * (H + 2 * k) + 3,), -7.0, pin_memory=True)
    idx, w, gslot, hslot = moe_route.route(h, router, k, norm, gpu_map, host_map, stage)
    torch.cuda.synchronize()
    assert torch.equal(stage[:N * H], h.float().cpu().reshape(-1))
    assert torch.equal(stage[N * H:N * (H + k)], w.cpu().reshape(-1))
    assert torch.equal(stage[N * (H + k):N * (H + 2 * k)].view(torch.int32), hslot.cpu().reshape(-1))
    assert bool((stage[N * (H + 2 * k):] == -7.0).all())
    logits = torch.nn.functional.linear(h, router).float()
    top = logits.gather(1, idx.long())
    assert bool((top >= logits.topk(k, dim=-1).values[:, -1:]).all()) and bool((top[:, :-1] >= top[:, 1:]).all())
    want_w = route(h, router, k, norm, gpu_map, host_map)[1]
    assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-6)
    assert torch.equal(gslot, gpu_map[idx.long()]) and torch.equal(hslot, host_map[idx.long()])
    y = torch.randn(N * k, H, device=dev).bfloat16()
    for host in (None, torch.randn(N, H, device=dev), torch.randn(N, H).pin_memory()):
        got = moe_route.combine(y, w, host, torch.bfloat16)
        want = combine(y, w, None if host is None else host.to(dev), torch.bfloat16)
        assert got.dtype == torch.bfloat16 and rel_err(got.float(), want.float()) <= 1e-2
        x = torch.randn(N, H, device=dev).bfloat16() * 4  # the residual: added to the sum's bf16 rounding
        got = moe_route.combine(y, w, host, torch.bfloat16, residual=x)
        assert rel_err(got.float(), (want + x).float()) <= 1e-2 and not torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, upload", [(1, 0), (4, 0), (150, 0), (8, 4)])
def test_gpu_split_moe_layer_in_a_cuda_graph(rows, upload):
    """The device's experts in the grouped kernels and the host's in a host node on a side stream:
    eager and captured in a CUDA graph, the same output as the torch reference of both. 150 rows
    (a prefill chunk), and 8 where the plan has the host's experts go up from 4: the grouped GEMM
    over the slots sorted by expert, the host's experts copied up, eagerly."""
    from hetero.config import ModelConfig, Arch
    from offload.moe import DeviceExperts
    from offload.moe_host import HostStaging

    torch.manual_seed(rows)
    dev = torch.device("cuda")
    E, k, H, F = 12, 4, 512, 256
    cfg = ModelConfig(arch=Arch.QWEN3_MOE, vocab_size=100, hidden_size=H, intermediate_size=4 * H, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=128, num_experts=E, num_experts_per_tok=k,
                      moe_intermediate_size=F, norm_topk_prob=True)
    on_dev, on_host = list(range(0, E, 2)), list(range(1, E, 2))
    gu_p, gu_a, gu_deq = _nf4_stack(len(on_dev), 2 * F, H, dev)
    dn_p, dn_a, dn_deq = _nf4_stack(len(on_dev), H, F, dev)
    dx = DeviceExperts(on_dev, [], (gu_p, gu_a, dn_p, dn_a))
    he = HostExperts(on_host, H, F, k, threads=4)
    for j in range(len(on_host)):
        he.set(j, torch.randn(2 * F, H) * 0.05, torch.randn(H, F) * 0.05)
    router = (torch.randn(E, H, device=dev) * 0.05).bfloat16()
    ffn = MoEFeedForward(cfg, router, dx, he, dev, HostStaging(cfg, dev, 16), upload)
    h = torch.randn(rows, H, device=dev).bfloat16()

    probs = torch.softmax(torch.nn.functional.linear(h, router).float(), -1)
    w, idx = probs.topk(k, -1)
    w = w / w.sum(-1, keepdim=True)
    want = torch.zeros(rows, H, dtype=torch.float64)
    hidx = torch.tensor([on_host.index(e) if e in on_host else -1 for e in idx.flatten().tolist()]).view(rows, k)
    want += experts_ref(h.double().cpu(), hidx.int(), w.cpu(), *he.tensors())
    for n in range(rows):
        for s in range(k):
            e = int(idx[n, s])
            if e in on_dev:
                j = on_dev.index(e)
                gg, uu = (gu_deq[j].double() @ h[n].double()).chunk(2)
                want[n] += float(w[n, s]) * (dn_deq[j].double() @ (torch.nn.functional.silu(gg) * uu)).cpu()
    assert ffn.staging.signals, "the stream's memory operations did not complete a round trip"
    for signals in (True, False):  # calls signalled in memory, then as host functions
        ffn.staging.signals = signals
        eager = ffn(h)
        assert rel_err(eager.float().cpu(), want) <= 2e-2
        x = torch.randn(rows, H, device=dev).bfloat16()
        assert torch.equal(ffn(h, residual=x), x + eager)  # the sum rounded to bf16, then the add
        if rows > ffn.graph_rows:
            continue
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ffn(h)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = ffn(h)
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)


@pytest.mark.gpu
def test_gpu_split_moe_model_tokens(tiny):
    """A tiny Qwen3-MoE on CUDA with half of each layer's experts on the host (int4, host nodes): its
    logits as near transformers' as the CPU stand-in's of the same plan (bf16 activations: the tiny
    model's routing differs at a few tokens), its decode in the whole-step CUDA graph."""
    folder, ref = tiny("qwen3_moe_64")
    E = ref.config.num_experts
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPTS[0]])).logits[0].float()
    sp = split_plan(forced_plan(folder, weights=WDtype.NF4), E, SPLITS["half"], WDtype.INT4)
    gpu = hetero.load(folder, device="cuda", plan=sp, tokenizer=False, ctx_size=64)
    cpu = _run(folder, sp, n=1)[2]
    assert rel_err(gpu.logits(PROMPTS[0]).cpu(), theirs) <= 1.5 * rel_err(cpu, theirs) + 0.02
    toks = [c.token for c in gpu.generate(PROMPTS[0], max_new_tokens=8, temperature=0.0)]
    assert len(toks) == 8
    assert gpu.runner.graph_step is not None and gpu.model.capturable(1)


def test_experts_the_int4_kernel_cannot_take_stay_whole_groups_in_int8(tiny):
    """Qwen3-MoE with an expert FFN of 48 (not whole groups of 64): no split; --n-cpu-moe's layers go
    to the CPU as whole groups in the CPU's int8 format, and run."""
    folder = tiny("qwen3_moe")[0]
    p = forced_plan(folder, weights=WDtype.NF4, n_cpu_moe=1)
    parts = p.expert_placements(0)
    assert len(parts) == 1 and parts[0].experts is None and parts[0].mode is Mode.CPU and parts[0].dtype is WDtype.INT8
    e = hetero.load(folder, device="cpu", plan=p, tokenizer=False, ctx_size=64)
    assert len([c.token for c in e.generate(PROMPTS[0], max_new_tokens=3, temperature=0.0)]) == 3


# ------------------------------------------------------------------------------ routing statistics
def test_profile_experts_counts_every_routed_slot(tiny, tmp_path):
    from hetero.app.routing import profile_experts
    from planner.experts import load_routing

    folder = tiny("qwen3_moe_64")[0]
    e = hetero.load(folder, device="cpu", tokenizer=False, ctx_size=64)
    path, counts, tokens = profile_experts(e, PROMPTS, tmp_path / "r.json")
    assert tokens == sum(map(len, PROMPTS)) and sorted(counts) == [0, 1, 2]
    assert all(sum(c) == 2 * tokens and len(c) == 8 for c in counts.values())  # top-2 of 8 a token
    assert load_routing(path, e.cfg) == {i: [float(x) for x in c] for i, c in counts.items()}
    # counted the same through split layers (MoEFeedForward: its float path may flip a near tie)
    sp = split_plan(forced_plan(folder), 8, SPLITS["half"], WDtype.F32)
    e2 = hetero.load(folder, device="cpu", plan=sp, tokenizer=False, ctx_size=64)
    split = profile_experts(e2, PROMPTS, tmp_path / "r2.json")[1]
    assert split[0] == counts[0]
    assert all(sum(split[i]) == sum(counts[i]) and sum(abs(a - b) for a, b in zip(split[i], counts[i])) <= 4
               for i in counts)
    with pytest.raises(hetero.UserError, match="do not match"):
        load_routing(path, QWEN3_30B_A3B)


def test_plan_keeps_the_most_routed_experts_on_the_gpu():
    torch.manual_seed(0)
    heat = {i: (torch.rand(128) ** 4 * 1000).tolist() for i in range(48)}  # a few experts take most slots
    budget, wl = Budget(8 * 2**30, 100 * 2**30), Workload(4096)
    uniform, hot = plan(QWEN3_30B_A3B, H100, budget, wl), plan(QWEN3_30B_A3B, H100, budget, wl, routing=heat)
    for layer in range(48):
        dev = next(x for x in hot.expert_placements(layer) if x.on_gpu)
        n = len(dev.experts)
        assert sorted(dev.experts) == sorted(sorted(range(128), key=lambda e: -heat[layer][e])[:n])
        assert dev.share == pytest.approx(sum(heat[layer][e] for e in dev.experts) / sum(heat[layer]))
        assert dev.share > n / 128
    assert hot.prediction.decode_tok_s > 1.2 * uniform.prediction.decode_tok_s
    assert "most routed" in next(c.reason for c in hot.choices if c.setting == "experts")
    assert Plan.from_json(hot.to_json()) == hot


def test_split_plans_the_runtime_cannot_run_are_refused(tiny):
    from offload.placement import check_plan_supported

    folder = tiny("qwen3_moe_64")[0]
    p = split_plan(forced_plan(folder, weights=WDtype.NF4), 8, SPLITS["half"], WDtype.INT4)
    check_plan_supported(p, torch.device("cpu"))
    with pytest.raises(hetero.UserError, match="int4"):  # float host experts beside a GPU
        check_plan_supported(split_plan(forced_plan(folder, weights=WDtype.NF4), 8, SPLITS["half"], WDtype.BF16),
                             torch.device("cuda"))
    streamed = dataclasses.replace(p, placements=tuple(
        dataclasses.replace(x, mode=Mode.STREAM) if x.experts is not None and not x.on_gpu else x for x in p.placements))
    with pytest.raises(hetero.UserError, match="int4, the format of experts the CPU computes"):
        check_plan_supported(streamed, torch.device("cpu"))
