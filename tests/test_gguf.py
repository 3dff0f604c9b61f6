"""GGUF: metadata → config, every tensor type dequantized, same logits as the safetensors twin."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

import hetero
from conftest import rel_err
from gguf_util import write_gguf
from hetero.checkpoint import open_checkpoint

PROMPT = [1, 5, 9, 23, 77, 101, 4, 66]
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "llama3": "llama"}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_f32_gguf_gives_the_safetensors_logits(tiny, tmp_path, arch):
    folder, ref = tiny(arch)
    path = tmp_path / "m.gguf"
    write_gguf(path, folder, GGUF_ARCH[arch])
    a = hetero.load(path, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False).logits(PROMPT)
    b = hetero.load(folder, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False).logits(PROMPT)
    assert rel_err(a, b) <= 1e-5


def test_tied_embeddings_gguf(tiny, tmp_path):
    folder, ref = tiny("llama3")
    path = tmp_path / "tied.gguf"
    write_gguf(path, folder, "llama")
    ck = open_checkpoint(path)
    assert ck.config.tie_word_embeddings and "lm_head.weight" not in ck.tensors


TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def test_every_quant_type_dequantizes(tmp_path):
    """Each linear in its own type: our reader returns gguf's dequantization, q/k un-permuted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    order = iter(TYPES * 2)
    chosen = {}

    def qtype(name, shape):
        chosen[name] = next(order)
        return chosen[name]

    path = tmp_path / "q.gguf"
    ref.save_pretrained(tmp_path / "hf")
    raw = write_gguf(path, tmp_path / "hf", "llama", qtype_for=qtype)
    assert set(TYPES) <= set(chosen.values())
    ck = open_checkpoint(path)
    assert {ck.tensors[n].dtype for n in ck.tensors} >= {t.name for t in TYPES}
    pairs = {"blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
             "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
             "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
             "token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    for gname, hname in pairs.items():
        expect = dequantize(raw[gname], chosen[gname]).reshape(ck.tensors[hname].shape)
        assert np.array_equal(ck.get(hname).numpy(), expect), gname
    # q rows come back in HF order: un-permuting what write_gguf permuted
    q_expect = torch.from_numpy(dequantize(raw["blk.0.attn_q.weight"], chosen["blk.0.attn_q.weight"]).reshape(256, 256))
    from hetero.checkpoint import _unpermute

    assert torch.equal(ck.get("model.layers.0.self_attn.q_proj.weight"), _unpermute(q_expect, 4))
    logits = hetero.load(path, device="cpu", weights="f32", kv_dtype="f32", tokenizer=False).logits([1, 2, 3])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("rows, cols", [(1, 32), (7, 96), (49, 576)])
def test_q8_0_dequantizes_as_gguf_does(rows, cols):
    """The reader's own Q8_0 path against gguf-py's, bit for bit (odd row counts, several blocks a row)."""
    from gguf.quants import quantize

    from hetero.gguf_file import Tensor, dequantize as ours

    x = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32) * 3
    x[0, :5] = 0.0
    raw = quantize(x, Q.Q8_0)  # [rows, bytes a row]
    t = Tensor("w", (cols, rows), Q.Q8_0, 0, raw.nbytes, raw.tobytes())
    assert np.array_equal(ours(t), dequantize(raw, Q.Q8_0))


def test_real_smollm2_knows_paris():
    engine = hetero.load(kv_dtype="bf16")  # the embedded demo model, int8 weights
    text = "".join(c.text for c in engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                                               temperature=0.0, max_new_tokens=32))
    assert "Paris" in text
