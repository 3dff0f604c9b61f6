"""The split runtime with real CUDA tiers: streams, pinned staging, the CPU worker thread."""
import pytest
import torch

import hetero
from conftest import rel_err

pytestmark = pytest.mark.gpu
PROMPT = [3, 17, 42, 99, 5, 150, 7, 8, 64, 33, 2, 11, 90, 91, 92, 93, 94, 95, 1, 2]


def _greedy(e, prompts, n=16):
    out = [[] for _ in prompts]
    for c in e.generate(prompts, max_new_tokens=n, temperature=0.0):
        out[c.index].append(c.token)
    return out


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


@pytest.mark.parametrize("block_size", [4, 16])
def test_cuda_streamed_int4_host_kv_matches_cpu(tiny, block_size):
    """int4 host blocks streamed up and dequantized on the GPU (keys per channel and block,
    values left rotated, the attention output rotated back, inside the captured graphs): the
    CPU run's tokens. Block 16 takes the Triton paged kernel, block 4 the torch one."""
    folder = tiny("llama_hd32")[0]
    prompt = PROMPT * 3
    kw = dict(weights="f32", kv_dtype="int4", tokenizer=False, block_size=block_size)
    want = _greedy(hetero.load(folder, device="cpu", **kw), [prompt])
    e = hetero.load(folder, device="cuda", gpu_kv_tokens=0, stream_tokens=2 * block_size, parallel=1, **kw)
    assert _greedy(e, [prompt]) == want
    assert len(e.runner.streamer.blocks) == 2
    assert e.runner.streamer.bytes_up > 0


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
