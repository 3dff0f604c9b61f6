"""gpu_ops: NF4 format and linears, GPU-pool attention, the all-GPU decode step, the weight cache.

CPU tests check every op against its reference (the ops run on CPU tensors too); tests marked
`gpu` repeat them on CUDA with the fast kernels (bitsandbytes, Triton) and check CUDA-graph
decode against eager and against the all-CPU float32 engine.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

import hetero
from conftest import COMMON, rel_err
from cpu_attention.pool import HostKVPool
from cpu_attention.layout import KVDtype
from cpu_attention.merge import merge_attention
from cpu_attention.reference import decode_attention_ref, prefill_attention_ref
from gpu_ops.attention import AttnKernel, decode_attention, prefill_attention
from gpu_ops.decode_step import GpuDecoder, prefill
from gpu_ops.kv_pool import GpuKVPool
from gpu_ops.nf4 import NF4_CODE, NF4Linear, Nf4Kernel, dequantize_nf4, quantize_nf4
from hetero.checkpoint import open_checkpoint
from offload.loader import WeightFormat, load_model
from hetero.model import Dense

CUDA = torch.cuda.is_available()
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
PROMPT = [3, 17, 42, 99, 5, 150, 7, 8, 64, 33, 2, 11]
# Measured on conftest's tiny random models (hidden 64, 2 layers, vocab 160; llama and qwen3,
# seeds 0 and 1, CPU, float32 activations): NF4 weights alone are off by ‖Δw‖/‖w‖ ≈ 0.09 (the
# code book's error on Gaussian weights); the 12-token prompt's logits then differ from the
# bf16-weight logits by 0.33 to 0.40 relative (these models' logits are nearly flat, so the
# error is large against them), while the same engine with each NF4 linear replaced by its
# dequantized dense twin gives the NF4 logits exactly: the whole error is the format's.
NF4_WEIGHT_ERR = 0.11
NF4_LOGIT_ERR = 0.5


# ---------------------------------------------------------------------------------- NF4 format
@pytest.mark.parametrize("shape", [(7, 64), (33, 96), (5, 13)])  # (5, 13): a partial last block
def test_nf4_codes_are_nearest_and_absmax_per_64(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 3
    packed, absmax = quantize_nf4(w)
    flat = w.reshape(-1)
    n = flat.numel()
    assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 2)
    ref_absmax = torch.nn.functional.pad(flat.abs(), (0, -n % 64)).view(-1, 64).amax(1)
    torch.testing.assert_close(absmax, ref_absmax, rtol=0, atol=0)
    codes = torch.stack([packed >> 4, packed & 15], -1).view(-1)[:n].long()
    scaled = flat / absmax.repeat_interleave(64)[:n]
    best = (scaled[:, None] - NF4_CODE[None, :]).abs().argmin(1)
    assert torch.equal(codes, best)
    back = dequantize_nf4(packed, absmax, shape)
    assert back.shape == shape and rel_err(back, w) < NF4_WEIGHT_ERR


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
def test_nf4_format_is_bitsandbytes():
    import bitsandbytes.functional as F

    torch.manual_seed(1)
    w = torch.randn(48, 192, dtype=torch.bfloat16)
    q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    packed, absmax = quantize_nf4(w)
    assert torch.equal(q.view(-1), packed)
    assert torch.equal(state.absmax, absmax)
    torch.testing.assert_close(state.code, NF4_CODE)


def test_nf4_linear_cpu_matches_dequantized_reference():
    torch.manual_seed(2)
    w, b, x = torch.randn(40, 128), torch.randn(40), torch.randn(5, 128)
    packed, absmax = quantize_nf4(w)
    lin = NF4Linear(packed, absmax, (40, 128), b)
    ref = x.double() @ dequantize_nf4(packed, absmax, (40, 128)).double().T + b.double()
    assert lin.pick(5) is Nf4Kernel.TORCH
    assert rel_err(lin(x), ref) < 1e-6


# ---------------------------------------------------------------------------------- attention
def _pool(device, L=2, NB=40, Hkv=2, BS=16, D=32, seed=0):
    torch.manual_seed(seed)
    pool = GpuKVPool(L, NB, Hkv, BS, D, device=torch.device(device))
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    host = HostKVPool(L, NB + 1, Hkv, BS, D, KVDtype.F32)  # the same values, for the references
    host.k, host.v = pool.k.float().cpu(), pool.v.float().cpu()
    return pool, host


def _check_decode(device, kernel, tol, MB=9):
    """MB 9: the Triton kernel's one-block splits and their merge; 36: splits of 9 blocks."""
    pool, host = _pool(device)
    B, Hq = 4, 6
    tables = torch.stack([torch.randperm(pool.num_blocks)[:MB] for _ in range(B)]).int()
    lens = torch.tensor([1, 77, MB * pool.block_size, 0], dtype=torch.int32)  # the last: no tokens
    q = torch.randn(B, Hq, pool.head_dim).to(pool.dtype)
    ref_o, ref_l = decode_attention_ref(host, 1, q.float(), tables, lens, 0.3)
    o, lse = decode_attention(pool, 1, q.to(device), tables.to(device), lens.to(device), 0.3, kernel)
    o, lse = o.cpu(), lse.cpu()
    assert torch.isinf(lse[3]).all() and (o[3] == 0).all()
    assert rel_err(o[:3], ref_o[:3]) < tol and rel_err(lse[:3], ref_l[:3]) < tol


def test_decode_attention_torch_matches_reference():
    _check_decode("cpu", AttnKernel.TORCH, 1e-6)


@pytest.mark.parametrize("q_pos0,kv_pos0", [(30, 0), (30, 5), (2, 10)])  # (2, 10): early rows see nothing
def test_prefill_attention_matches_reference(q_pos0, kv_pos0):
    pool, host = _pool("cpu")
    T, Hq, kv_len = 20, 6, 50
    table = torch.randperm(pool.num_blocks)[:8].int()
    q = torch.randn(T, Hq, pool.head_dim).bfloat16()
    ref_o, ref_l = prefill_attention_ref(host, 0, q.float(), table, kv_len, q_pos0, 0.3, kv_pos0=kv_pos0)
    o, lse = prefill_attention(pool, 0, q, table, kv_len, q_pos0, 0.3, kv_pos0=kv_pos0)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l))
    fin = torch.isfinite(ref_l)
    assert rel_err(o, ref_o) < 1e-6 and rel_err(lse[fin], ref_l[fin]) < 1e-6


def test_split_tiers_merge_to_the_whole():
    """Attention over tokens split between two block sets, merged by LSE, equals attention over all."""
    pool, _ = _pool("cpu")
    q = torch.randn(1, 6, pool.head_dim).bfloat16()
    blocks = torch.randperm(pool.num_blocks)[:6].int()
    whole = decode_attention(pool, 0, q, blocks[None], torch.tensor([96], dtype=torch.int32), 0.3, AttnKernel.TORCH)
    a = decode_attention(pool, 0, q, blocks[None, :2], torch.tensor([32], dtype=torch.int32), 0.3, AttnKernel.TORCH)
    b = decode_attention(pool, 0, q, blocks[None, 2:], torch.tensor([64], dtype=torch.int32), 0.3, AttnKernel.TORCH)
    o, lse = merge_attention(a[0], a[1], b[0], b[1])
    assert rel_err(o, whole[0]) < 1e-6 and rel_err(lse, whole[1]) < 1e-6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_tier_merge_and_down_pack_match_their_twins(device, n):
    """`split_io`: the one-kernel merge of n partials (empty rows among them) equals the pairwise
    torch merge, and q, k, v views of one projection pack into the staging layout."""
    from gpu_ops.split_io import merge_into, pack_rows

    torch.manual_seed(n)
    B, Hq, D = 5, 6, 96  # a head dim not a power of two: masked columns
    parts = [(torch.randn(B, Hq, D, device=device), 3 * torch.randn(B, Hq, device=device)) for _ in range(n)]
    for _, lse in parts:
        lse[0, 1] = float("-inf")  # a row every tier leaves empty
    parts[-1][1][2] = float("-inf")  # a sequence one tier has no token of
    o, lse = parts[0]
    for o_p, lse_p in parts[1:]:
        o, lse = merge_attention(o_p, lse_p, o, lse)
    out = torch.empty(B, Hq, D, dtype=torch.bfloat16, device=device)
    merge_into(out, parts)
    assert rel_err(out.float(), o.bfloat16().float()) < 1e-2
    assert n == 1 or torch.all(out[0, 1] == 0)  # no weight where every partial is empty (one: taken as is)
    out32 = torch.empty(B, Hq, D, device=device)
    merge_into(out32, parts)
    assert rel_err(out32, o) < 1e-6

    Hkv = 2
    qkv = torch.randn(B, Hq + 2 * Hkv, D, device=device).bfloat16()
    q, k, v = qkv.split([Hq, Hkv, Hkv], dim=1)
    dst = torch.empty(B * (Hq + 2 * Hkv) * D, device=device)
    pack_rows(q, k, v, dst)
    assert torch.equal(dst, torch.cat([t.float().flatten() for t in (q, k, v)]))


# ---------------------------------------------------------------------------------- the decode step
def _tiny_separated(tmp_path, **overrides):
    """A tiny random llama whose greedy choices are far apart: lm_head rows are a permutation of
    the (unit-variance) embeddings and the layers perturb the residual stream without drowning
    it, so bf16 and float32 runs pick the same tokens (min top-2 gap ≈ 0.39 of the top logit)."""
    import transformers as tf

    torch.manual_seed(3)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**COMMON, "initializer_range": 0.1, **overrides})).eval()
    with torch.no_grad():
        e = torch.randn_like(model.model.embed_tokens.weight)
        model.model.embed_tokens.weight.copy_(e)
        model.lm_head.weight.copy_(e[torch.randperm(e.shape[0])])
    model.save_pretrained(tmp_path)
    return tmp_path


def _greedy(model, n_new: int, graphs: bool, batch: int = 1, block_size: int = 16,
            compile: bool = False) -> list[list[int]]:
    """Prefill PROMPT (shifted per sequence) then decode n_new tokens for `batch` sequences together."""
    cfg, dev = model.cfg, model.device
    mb = -(-(len(PROMPT) + n_new) // block_size)
    pool = GpuKVPool(cfg.num_layers, batch * mb, cfg.num_kv_heads, block_size, cfg.head_dim, device=dev,
                     dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    tables = torch.arange(batch * mb, dtype=torch.int32).view(batch, mb)
    seqs = []
    for s in range(batch):
        p = [(t + 7 * s) % cfg.vocab_size for t in PROMPT]
        slots = (tables[s].long()[:, None] * block_size + torch.arange(block_size)).view(-1)
        logits = prefill(model, pool, torch.tensor(p), 0, slots[: len(p)], tables[s])
        seqs.append((p + [int(logits[0].argmax())], slots))
    dec = GpuDecoder(model, pool, max_batch=max(batch, 2), max_blocks_per_seq=mb + 1, graphs=graphs,
                     compile=compile)
    for _ in range(n_new - 1):
        pos = torch.tensor([len(t) - 1 for t, _ in seqs])
        slots = torch.stack([sl[len(t) - 1] for t, sl in seqs])
        logits = dec.step(torch.tensor([t[-1] for t, _ in seqs]), pos, slots, tables, pos + 1)
        for (t, _), row in zip(seqs, logits):
            t.append(int(row.argmax()))
    return [t[len(PROMPT):] for t, _ in seqs]


def _engine_greedy(folder, n_new: int) -> list[int]:
    engine = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False)
    return [c.token for c in engine.generate(PROMPT, max_new_tokens=n_new, temperature=0.0)]


def test_decoder_eager_cpu_matches_engine(tmp_path):
    """The decode step's plumbing (slots, tables, lengths, batching) on the CPU, float32."""
    folder = _tiny_separated(tmp_path)
    model = load_model(open_checkpoint(folder), WeightFormat.F32, torch.device("cpu"))
    ours = _greedy(model, 12, graphs=False, batch=2)
    engine = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False)
    for s in range(2):
        prompt = [(t + 7 * s) % model.cfg.vocab_size for t in PROMPT]
        assert ours[s] == [c.token for c in engine.generate(prompt, max_new_tokens=12, temperature=0.0)]


@pytest.mark.parametrize("weights", ["4bit", "q4"])
def test_nf4_engine_logits_near_bf16(tiny, tmp_path, monkeypatch, weights):
    """NF4 and the linear q4 (q4 where K is whole groups of 64: here all but down, K = 96)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder, _ = tiny("llama")
    bf16 = hetero.load(folder, device="cpu", weights="bf16", kv_dtype="f32", tokenizer=False).logits(PROMPT)
    engine = hetero.load(folder, device="cpu", weights=weights, kv_dtype="f32", tokenizer=False)
    codes = {lin.codes.value for lw in engine.model.layers for lin in (lw.qkv, lw.gate_up, lw.down)}
    assert codes == ({"nf4"} if weights == "4bit" else {"q4", "nf4"})
    nf4 = engine.logits(PROMPT)
    err = rel_err(nf4, bf16)
    assert 0 < err < NF4_LOGIT_ERR, err
    m = engine.model  # the same engine over the dequantized weights: the error is all the format's
    for lw in m.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(lw, name)
            setattr(lw, name, Dense(lin.dequantize(), lin.bias))
    m.lm_head = Dense(m.lm_head.dequantize())
    assert rel_err(engine.logits(PROMPT), nf4) < 1e-6


# ---------------------------------------------------------------------------------- weight cache
@pytest.mark.parametrize("fmt,quant_type", [(WeightFormat.NF4, "nf4"), (WeightFormat.Q4, "q4")])
def test_weight_cache_second_load_does_not_quantize(tiny, tmp_path, monkeypatch, fmt, quant_type):
    import gpu_ops.weight_cache as wc

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder, _ = tiny("qwen2")  # biases too
    ck = open_checkpoint(folder)
    first = load_model(ck, fmt, torch.device("cpu"))
    files = list((tmp_path / "hetero" / "weights").glob("*.safetensors"))
    assert len(files) == 1

    def boom(*args, **kwargs):
        raise AssertionError("quantized again despite the cache")

    monkeypatch.setattr(wc, "nf4_linear", boom)
    second = load_model(open_checkpoint(folder), fmt, torch.device("cpu"))
    x = torch.randn(3, ck.config.hidden_size)
    for a, b in [(first.layers[0].qkv, second.layers[0].qkv), (first.lm_head, second.lm_head)]:
        assert torch.equal(a.packed, b.packed) and torch.equal(a(x), b(x))
    from safetensors import safe_open

    meta = safe_open(str(files[0]), "pt").metadata()
    assert meta["quant_type"] == quant_type and meta["blocksize"] == "64"


def test_weight_cache_key_follows_the_source(tmp_path):
    import os

    from gpu_ops.weight_cache import source_key

    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    k1 = source_key(tmp_path)
    os.utime(tmp_path / "model.safetensors", ns=(1, 1))
    assert source_key(tmp_path) != k1


# ---------------------------------------------------------------------------------- on the GPU
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1000, 4096 + 5])
def test_read_pinned_sees_each_rewrite_in_a_graph(n):
    """gpu_ops.host_read: a kernel's read of pinned memory, captured once and replayed while the
    host rewrites the buffer between replays (as the CPU's (o, lse) are each layer), returns
    what the host wrote each time, never a cached earlier value."""
    from gpu_ops.host_read import read_pinned

    src = torch.zeros(n, pin_memory=True)
    dst = torch.full((n,), -1.0, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        read_pinned(src, dst)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        read_pinned(src, dst)
    for k in range(5):
        want = torch.randn(n, generator=torch.Generator().manual_seed(k))
        src.copy_(want)
        g.replay()
        assert torch.equal(dst.cpu(), want)
    with pytest.raises(ValueError):
        read_pinned(src, torch.empty(n + 1, device="cuda"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [Nf4Kernel.BNB, Nf4Kernel.TRITON, Nf4Kernel.GEMV, Nf4Kernel.MMA, Nf4Kernel.AUTO])
@pytest.mark.parametrize("rows", [1, 5, 32, 64, 100])
def test_gpu_nf4_kernels_match_reference(kernel, rows):
    torch.manual_seed(rows)
    N, K = 384, 1024
    w, b = torch.randn(N, K, device="cuda"), torch.randn(N, device="cuda")
    packed, absmax = quantize_nf4(w)
    cpu_packed, cpu_absmax = quantize_nf4(w.cpu())
    assert torch.equal(packed.cpu(), cpu_packed) and torch.equal(absmax.cpu(), cpu_absmax)
    lin = NF4Linear(packed, absmax, (N, K), b.bfloat16(), kernel)
    x = torch.randn(rows, K, device="cuda").bfloat16()
    ref = x.double() @ dequantize_nf4(packed, absmax, (N, K)).double().T + b.double()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, N)
    assert rel_err(y, ref) < 1e-2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape,config", [((97, 4160), None), ((1000, 832), None), ((4096, 1024), (16, 16, 4, 1)),
                                          ((333, 2048), (32, 8, 4, 4)), ((600, 4096), (4, 64, 4, 1))])
def test_gpu_nf4_gemv_matches_dequantized_reference(rows, shape, config):
    """Split-K and not, odd N and K (K a multiple of 64 only), fresh inputs."""
    from gpu_ops.nf4_gemv import Decode, nf4_gemv

    torch.manual_seed(rows + shape[0])
    w = torch.randn(shape, device="cuda") * 0.02
    packed, absmax = quantize_nf4(w)
    ref_w = dequantize_nf4(packed, absmax, shape).double()
    x = torch.randn(rows, shape[1], device="cuda").bfloat16()
    y = nf4_gemv(x, packed, absmax, shape, Decode.PRMT, config)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, shape[0]) and torch.isfinite(y).all()
    assert rel_err(y, x.double() @ ref_w.T) < 1e-2


# nf4_mma against x · W_deqᵀ in float64: the bf16 output's rounding (‖Δy‖/‖y‖ ≈ 1.6e-3 on random
# sums) and the weights' (Scale.WEIGHT: bf16(bf16(code) · bf16(absmax)), three roundings of ≤ 2^-9;
# Scale.SUM: the bf16 code book). Under Triton's CPU interpreter (one weight rounding, as
# bitsandbytes): 2.0-2.6e-3 (tests/nf4_mma_interpret.py); the PRMT path rounds twice more.
MMA_ERR = 6e-3


def _mma_configs():
    from gpu_ops.nf4_mma import MmaConfig, Scale

    return [((97, 4160), None),  # K = 64 · 65: block_k falls to 64
            ((1000, 832), None),
            ((333, 2048), MmaConfig(block_n=64, block_k=128, warps=4, split=4, swap=True)),
            ((4096, 1024), MmaConfig(block_n=128, block_k=64, split=2, scale=Scale.SUM)),
            ((600, 4096), MmaConfig(block_n=128, block_k=256, warps=8, stages=2, swap=True)),
            ((6144, 4096), MmaConfig(block_n=256, block_k=128, warps=8, stages=2)),
            ((1000, 2048), MmaConfig(block_n=128, block_k=64, warps=4, split=3, scale=Scale.SUM, swap=True))]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [3, 17, 32, 64])
@pytest.mark.parametrize("case", range(7))
@pytest.mark.parametrize("codes", ["nf4", "q4"])
def test_gpu_nf4_mma_matches_dequantized_reference(rows, case, codes):
    """N not a multiple of the tile, K a multiple of 64 only, split-K and not, both scale placements
    and both orientations (x·Wᵀ, W·xᵀ); NF4 and the linear q4 (its decoder in PTX, Scale.SUM run as
    WEIGHT)."""
    from gpu_ops.nf4_gemv import Decode
    from gpu_ops.nf4_mma import nf4_mma
    from gpu_ops.q4 import dequantize_q4, quantize_q4

    shape, config = _mma_configs()[case]
    torch.manual_seed(rows + shape[0])
    w = torch.randn(shape, device="cuda") * 0.02
    if codes == "q4":
        packed, scales = quantize_q4(w)
        decode, w_ref = Decode.LINEAR, dequantize_q4(packed, scales, torch.float64)
    else:
        packed, scales = quantize_nf4(w)
        decode, w_ref = Decode.PRMT, dequantize_nf4(packed, scales, shape).double()
    x = torch.randn(rows, shape[1], device="cuda").bfloat16()
    y = nf4_mma(x, packed, scales, shape, config, decode=decode)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, shape[0]) and torch.isfinite(y).all()
    assert rel_err(y, x.double() @ w_ref.T) < MMA_ERR
    assert torch.equal(nf4_mma(x, packed, scales, shape, config, decode=decode), y)  # split-K sums in a fixed order


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", [1, 2])
def test_gpu_nf4_mma_residual_epilogue_is_torchs_add(case):
    from gpu_ops.nf4_mma import nf4_mma

    shape, config = _mma_configs()[case]
    torch.manual_seed(3)
    packed, absmax = quantize_nf4(torch.randn(shape, device="cuda") * 0.02)
    x = torch.randn(24, shape[1], device="cuda").bfloat16()
    res = torch.randn(24, shape[0], device="cuda").bfloat16()
    y = nf4_mma(x, packed, absmax, shape, config)
    assert torch.equal(nf4_mma(x, packed, absmax, shape, config, residual=res), res + y)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [3, 8, 16, 32, 64])
def test_gpu_nf4_auto_takes_mma_in_its_row_range(rows):
    """Up to 8 rows go to the tensor-core GEMV where the device runs it, the rest of MMA's range to MMA."""
    from gpu_ops import nf4_tc
    from gpu_ops.nf4 import GEMV_TC_ROWS, MMA_AUTO_ROWS
    from gpu_ops.nf4_mma import nf4_mma

    torch.manual_seed(rows)
    N, K = 1000, 2048
    packed, absmax = quantize_nf4(torch.randn(N, K, device="cuda") * 0.02)
    lin = NF4Linear(packed, absmax, (N, K))
    x = torch.randn(rows, K, device="cuda").bfloat16()
    if rows <= GEMV_TC_ROWS and nf4_tc.enabled(lin.device):
        assert lin.pick(rows) is Nf4Kernel.GEMV
        assert torch.equal(lin(x), nf4_tc.nf4_tc_gemv(x, packed, absmax, (N, K)))
    else:
        assert (lin.pick(rows) is Nf4Kernel.MMA) == (rows in MMA_AUTO_ROWS)
        if rows in MMA_AUTO_ROWS:
            assert torch.equal(lin(x), nf4_mma(x, packed, absmax, (N, K)))
    assert rel_err(lin(x), x.double() @ lin.dequantize(torch.float64).T) < MMA_ERR


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", [1, 2, 3])
def test_gpu_nf4_mma_in_a_cuda_graph_gives_eager_results(case):
    """Replays with new inputs equal eager calls bit for bit; split-K's counters reset themselves."""
    from gpu_ops.nf4_mma import nf4_mma

    shape, config = _mma_configs()[case]
    torch.manual_seed(case)
    packed, absmax = quantize_nf4(torch.randn(shape, device="cuda") * 0.02)
    x = torch.randn(32, shape[1], device="cuda").bfloat16()
    res = torch.randn(32, shape[0], device="cuda").bfloat16()
    nf4_mma(x, packed, absmax, shape, config, residual=res)  # compile, allocate the counters: outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        nf4_mma(x, packed, absmax, shape, config, residual=res)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = nf4_mma(x, packed, absmax, shape, config, residual=res)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, nf4_mma(x, packed, absmax, shape, config, residual=res))


@gpu
@pytest.mark.gpu
def test_gpu_decode_attention_triton_matches_reference():
    _check_decode("cuda", AttnKernel.TRITON, 1e-2)
    _check_decode("cuda", AttnKernel.TRITON, 1e-2, MB=36)
    _check_decode("cuda", AttnKernel.TORCH, 1e-5)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("R", [2, 5, 8])
def test_gpu_decode_attention_triton_runs_match_rows(R):
    """Runs of R rows (one block table, consecutive lengths) in one program each give what the
    kernel gives row by row (float32 rounding) and the reference; a lone row beside them."""
    from gpu_ops.runs import RunRows, run_codes

    pool, host = _pool("cuda", NB=80)
    MB = 36
    long, short = torch.randperm(pool.num_blocks)[:MB].int(), torch.randperm(pool.num_blocks)[:MB].int()
    tables = torch.stack([long] * R + [short] * 2 + [short])
    lens = torch.tensor([500 + j for j in range(R)] + [R + 1, R + 2, 40], dtype=torch.int32)
    runs = torch.tensor(run_codes([R, 2, 1]), dtype=torch.int32)
    q = torch.randn(R + 3, 6, pool.head_dim).to(pool.dtype)
    args = (pool, 1, q.cuda(), tables.cuda(), lens.cuda(), 0.3, AttnKernel.TRITON)
    o, lse = decode_attention(*args, runs=RunRows(runs.cuda(), R))
    ro, rl = decode_attention(*args)
    assert rel_err(o.cpu(), ro.cpu()) < 1e-5 and rel_err(lse.cpu(), rl.cpu()) < 1e-5
    ref_o, ref_l = decode_attention_ref(host, 1, q.float(), tables, lens, 0.3)
    assert rel_err(o.cpu(), ref_o) < 1e-2 and rel_err(lse.cpu(), ref_l) < 1e-2


@gpu
@pytest.mark.gpu
def test_gpu_graph_decode_same_tokens_as_eager(tmp_path):
    folder = _tiny_separated(tmp_path)
    model = load_model(open_checkpoint(folder), WeightFormat.BF16, torch.device("cuda"))
    eager = _greedy(model, 64, graphs=False, batch=3)
    graph = _greedy(model, 64, graphs=True, batch=3)
    assert graph == eager


@gpu
@pytest.mark.gpu
def test_gpu_graph_decode_with_the_table_in_host_memory(tmp_path):
    """The embedding table in host memory (the planner's choice when the GPU is tight): each step's
    rows gathered there into pinned staging and copied up before the replay, in the graph and in
    the eager loop: the tokens of the table on the GPU."""
    folder = _tiny_separated(tmp_path)
    model = load_model(open_checkpoint(folder), WeightFormat.BF16, torch.device("cuda"))
    want = _greedy(model, 24, graphs=True, batch=3)
    model.embed_w = model.embed_w.cpu()
    assert _greedy(model, 24, graphs=True, batch=3) == want
    assert _greedy(model, 24, graphs=False, batch=3) == _greedy(model, 24, graphs=True, batch=3)


@gpu
@pytest.mark.gpu
def test_gpu_bf16_greedy_matches_cpu_float32(tmp_path):
    folder = _tiny_separated(tmp_path)
    model = load_model(open_checkpoint(folder), WeightFormat.BF16, torch.device("cuda"))
    ours = _greedy(model, 64, graphs=True)[0]
    assert ours == _engine_greedy(folder, 64)
    # and the logits themselves, within bf16 activations' error, along the whole sequence
    tokens = PROMPT + ours
    cpu = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False).logits(tokens)
    pool = GpuKVPool(model.cfg.num_layers, 6, model.cfg.num_kv_heads, 16, model.cfg.head_dim)
    gpu_logits = prefill(model, pool, torch.tensor(tokens), 0, torch.arange(len(tokens)),
                         torch.arange(6, dtype=torch.int32), all_logits=True)
    assert rel_err(gpu_logits.cpu(), cpu) < 2e-2


@gpu
@pytest.mark.gpu
def test_gpu_compiled_graph_decode_same_tokens_as_eager(tmp_path):
    folder = _tiny_separated(tmp_path)
    model = load_model(open_checkpoint(folder), WeightFormat.BF16, torch.device("cuda"))
    eager = _greedy(model, 16, graphs=False, batch=3)
    assert _greedy(model, 16, graphs=True, batch=3, compile=True) == eager


@gpu
@pytest.mark.gpu
def test_gpu_nf4_logits_near_bf16(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder, _ = tiny("llama")
    ck = open_checkpoint(folder)
    outs = {}
    for fmt in (WeightFormat.BF16, WeightFormat.NF4):
        model = load_model(ck, fmt, torch.device("cuda"))
        pool = GpuKVPool(model.cfg.num_layers, 4, model.cfg.num_kv_heads, 16, model.cfg.head_dim)
        table = torch.arange(4, dtype=torch.int32)
        outs[fmt] = prefill(model, pool, torch.tensor(PROMPT), 0, torch.arange(len(PROMPT)), table, all_logits=True)
    assert rel_err(outs[WeightFormat.NF4], outs[WeightFormat.BF16]) < NF4_LOGIT_ERR


@gpu
@pytest.mark.gpu
def test_gpu_fused_ops_match_their_torch_twins():
    """gpu_ops.fused's norm, RoPE and SiLU·up against hetero.model's torch ops, at the
    Llama-3-8B shapes: at most one bf16 rounding apart (summation order, exp)."""
    import torch.nn.functional as F

    from gpu_ops import fused
    from hetero.model import Rope, rms_norm

    torch.manual_seed(0)
    x = torch.randn(2, 4096, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).bfloat16()
    ref = rms_norm(x, w, 1e-5)
    got = fused.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16 and (got.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()
    assert rel_err(got, ref) < 4e-3

    D, Hq, Hkv = 128, 32, 8
    qkv = torch.randn(2, (Hq + 2 * Hkv) * D, device="cuda").bfloat16()
    pos = torch.tensor([7, 8000], device="cuda")
    rope = Rope(_llama3_cfg(), torch.device("cuda")).fixed(8192)
    q = qkv[:, : Hq * D].reshape(2, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hkv) * D].reshape(2, Hkv, D)
    rq, rk = rope(q, pos), rope(k, pos)
    got = qkv.clone()
    cos, sin = rope.tables(pos)
    fused.rope_(got, pos, cos, sin, Hq + Hkv, D)
    assert rel_err(got[:, : Hq * D].reshape(2, Hq, D), rq) < 4e-3
    assert rel_err(got[:, Hq * D: (Hq + Hkv) * D].reshape(2, Hkv, D), rk) < 4e-3
    assert torch.equal(got[:, (Hq + Hkv) * D:], qkv[:, (Hq + Hkv) * D:])  # v untouched
    # with Qwen3's q and k norms first, in the same kernel
    qn, kn = ((1 + 0.1 * torch.randn(D, device="cuda")).bfloat16() for _ in range(2))
    rq, rk = rope(rms_norm(q, qn, 1e-6), pos), rope(rms_norm(k, kn, 1e-6), pos)
    got = qkv.clone()
    fused.rope_(got, pos, cos, sin, Hq + Hkv, D, norms=(qn, kn, 1e-6, Hq))
    assert rel_err(got[:, : Hq * D].reshape(2, Hq, D), rq) < 1.2e-2  # a bf16 rounding or two either way
    assert rel_err(got[:, Hq * D: (Hq + Hkv) * D].reshape(2, Hkv, D), rk) < 1.2e-2
    assert torch.equal(got[:, (Hq + Hkv) * D:], qkv[:, (Hq + Hkv) * D:])

    gu = torch.randn(2, 2 * 14336, device="cuda").bfloat16()
    g, u = gu.chunk(2, dim=-1)
    assert rel_err(fused.silu_mul(gu), (F.silu(g.float()) * u.float()).bfloat16()) < 4e-3


@gpu
@pytest.mark.gpu
def test_gpu_rope_stores_kv_and_projection_adds_residual():
    """The RoPE kernel with Qwen3's norms also storing k and v in a pool, as RoPE then indexing
    would; a 4-bit projection with the residual in its epilogue, exactly torch's add (None where
    the rows do not take the GEMV)."""
    from gpu_ops import fused
    from gpu_ops.nf4 import nf4_linear
    from hetero.model import Rope

    torch.manual_seed(1)
    D, Hq, Hkv, BS = 128, 32, 4, 16
    qkv = torch.randn(2, (Hq + 2 * Hkv) * D, device="cuda").bfloat16()
    pos, slots = torch.tensor([7, 3000], device="cuda"), torch.tensor([5, 37], device="cuda")
    cos, sin = Rope(_llama3_cfg(), torch.device("cuda")).fixed(4096).tables(pos)
    qn, kn = ((1 + 0.1 * torch.randn(D, device="cuda")).bfloat16() for _ in range(2))
    want = qkv.clone()
    assert not fused.rope_(want, pos, cos, sin, Hq + Hkv, D, norms=(qn, kn, 1e-6, Hq))
    kp, vp = (torch.zeros(2, 4, Hkv, BS, D, device="cuda").bfloat16() for _ in range(2))
    got = qkv.clone()
    assert fused.rope_(got, pos, cos, sin, Hq + Hkv, D, norms=(qn, kn, 1e-6, Hq), kv_out=(kp, vp, 1, slots, BS, Hq, Hkv))
    assert torch.equal(got, want)
    for n, slot in enumerate(slots.tolist()):
        k = want[n, Hq * D: (Hq + Hkv) * D].view(Hkv, D)
        v = want[n, (Hq + Hkv) * D:].view(Hkv, D)
        assert torch.equal(kp[1, slot // BS, :, slot % BS], k) and torch.equal(vp[1, slot // BS, :, slot % BS], v)
    assert int(kp[0].count_nonzero()) == 0 and int(kp[1].count_nonzero()) == 2 * Hkv * D

    lin = nf4_linear(torch.randn(2048, 4096, device="cuda") * 0.02, None, torch.device("cuda"))
    x, res = torch.randn(1, 4096, device="cuda").bfloat16(), torch.randn(1, 2048, device="cuda").bfloat16()
    assert torch.equal(fused.linear_residual(lin, x, res), res + lin(x))
    many = torch.randn(300, 4096, device="cuda").bfloat16()
    assert fused.linear_residual(lin, many, torch.zeros(300, 2048, device="cuda").bfloat16()) is None


@gpu
@pytest.mark.gpu
def test_gpu_kv_write_kernel_matches_indexing():
    """GpuKVPool.write (one Triton kernel on CUDA) stores what indexing would, from strided views."""
    pool = GpuKVPool(3, 6, 8, 16, 128)
    qkv = torch.randn(3, 48 * 128, device="cuda").bfloat16()
    k, v = qkv[:, 32 * 128:40 * 128].view(3, 8, 128), qkv[:, 40 * 128:].view(3, 8, 128)
    slots = torch.tensor([0, 37, 95], device="cuda")
    pool.write(2, slots, k, v)
    blocks, offs = slots // 16, slots % 16
    assert torch.equal(pool.k[2, blocks, :, offs], k) and torch.equal(pool.v[2, blocks, :, offs], v)
    assert (pool.k != 0).sum() == (k != 0).sum() and (pool.v != 0).sum() == (v != 0).sum()  # nothing else written


def _llama3_cfg():
    from hetero.config import Arch, ModelConfig

    return ModelConfig(arch=Arch.LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, (32, 8, 4, 4)])
def test_gpu_nf4_gemv_residual_epilogue_is_torchs_add(config):
    from gpu_ops.nf4_gemv import nf4_gemv

    torch.manual_seed(1)
    w = torch.randn(1000, 2048, device="cuda") * 0.02
    packed, absmax = quantize_nf4(w)
    x = torch.randn(2, 2048, device="cuda").bfloat16()
    res = torch.randn(2, 1000, device="cuda").bfloat16()
    y = nf4_gemv(x, packed, absmax, (1000, 2048), config=config)
    assert torch.equal(nf4_gemv(x, packed, absmax, (1000, 2048), config=config, residual=res), res + y)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("config", [None, (4, 64, 4, 1), (8, 16, 4, 1)])
def test_gpu_nf4_gemv_swiglu_epilogue_is_silu_mul(rows, config):
    from gpu_ops import fused
    from gpu_ops.nf4_gemv import nf4_gemv

    torch.manual_seed(rows)
    F, K = 1000, 2048
    w = torch.randn(2 * F, K, device="cuda") * 0.05
    packed, absmax = quantize_nf4(w)
    x = torch.randn(rows, K, device="cuda").bfloat16()
    ref = fused.silu_mul(nf4_gemv(x, packed, absmax, (2 * F, K), config=config))
    got = nf4_gemv(x, packed, absmax, (2 * F, K), config=config, swiglu=True)
    assert got.shape == (rows, F) and rel_err(got, ref) < 4e-3


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("fmt", [WeightFormat.NF4, WeightFormat.Q4])
def test_gpu_fused_nf4_layers_give_the_torch_paths_tokens(tmp_path, batch, fmt):
    """4-bit weights (NF4, and the linear q4), 1-2 rows: the fused kernels (gpu_ops.fused) take the
    layer; the same model with them off (`Model.use_kernels(None, None)`) takes the torch ops. Same
    greedy tokens, graphs and eager."""
    from gpu_ops import fused

    folder = _tiny_separated(tmp_path, intermediate_size=128)  # every K a multiple of 64: our GEMV
    model = load_model(open_checkpoint(folder), fmt, torch.device("cuda"))
    assert model.layers[0].qkv.codes.value == ("q4" if fmt is WeightFormat.Q4 else "nf4")
    x = torch.zeros(batch, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert all(fused.applies(lw, x) for lw in model.layers)
    on = _greedy(model, 32, graphs=True, batch=batch)
    assert _greedy(model, 32, graphs=False, batch=batch) == on
    model.use_kernels(None, None)
    assert _greedy(model, 32, graphs=True, batch=batch) == on


# ---------------------------------------------------------------------------------- NF4 decoders (PTX)
def _decoder_words():
    torch.manual_seed(5)
    return [b * 0x01010101 for b in range(256)] + torch.randint(0, 1 << 32, (200,), dtype=torch.int64).tolist()


def _expected_codes(word: int) -> list[int]:
    """Element order: byte p gives element 2p (high nibble) then 2p + 1 (low nibble)."""
    return [c for p in range(4) for c in ((word >> (8 * p + 4)) & 15, (word >> (8 * p)) & 15)]


def test_prmt_decoder_gives_bf16_code_book_for_every_byte():
    from gpu_ops.nf4_ptx import bf16_bits, prmt_asm, prmt_tables
    from ptx_emu import run

    asm, bits, tables = prmt_asm(), bf16_bits(), prmt_tables()
    for word in _decoder_words():
        out = run(asm, {8: word, **{9 + i: t for i, t in enumerate(tables)}})
        assert [out[e] for e in range(8)] == [bits[c] << 16 for c in _expected_codes(word)], hex(word)


@pytest.mark.parametrize("scale", [0.0173, 3.1e-5, 1.0])
def test_q4_decoder_gives_dequantize_q4_for_every_code_and_zero(scale):
    """nf4_mma's linear decoder (`q4_bf16_asm`): the 8 bf16 of a word are dequantize_q4's bits,
    for every zero point 0..15 and the words of every repeated byte."""
    from gpu_ops.nf4_ptx import q4_bf16_asm
    from gpu_ops.q4 import dequantize_q4
    from ptx_emu import run

    s_bits = int(torch.tensor(scale).bfloat16().view(torch.int16)) & 0xFFFF
    words = _decoder_words()
    packed = torch.tensor(words, dtype=torch.int64).to(torch.int32)  # the words' bits as int32
    asm = q4_bf16_asm()
    for z in range(16):
        sz_word = (s_bits << 16) | (int(torch.tensor(128.0 + z).bfloat16().view(torch.int16)) & 0xFFFF)
        # each word as the first of a group of 64 codes (8 words) whose group word is sz_word
        groups = torch.zeros(len(words), 8, dtype=torch.int32)
        groups[:, 0] = packed
        sz = torch.full((len(words), 1), sz_word, dtype=torch.int64).to(torch.int32)
        ref = dequantize_q4(groups, sz, torch.bfloat16)[:, :8].contiguous().view(torch.int16)
        for i, word in enumerate(words):
            out = run(asm, {8: word, 9: sz_word})
            assert [out[e] for e in range(8)] == [int(v) & 0xFFFF for v in ref[i]], (hex(word), z)


@pytest.mark.parametrize("absmax", [None, 1.0, 0.0173, 3.1e-5])
def test_prmt_bf16_decoder_gives_codes_times_absmax_for_every_byte(absmax):
    """nf4_mma's decoder: bf16 bits of the code (None), or bf16(bf16(code) · bf16(absmax))."""
    import struct

    from gpu_ops.nf4_ptx import prmt_bf16_asm, prmt_tables
    from ptx_emu import run

    book = NF4_CODE.to(torch.bfloat16)
    inputs = {9 + i: t for i, t in enumerate(prmt_tables())}
    if absmax is not None:
        book = (book.float() * torch.tensor(absmax).bfloat16().float()).bfloat16()
        inputs[17] = struct.unpack("<I", struct.pack("<f", absmax))[0]
    bits = [int(v) & 0xFFFF for v in book.view(torch.int16)]
    asm = prmt_bf16_asm(absmax is not None)
    for word in _decoder_words():
        out = run(asm, {8: word, **inputs})
        assert [out[e] for e in range(8)] == [bits[c] for c in _expected_codes(word)], hex(word)
