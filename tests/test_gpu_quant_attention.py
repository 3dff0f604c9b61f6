"""Decode attention over int8 / int4 GpuKVPools: the torch twin (`decode_attention_torch`) on the
CPU against float64 and against the host tier's CPU kernel over the same bytes (CI), and the
Triton kernel (`gpu_ops.attention_quant`) against the twin and float64 on CUDA (`gpu`).

Pools are filled as decode fills them: each block gets a tail, takes its tokens, and is sealed
(quantized) once complete, so a sequence's partly filled last block is read from its bf16 tail;
`seal_all` also seals those (the codes then hold the padding rows too, never read). Data as
tests/test_cpu_attention.py's: keys and values randn plus a per-channel offset of each kv head.
`tests/quant_attention_interpret.py` runs the Triton kernel on these cases under Triton's CPU
interpreter.
"""
from __future__ import annotations

import math

import pytest
import torch

from cpu_attention import HostKVPool, KVDtype, int4, rotation
from cpu_attention import decode_attention as cpu_decode_attention
from cpu_attention.layout import int8_rows
from gpu_ops.attention import AttnKernel, decode_attention, decode_attention_torch, quant_shapes_ok
from gpu_ops.kv_pool import GpuKVPool

QUANT = [KVDtype.INT8, KVDtype.INT4]
# as tests/test_cpu_attention.py: against unquantized attention int8 2e-2, int4 8e-2 (a one-token
# sequence, one dequantized int4 value row: 1e-1); the CPU kernel against float64 over the same
# bytes 3e-3 (its value weights are rounded to a byte), its lse 3e-4 (int8's q rounded to int16)
QUANT_TOL = {KVDtype.INT8: 2e-2, KVDtype.INT4: 8e-2}
INT4_ONE_ROW_TOL = 1e-1
CPU_KERNEL_TOL, CPU_LSE_TOL = 3e-3, 3e-4
# the Triton kernel against float64 on the GPU: bf16 dot operands (q or q∘scale, softmax weights,
# int4 values dequantized to bf16), as the bf16 kernel's test allows; rotations keep ~16 bits
TRITON_TOL = 1e-2


def make_case(kv: KVDtype, D: int, BS: int, lens: list[int], G: int = 3, Hkv: int = 2, seed: int = 0,
              device: str = "cpu", layer: int = 1, seal_all: bool = False, open_full: bool = False):
    """A 2-layer pool with len(lens) sequences in shuffled blocks, tokens written at `layer` →
    (pool, tables [B, MB] int32, lens [B] int32, q [B, Hkv·G, D] float32, raw [(k, v) [n, Hkv, D] f64]).
    open_full: the last complete block of the first sequence that has one stays unsealed (a tail
    holding BS tokens)."""
    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-n // BS) for n in lens]
    NB = sum(nbs) + 2
    pool = GpuKVPool(2, NB, Hkv, BS, D, device=torch.device(device), kv_dtype=kv, max_tails=len(lens) + 1)
    perm = torch.randperm(NB, generator=gen)
    bt = torch.full((len(lens), max(max(nbs), 1)), int(perm[-1]), dtype=torch.int32)  # padding: a free block
    kmu = torch.randn(Hkv, D, generator=gen, dtype=torch.float64)
    vmu = torch.randn(Hkv, D, generator=gen, dtype=torch.float64)
    raw, c = [], 0
    opened = next((i for i, n in enumerate(lens) if n >= BS), None) if open_full else None
    for i, (n, nb) in enumerate(zip(lens, nbs)):
        bt[i, :nb] = perm[c:c + nb].int()
        c += nb
        k = torch.randn(n, Hkv, D, generator=gen, dtype=torch.float64) + kmu
        v = torch.randn(n, Hkv, D, generator=gen, dtype=torch.float64) + vmu
        for j in range(nb):
            blk, a, e = int(bt[i, j]), j * BS, min(n, (j + 1) * BS)
            pool.open_tail(blk)
            slots = torch.arange(blk * BS, blk * BS + e - a, device=device)
            pool.write(layer, slots, k[a:e].float().to(device), v[a:e].float().to(device))  # into its tail
            keep = i == opened and j == n // BS - 1
            if (e - a == BS or seal_all) and not keep:
                pool.seal([blk])
        raw.append((k, v))
    q = torch.randn(len(lens), Hkv * G, D, generator=gen)
    return pool, bt.to(device), torch.tensor(lens, dtype=torch.int32, device=device), q.to(device), raw


def dequantized64(pool: GpuKVPool, layer: int, bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, Hkv, MB·BS, D] float64 as the layout module doc defines them, assembled here (not
    by `pool.gather`): codes · scales (+ zeros), rotated parts times Rᵀ, tails as stored."""
    D, BS = pool.head_dim, pool.block_size
    sq = math.sqrt(rotation.block(D))
    R = torch.round(rotation.rotate(torch.eye(D)) * sq).double() / sq  # exact: ±1/√P and 0
    ids = bt.long().reshape(-1).cpu()
    part = {n: t[layer].cpu()[ids] for n, t in pool.parts().items()}
    if pool.kv_dtype is KVDtype.INT8:
        kc, vc = int8_rows(part["k"], part["v"], BS)
        k = kc.double() * part["k_scale"].double()[..., None] @ R.T
        v = vc.double() * part["v_scale"].double()[..., None] @ R.T
    else:
        k = int4.unpack_keys(part["k"]).double() * part["k_scale"].double()[..., None, :]
        k += part["k_zero"].double()[..., None, :]
        codes = int4.unpack(int4.unquads(part["v"], BS)).double().reshape(*part["v_scale"].shape, 32)
        y = codes * part["v_scale"].double()[..., None] + part["v_zero"].double()[..., None]
        v = y.reshape(*y.shape[:-2], D) @ R.T
    tail = pool.tail_of_block.cpu()[ids].long()
    has = tail >= 0
    k[has] = pool.tail_k[layer].cpu()[tail[has]].double()
    v[has] = pool.tail_v[layer].cpu()[tail[has]].double()
    B, MB = bt.shape
    shape = (B, MB, pool.num_kv_heads, BS, D)
    return tuple(x.reshape(shape).transpose(1, 2).reshape(B, pool.num_kv_heads, MB * BS, D) for x in (k, v))


def attend64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float):
    """float64 decode attention: q [B, Hq, D], k, v [B, Hkv, T, D] → (out [B, Hq, D], lse [B, Hq]);
    a sequence of no tokens: out 0, lse -inf."""
    B, Hq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    qg = q.double().cpu().reshape(B, Hkv, Hq // Hkv, D)
    s = (qg @ k.transpose(-1, -2)) * scale
    valid = torch.arange(T)[None, :] < lens.cpu().long()[:, None]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse[..., None]).nan_to_num(0.0) @ v
    return out.reshape(B, Hq, D), lse.reshape(B, Hq)


def exact64(q: torch.Tensor, raw, scale: float, Hkv: int):
    """Attention over the unquantized K/V, per sequence: [(out [Hq, D], lse [Hq])]."""
    res = []
    for b, (k, v) in enumerate(raw):
        ks, vs = (x.permute(1, 0, 2)[None] for x in (k, v))
        o, lse = attend64(q[b:b + 1], ks, vs, torch.tensor([len(k)]), scale)
        res.append((o[0], lse[0]))
    return res


def as_runs(case, R: int, seed: int = 0):
    """`case` with each non-empty sequence of n tokens as a run of R rows seeing n - R + 1 .. n of
    them (a speculative step's rows: one block table, consecutive lengths, their own queries) →
    (the case of B·R rows, RunRows). The reference data of a row is its sequence's first tokens."""
    from gpu_ops.runs import RunRows, run_codes

    pool, bt, lens, q, raw = case
    gen = torch.Generator().manual_seed(seed)
    rows, sizes, raws = [], [], []
    for b, n in enumerate(lens.tolist()):
        r = min(R, n) if n else 1
        rows += [b] * r
        sizes.append(r)
        raws += [(raw[b][0][: n - r + 1 + j], raw[b][1][: n - r + 1 + j]) for j in range(r)]
    idx = torch.tensor(rows)
    run_lens = torch.tensor([len(k) for k, _ in raws], dtype=torch.int32)
    q_rows = torch.randn(len(rows), *q.shape[1:], generator=gen).to(q.device)
    out = (pool, bt[idx.to(bt.device)], run_lens.to(lens.device), q_rows, raws)
    return out, RunRows(torch.tensor(run_codes(sizes), dtype=torch.int32, device=lens.device), max(sizes))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def check_against_references(out, lse, case, scale, tol, lse_tol, layer=1):
    """out, lse of a kernel on `case` against float64 over the stored bytes (tol), per sequence
    against the unquantized data (QUANT_TOL), and the empty sequences' 0 / -inf."""
    pool, bt, lens, q, raw = case
    ro, rl = attend64(q, *dequantized64(pool, layer, bt), lens, scale)
    out, lse = out.double().cpu(), lse.double().cpu()
    full = lens.cpu() > 0
    assert torch.isinf(lse[~full]).all() and (out[~full] == 0).all()
    assert rel(out[full], ro[full]) < tol
    assert (lse[full] - rl[full]).abs().max() < lse_tol
    for b, (eo, _) in enumerate(exact64(q, raw, scale, pool.num_kv_heads)):
        n = int(lens[b])
        if n:
            bound = INT4_ONE_ROW_TOL if (pool.kv_dtype is KVDtype.INT4 and n == 1) else QUANT_TOL[pool.kv_dtype]
            assert rel(out[b], eo) < bound, (b, n)


# ---------------------------------------------------------------------------------- CPU (CI)
@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("D,BS", [(64, 16), (128, 32), (32, 8), (64, 6)])
@pytest.mark.parametrize("open_full", [False, True])
def test_torch_twin_matches_float64(kv, D, BS, open_full):
    """Sealed blocks, tails of partly filled last blocks (and an unsealed complete one), an empty
    sequence, odd lengths: the twin is float32 over the same K/V (1e-5)."""
    lens = [1, 17, 0, 2 * BS + 3, 5 * BS]
    case = make_case(kv, D, BS, lens, seed=D + BS, open_full=open_full)
    pool, bt, sl, q, _ = case
    assert int((pool.tail_of_block[:-1] >= 0).sum()) == sum(n % BS != 0 for n in lens) + open_full
    scale = 1 / math.sqrt(D)
    out, lse = decode_attention(pool, 1, q, bt, sl, scale, AttnKernel.AUTO)  # AUTO on the CPU: the twin
    check_against_references(out, lse, case, scale, 1e-5, 1e-5)


@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("D,BS", [(64, 16), (128, 16), (32, 8)])
def test_torch_twin_matches_cpu_kernel_on_the_same_bytes(kv, D, BS):
    """The device pool's bytes copied into a HostKVPool (every block sealed, so both read codes only)
    and attended by the host tier's CPU kernel: the CPU kernel's own tolerances against float64."""
    lens = [1, 17, 3 * BS + 5, 6 * BS]
    pool, bt, sl, q, _ = make_case(kv, D, BS, lens, seed=7 * D + BS, seal_all=True)
    host = HostKVPool(2, pool.num_blocks + 1, pool.num_kv_heads, BS, D, kv)
    for name, t in pool.parts().items():
        getattr(host, name).copy_(t)
    scale = 1 / math.sqrt(D)
    o_cpu, l_cpu = cpu_decode_attention(host, 1, q, bt, sl, scale, threads=2)
    o, lse = decode_attention_torch(pool, 1, q, bt, sl, scale)
    assert rel(o_cpu, o) < CPU_KERNEL_TOL
    assert (l_cpu.double() - lse.double()).abs().max() < CPU_LSE_TOL


def test_int4_tails_read_like_host_tails():
    """int4 blocks being filled: the device tail (plain bf16) and the host tail (rotated values,
    bf16) of the same tokens give one attention, up to the bf16 rounding of the rotated values."""
    D, BS, lens = 64, 16, [5, 40, 23]
    pool, bt, sl, q, _ = make_case(KVDtype.INT4, D, BS, lens, seed=3)
    host = HostKVPool(2, pool.num_blocks + 1, pool.num_kv_heads, BS, D, KVDtype.INT4)
    for name, t in pool.parts().items():
        getattr(host, name).copy_(t)
    tails = (pool.tail_of_block[:-1] >= 0).nonzero().flatten().tolist()
    host.tails.reserve(len(tails))
    for blk in tails:
        s = host.tails.pop()
        host.tails.slot[1, blk] = s
        t = int(pool.tail_of_block[blk])
        host.tails.k[s] = pool.tail_k[1, t]
        host.tails.v[s] = rotation.rotate(pool.tail_v[1, t].float()).to(torch.bfloat16)
    scale = 1 / math.sqrt(D)
    o_cpu, l_cpu = cpu_decode_attention(host, 1, q, bt, sl, scale, threads=2)
    o, lse = decode_attention_torch(pool, 1, q, bt, sl, scale)
    assert rel(o_cpu, o) < 5e-3
    assert (l_cpu.double() - lse.double()).abs().max() < CPU_LSE_TOL


def test_quant_shapes_ok_is_exact():
    """What the Triton kernel accepts: powers of two, D 16-128 (int4 from 64), BS 16-64."""
    ok = [(kv, D, BS) for kv in QUANT for D in (16, 32, 48, 64, 96, 128, 256) for BS in (8, 12, 16, 32, 64, 128)
          if quant_shapes_ok(kv, D, BS)]
    want = {KVDtype.INT8: (16, 32, 64, 128), KVDtype.INT4: (64, 128)}
    for kv in QUANT:
        assert {(D, BS) for k, D, BS in ok if k is kv} == {(D, BS) for D in want[kv] for BS in (16, 32, 64)}
    assert not quant_shapes_ok(KVDtype.BF16, 128, 16)


# ---------------------------------------------------------------------------------- GPU
def _triton(case, scale, out_dtype=torch.float32):
    from gpu_ops.attention_quant import paged_decode_quant

    pool, bt, sl, q, _ = case
    return paged_decode_quant(pool, 1, q, bt, sl, scale, out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("D,BS", [(64, 16), (128, 16), (64, 32), (128, 32)])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_triton_matches_float64_and_twin(kv, D, BS, G):
    """Batches with odd lengths, an empty sequence, tails (one holding a complete block): splits of
    several blocks (a long sequence), of one block (32 short ones), and one split (no merge)."""
    scale = 1 / math.sqrt(D)
    for lens in ([1, 17, 0, 2 * BS + 3, 40 * BS + 7], [BS * 3 + 1] * 16 + [0, 5] * 8, [1, 5, 0, BS, BS - 1]):
        case = make_case(kv, D, BS, lens, G=G, Hkv=2, seed=G + D + BS, device="cuda", open_full=True)
        out, lse = _triton(case, scale)
        check_against_references(out, lse, case, scale, TRITON_TOL, 2e-2)
        pool, bt, sl, q, _ = case
        to, tlse = decode_attention_torch(pool, 1, q, bt, sl, scale)
        assert rel(out, to) < TRITON_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("kv", QUANT)
def test_gpu_triton_batch1_long_context(kv):
    """Batch 1, 8k tokens, GQA 4 (Llama-3-8B's head shape): many splits merged."""
    D, BS = 128, 16
    case = make_case(kv, D, BS, [8 * 1024 + 5], G=4, Hkv=8, seed=1, device="cuda")
    out, lse = _triton(case, 1 / math.sqrt(D))
    check_against_references(out, lse, case, 1 / math.sqrt(D), TRITON_TOL, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("lens", [[3000], [1, 100, 0, 37] * 4])
def test_gpu_triton_in_a_cuda_graph(kv, lens):
    """Captured, then replayed after the inputs change (new q, sequences 20 tokens longer, reaching
    into their tails): the replay gives what an eager call gives on the new inputs, bit for bit;
    bf16 out as the decode step asks."""
    from gpu_ops.attention_quant import prepare

    D, BS = 128, 16
    pool, bt, sl, q, _ = make_case(kv, D, BS, [n + 20 for n in lens], G=4, seed=5, device="cuda")
    prepare(pool)
    sl0 = torch.tensor(lens, dtype=torch.int32, device="cuda")
    lens_in, q_in = sl0.clone(), q.clone()
    decode_attention(pool, 1, q_in, bt, lens_in, 0.1, AttnKernel.TRITON, out_dtype=torch.bfloat16)  # compile
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_attention(pool, 1, q_in, bt, lens_in, 0.1, AttnKernel.TRITON, out_dtype=torch.bfloat16)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = decode_attention(pool, 1, q_in, bt, lens_in, 0.1, AttnKernel.TRITON, out_dtype=torch.bfloat16)
    q_in.copy_(torch.randn_like(q))
    lens_in.copy_(sl0 + 20 * (sl0 > 0))
    graph.replay()
    torch.cuda.synchronize()
    want_o, want_l = decode_attention(pool, 1, q_in, bt, lens_in, 0.1, AttnKernel.TRITON, out_dtype=torch.bfloat16)
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    to, tl_ = decode_attention_torch(pool, 1, q_in, bt, lens_in, 0.1)
    full = lens_in > 0
    assert rel(out[full], to[full]) < TRITON_TOL and rel(lse[full], tl_[full]) < TRITON_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("R", [2, 5, 8])
@pytest.mark.parametrize("BS,G", [(16, 4), (32, 1), (16, 8)])
def test_gpu_triton_runs_match_rows(kv, R, BS, G):
    """Runs of R rows (one program each, causal by their lengths): float64 and the unquantized
    data as any batch, and the kernel row by row (the same bytes) to float32 rounding; a long run
    (many splits), runs in tails and across a tail's start, a short sequence, an empty one."""
    from gpu_ops.attention_quant import paged_decode_quant

    D = 128
    scale = 1 / math.sqrt(D)
    for lens in ([40 * BS + 7, BS + 2, 0, 3], [5 * BS - 1, 2 * BS]):
        case, runs = as_runs(make_case(kv, D, BS, lens, G=G, Hkv=2, seed=R + BS, device="cuda", open_full=True), R)
        pool, bt, sl, q, _ = case
        out, lse = paged_decode_quant(pool, 1, q, bt, sl, scale, runs=runs)
        check_against_references(out, lse, case, scale, TRITON_TOL, 2e-2)
        ro, rl = paged_decode_quant(pool, 1, q, bt, sl, scale)
        full = sl > 0
        assert rel(out[full], ro[full]) < 1e-5 and (lse[full] - rl[full]).abs().max() < 1e-5


@pytest.mark.gpu
def test_gpu_auto_takes_triton_for_quantized_pools():
    pool = make_case(KVDtype.INT4, 128, 16, [5], device="cuda")[0]
    from gpu_ops.attention import triton_ok

    assert triton_ok(pool, torch.zeros(1, 6, 128, device="cuda"))
