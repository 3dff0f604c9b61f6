"""Write a GGUF file from a transformers model the way llama.cpp's converter lays it out."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from hetero.checkpoint import permute_for_gguf

# K-quants have no quantizer in gguf-py: random blocks with sane fp16 scales stand in.
_KQ = {Q.Q4_K: (144, [0, 2]), Q.Q5_K: (176, [0, 2]), Q.Q6_K: (210, [208])}


def encode(x: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """x [rows, cols] float32 → data for GGUFWriter.add_tensor(raw_dtype=qtype)."""
    if qtype == Q.F32:
        return x.astype(np.float32)
    if qtype in _KQ:
        size, f16_at = _KQ[qtype]
        blocks = rng.integers(0, 256, size=(x.shape[0], x.shape[1] // 256, size), dtype=np.uint8)
        for off in f16_at:
            blocks[..., off: off + 2] = np.frombuffer(
                rng.uniform(0.001, 0.01, blocks.shape[:2]).astype(np.float16).tobytes(), np.uint8
            ).reshape(*blocks.shape[:2], 2)
        return blocks.reshape(x.shape[0], -1)
    return quantize(x.astype(np.float32), qtype)


def _gguf_name(hf: str) -> str:
    table = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in table:
        return table[hf]
    parts = hf.split(".")
    i, rest = parts[2], ".".join(parts[3:])
    sub = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
           "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
           "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
           "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
           "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
           "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
           "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
           "mlp.gate.weight": "ffn_gate_inp.weight"}
    return f"blk.{i}.{sub[rest]}"


def write_gguf(path, folder, arch: str, qtype_for=lambda name, shape: Q.F32, seed: int = 0) -> dict[str, np.ndarray]:
    """Write the checkpoint saved in `folder` (by transformers) as GGUF; returns the raw arrays by GGUF name."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
    w.add_rope_freq_base(theta)
    w.add_key_length(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    n_exp = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", 0) or 0
    if n_exp:
        w.add_expert_count(n_exp)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(c, "moe_intermediate_size", c.intermediate_size))
    sd = {k: v.float() for k, v in load_file(f"{folder}/model.safetensors").items()}
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    written = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in sd.items():
        if ".experts." in name:  # stacked per layer: ffn_{gate,up,down}_exps [E, out, in]
            parts = name.split(".")
            experts.setdefault((parts[2], parts[-2]), {})[int(parts[5])] = t
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            t = permute_for_gguf(t, heads)
        gname = _gguf_name(name)
        x = t.numpy()
        qt = qtype_for(gname, x.shape) if x.ndim == 2 else Q.F32
        data = encode(x if x.ndim == 2 else x, qt, rng)
        w.add_tensor(gname, data, raw_dtype=qt)
        written[gname] = data
    for (layer, proj), per in experts.items():
        stacked = torch.stack([per[e] for e in sorted(per)]).numpy()
        gname = f"blk.{layer}.ffn_{proj.replace('_proj', '')}_exps.weight"
        w.add_tensor(gname, stacked, raw_dtype=Q.F32)
        written[gname] = stacked
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def _copy_tokenizer(w: GGUFWriter, src) -> None:
    """The tokenizer.* fields of the GGUFReader src into the writer w."""
    for name, f in src.fields.items():
        if name.startswith("tokenizer."):
            sub = f.types[1] if len(f.types) > 1 else None
            w.add_key_value(name, f.contents(), f.types[0], sub)


def write_tokenizer_only(path, source=None) -> None:
    """A GGUF with no tensors holding the tokenizer fields of `source` (default: the demo model):
    a few MB, for `write_llama3_8b_q4km(tokenizer_from=...)` on a host without the demo model."""
    from gguf import GGUFReader

    from hetero.demo import demo_model_path

    w = GGUFWriter(str(path), "llama")
    _copy_tokenizer(w, GGUFReader(str(source or demo_model_path())))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def write_llama3_8b_q4km(path, layers: int = 32, seed: int = 0, tokenizer_from=None) -> None:
    """A Llama-3-8B-shaped GGUF in llama.cpp's Q4_K_M mix (Q6_K for the output, for attn_v and
    ffn_down of every other layer; Q4_K elsewhere; F32 norms), random blocks, and the demo
    model's tokenizer (so its vocabulary, 49152, sizes the embedding). Streamed to disk one
    tensor at a time: about 4.4 GB at 32 layers, little memory. `layers` < 32 for a quick check;
    `tokenizer_from`: another GGUF whose tokenizer fields to copy (default: the demo model's)."""
    from gguf import GGUFReader

    from hetero.demo import demo_model_path

    h, ff, heads, kv_heads, hd = 4096, 14336, 32, 8, 128
    demo = GGUFReader(str(tokenizer_from or demo_model_path()))
    vocab = len(demo.fields["tokenizer.ggml.tokens"].data)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_key_length(hd)
    w.add_vocab_size(vocab)
    _copy_tokenizer(w, demo)
    tensors = [("token_embd.weight", (vocab, h), Q.Q4_K), ("output_norm.weight", (h,), Q.F32),
               ("output.weight", (vocab, h), Q.Q6_K)]
    for i in range(layers):
        strong = Q.Q6_K if i % 2 == 0 else Q.Q4_K  # Q4_K_M: more bits for half the value and down matrices
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (h,), Q.F32), (b + "ffn_norm.weight", (h,), Q.F32),
                    (b + "attn_q.weight", (heads * hd, h), Q.Q4_K), (b + "attn_k.weight", (kv_heads * hd, h), Q.Q4_K),
                    (b + "attn_v.weight", (kv_heads * hd, h), strong), (b + "attn_output.weight", (h, heads * hd), Q.Q4_K),
                    (b + "ffn_gate.weight", (ff, h), Q.Q4_K), (b + "ffn_up.weight", (ff, h), Q.Q4_K),
                    (b + "ffn_down.weight", (h, ff), strong)]
    rng = np.random.default_rng(seed)

    def data(shape, qt):
        if qt == Q.F32:
            return np.ones(shape, np.float32)
        return encode(np.empty((shape[0], shape[1]), np.float32), qt, rng)

    for name, shape, qt in tensors:  # the header needs every tensor's size before any data
        if qt == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            size = _KQ[qt][0]
            byte_shape = (shape[0], shape[1] // 256 * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qt in tensors:
        w.write_tensor_data(data(shape, qt))
    w.close()
