"""Shared fixtures: tiny random checkpoints written by transformers into temp folders."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is. HETERO_TEST_NF4_TC=0 keeps the GEMV on its Triton kernel
    (a GPU run that isolates the tensor-core kernel's failures from the rest)."""
    if torch.cuda.is_available():
        if os.environ.get("HETERO_TEST_NF4_TC") == "0":
            from gpu_ops import nf4_tc

            nf4_tc.use(False)
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _spec(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**COMMON), tf.LlamaForCausalLM
    if arch == "llama3":  # rope_scaling llama3 and tied embeddings
        cfg = tf.LlamaConfig(**{**COMMON, "tie_word_embeddings": True},
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             rope_theta=500000.0)
        return cfg, tf.LlamaForCausalLM
    if arch == "llama_4l":  # four layers: three or more streamed layers cycle through two staging slots
        return tf.LlamaConfig(**{**COMMON, "num_hidden_layers": 4}), tf.LlamaForCausalLM
    if arch == "llama_wide":  # 30 MB of bf16 weights a layer: a GPU budget test can see where they live
        return tf.LlamaConfig(**{**COMMON, "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8,
                                 "num_hidden_layers": 4, "initializer_range": 0.03}), tf.LlamaForCausalLM
    if arch == "llama_hd32":  # head_dim 32: int4 KV groups need it
        return tf.LlamaConfig(**COMMON, head_dim=32), tf.LlamaForCausalLM
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=None), tf.MistralForCausalLM
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON), tf.Qwen2ForCausalLM
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=16), tf.Qwen3ForCausalLM
    if arch == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2), tf.MixtralForCausalLM
    if arch == "qwen3_moe_64":  # expert FFN 64: whole groups of the CPU's int4 expert format
        return (tf.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=16, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                  decoder_sparse_step=1), tf.Qwen3MoeForCausalLM)
    if arch == "mixtral_64":
        return (tf.MixtralConfig(**{**COMMON, "intermediate_size": 64}, num_local_experts=6, num_experts_per_tok=2),
                tf.MixtralForCausalLM)
    if arch == "qwen3_moe":
        return (tf.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1),
                tf.Qwen3MoeForCausalLM)
    raise KeyError(arch)


ARCHES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"]


def make_tiny(path, arch: str, seed: int = 0):
    """Write a tiny random `arch` checkpoint to `path`; returns the transformers model (float32)."""
    cfg, cls = _spec(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if arch == "qwen2":  # q/k/v biases start at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session", autouse=True)
def _numba_settings():
    """The engine's Numba settings (`_numba.configure`, what engine start does) for every test."""
    from cpu_attention import configure

    configure()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(arch) → (folder, transformers model), built once per session."""
    made = {}

    def get(arch: str):
        if arch not in made:
            folder = tmp_path_factory.mktemp(arch)
            made[arch] = (folder, make_tiny(folder, arch))
        return made[arch]

    return get


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def forced_plan(folder, force=None, weights=None, host_dtype=None, sub_batches=1, gpu_tokens=8, kv="f32",
                budget_gib=8, **overrides):
    """The planner's plan for a tiny checkpoint on a synthetic 24 GiB GPU (everything fits), with the
    groups in `force` ((layer, kind) → Mode) moved off the GPU as a plan that did not fit would put
    them (CPU-computed ones stored as `host_dtype` when given). Batch 2, context 64, block 4."""
    import dataclasses

    from cpu_attention.layout import KVDtype
    from hetero.checkpoint import open_checkpoint
    from planner import Budget, HardwareProfile, Overrides, Workload, plan
    from planner.plan import Device, Mode, Placement
    from planner.tensors import WDtype

    cfg = open_checkpoint(folder).config
    p = plan(cfg, HardwareProfile.synthetic(24), Budget(int(budget_gib * 2**30), 16 * 2**30),
             Workload(64, batch=2, gen_tokens=16),
             Overrides(weights=weights or WDtype.F32, kv_dtype=KVDtype(kv), block_size=4, threads=1,
                       sub_batches=sub_batches, gpu_kv_tokens=gpu_tokens, **overrides))
    force = force or {}
    out = []
    for x in p.placements:
        mode = force.get((x.layer, x.kind))
        if mode is None:
            out.append(x)
        else:
            dt = host_dtype if mode is Mode.CPU and host_dtype else x.dtype
            out.append(Placement(x.layer, x.kind, Device.CPU, dt, mode, x.nbytes))
    return dataclasses.replace(p, placements=tuple(out))


def greedy_batch(engine, prompts, n: int = 16) -> list[list[int]]:
    """Each prompt's greedy tokens, the prompts generated together (continuous batching)."""
    out = [[] for _ in prompts]
    for c in engine.generate(prompts, max_new_tokens=n, temperature=0.0):
        out[c.index].append(c.token)
    return out
