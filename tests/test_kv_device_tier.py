"""A quantized device KV tier (int8, int4) in the host tier's block format, with a CPU stand-in
for the device: the same bytes on both tiers, blocks moved as byte copies, logits within the
dtype's tolerance, and the planner's choice of each tier's format."""
import pytest
import torch

import hetero
from conftest import greedy_batch, rel_err
from cpu_attention import HostKVPool, KVDtype
from gpu_ops.kv_pool import GpuKVPool
from hetero.config import LLAMA3_8B
from planner.plan import Budget, Overrides, Workload
from planner.profile import HardwareProfile
from planner.search import plan as make_plan

PROMPT = [3, 17, 42, 99, 5, 150, 7, 8, 64, 33, 2, 11, 90, 91, 92, 93, 94, 95, 1, 2]
GiB = 2**30
TOL = {"int8": 3e-2, "int4": 1.5e-1}  # the host tier's tolerances for the same formats (test_offload.py)


def _engine(folder, **kw):
    return hetero.load(folder, device="cpu", weights="f32", tokenizer=False, block_size=4, **kw)


_greedy = greedy_batch


@pytest.fixture(scope="module")
def folder(tiny):
    return tiny("llama_hd32")[0]  # head dim 32: int4's groups


@pytest.mark.parametrize("kv", ["int8", "int4"])
@pytest.mark.parametrize("BS", [4, 16])
def test_device_blocks_hold_the_host_tiers_bytes(kv, BS):
    """Tokens written one at a time into a device tier (bf16 tails, sealed when complete) leave the
    same bytes a host pool's append writes, so moving a block is a byte copy."""
    gen = torch.Generator().manual_seed(BS)
    L, H, D, nb = 2, 3, 64, 4
    n = nb * BS - BS // 2  # the last block being filled
    # bf16 values, as the device computes them (its tails hold bf16)
    k = (torch.randn(n, H, D, generator=gen) + 3 * torch.randn(D, generator=gen)).bfloat16().float()
    v = torch.randn(n, H, D, generator=gen).bfloat16().float()
    host = HostKVPool(L, nb, H, BS, D, KVDtype(kv))
    dev = GpuKVPool(L, nb, H, BS, D, device=torch.device("cpu"), kv_dtype=KVDtype(kv), max_tails=2)
    blocks = [2, 0, 3, 1]
    for t in range(n):
        slot = torch.tensor([blocks[t // BS] * BS + t % BS])
        dev.open_tail(blocks[t // BS])
        for layer in range(L):
            host.write(layer, slot, k[t:t + 1], v[t:t + 1])
            dev.write(layer, slot, k[t:t + 1], v[t:t + 1])
        if t % BS == BS - 1:
            dev.seal([blocks[t // BS]])
    full = torch.tensor(blocks[:-1])
    for name, t in host.parts().items():
        assert torch.equal(t[:, full], getattr(dev, name)[:, full]), name
    assert dev.tail_of_block[blocks[-1]] >= 0 and (dev.tail_of_block[full] == -1).all()
    bt = torch.tensor([blocks], dtype=torch.int32)
    m = (nb - 1) * BS
    for layer in range(L):  # complete blocks read as the host's; the one being filled exactly, from its tail
        got_k, got_v = dev.gather(layer, bt)
        want_k, want_v = host.gather(layer, bt[0], n)
        assert rel_err(got_k[0, :, :m], want_k[:, :m]) < 1e-6 and rel_err(got_v[0, :, :m], want_v[:, :m]) < 1e-6
        assert torch.equal(got_k[0, :, m:n], k[m:].transpose(0, 1)) and torch.equal(got_v[0, :, m:n], v[m:].transpose(0, 1))


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_quantized_device_tier_logits_within_tolerance(folder, kv):
    want = _engine(folder, kv_dtype="f32").logits(PROMPT)
    e = _engine(folder, gpu_kv_dtype=kv, gpu_kv_tokens=64)
    assert e.cache.gpu.kv_dtype is KVDtype(kv)
    assert rel_err(e.logits(PROMPT), want) <= TOL[kv]
    split = _engine(folder, kv_dtype=kv, gpu_kv_dtype=kv, gpu_kv_tokens=8)
    assert rel_err(split.logits(PROMPT), want) <= TOL[kv]


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_swapped_blocks_come_back_byte_for_byte(folder, kv):
    e = _engine(folder, kv_dtype=kv, gpu_kv_dtype=kv, gpu_kv_tokens=64, parallel=2)
    e.runner.prefill(7, PROMPT * 2, 0)  # 40 tokens: 10 blocks of 4 on the device tier
    c, s = e.cache, e.cache.seqs[7]
    before = {n: t[:, s.gpu.blocks[:6]].clone() for n, t in c.gpu.parts().items()}
    assert c.swap_out(7, 6) == 6 and c.swap_in(7, 6) == 6
    after = {n: t[:, s.gpu.blocks[-6:]] for n, t in c.gpu.parts().items()}  # moved back in, appended last
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_swapping_quantized_blocks_changes_no_token(folder):
    """Both tiers int8: blocks swapped out and back in are the same bytes, attended by the CPU's
    kernel or the device's, so the greedy tokens of a run with swaps equal one without (the device
    tier holding both sequences' tokens). int4's CPU kernel rounds further (`test_cpu_attention`'s
    KERNEL_TOL): a tiny random model's near ties can flip there; its bytes are checked above."""
    kv = "int8"
    prompts = [PROMPT, PROMPT[::-1]]
    want = _greedy(_engine(folder, kv_dtype=kv, gpu_kv_dtype=kv, gpu_kv_tokens=64, parallel=2), prompts)
    e = _engine(folder, kv_dtype=kv, gpu_kv_dtype=kv, gpu_kv_tokens=24, parallel=1)  # room for 24 tokens in all
    got = [[] for _ in prompts]
    moved = False
    for c in e.generate(prompts, max_new_tokens=16, temperature=0.0):
        got[c.index].append(c.token)
        if e.cache.swapped_out_blocks and not moved:
            seq = next(iter(e.cache.seqs))
            e.cache.swap_out(seq, 2)
            e.cache.swap_in(seq, 1)
            moved = True
    assert e.cache.swapped_out_blocks > 0 and e.cache.swapped_in_blocks > 0
    assert got == want


def test_quantized_device_tier_tails_come_back(folder):
    """Finished sequences give their tails back: many short generations never run out of them."""
    e = _engine(folder, gpu_kv_dtype="int8", gpu_kv_tokens=64, parallel=2)
    for i in range(4):
        _greedy(e, [PROMPT[i:], PROMPT[: 9 + i]], n=5)
    pool = e.cache.gpu
    assert sorted(pool.free_tails) == list(range(pool.max_tails)) and not pool._tails


def _h100() -> HardwareProfile:
    return HardwareProfile.synthetic(gpu_gib=80, host_gib=128, cores=16, hbm_gbps=3000, gpu_tflops=700)


def _plan(ctx: int, batch: int, gib: float, **ov):
    wl = Workload(ctx_size=ctx, batch=batch, prompt_tokens=ctx - 64, gen_tokens=64)
    return make_plan(LLAMA3_8B, _h100(), Budget(int(gib * GiB), 100 * GiB), wl, Overrides(**ov))


def test_planner_keeps_full_precision_when_it_fits():
    p = _plan(4096, 1, 12)
    assert p.kv.gpu_dtype is KVDtype.BF16 and p.kv.host_tokens == 0
    assert any(c.setting == "--gpu-kv-dtype" and "full precision" in c.reason for c in p.choices)


def test_planner_puts_long_contexts_on_the_gpu_in_fewer_bits():
    """32k at 6 GiB: bf16 KV (4.3 GB) cannot sit beside the 4-bit weights, 4-bit KV (1.5 GB) can,
    and then no KV leaves the GPU."""
    p = _plan(32768, 1, 6)
    assert p.kv.host_tokens == 0 and p.kv.gpu_dtype in (KVDtype.INT8, KVDtype.INT4)
    assert p.memory.gpu_used <= p.budget.gpu_bytes
    pinned = _plan(32768, 1, 6, gpu_kv_dtype=KVDtype.BF16)
    assert pinned.kv.gpu_dtype is KVDtype.BF16 and pinned.kv.host_tokens > 0
    assert p.prediction.decode_tok_s > pinned.prediction.decode_tok_s


def test_planner_prefers_int8_within_the_margin():
    """16k at 6 GiB: bf16 KV does not fit beside the weights, int8 and int4 both do; int8 is taken
    unless int4 predicts more than QUALITY_MARGIN faster."""
    from planner.search import QUALITY_MARGIN

    p8 = _plan(16384, 1, 6, gpu_kv_dtype=KVDtype.INT8)
    p4 = _plan(16384, 1, 6, gpu_kv_dtype=KVDtype.INT4)
    assert p8.kv.host_tokens == 0 and p4.kv.host_tokens == 0
    assert _plan(16384, 1, 6, gpu_kv_dtype=KVDtype.BF16).kv.host_tokens > 0
    auto = _plan(16384, 1, 6)
    s8, s4 = p8.prediction.decode_tok_s, p4.prediction.decode_tok_s
    want = KVDtype.INT8 if s8 >= (1 - QUALITY_MARGIN) * max(s8, s4) else KVDtype.INT4
    assert auto.kv.gpu_dtype is want
