"""A checkpoint's tensors checked against what its config implies, from headers alone and
before any math runs: a config field or a tensor that disagrees is named, with the fix."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, Mapping, Protocol

from hetero.config import ModelConfig
from hetero.errors import UserError

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors' names; GGUF types are all weight formats


class HasShape(Protocol):
    shape: tuple[int, ...]
    dtype: str


def expected_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(tensor name, shape [out, in], the config fields it follows) of every tensor the model reads."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.q_size, cfg.kv_size
    yield "model.embed_tokens.weight", (cfg.vocab_size, h), "vocab_size, hidden_size"
    yield "model.norm.weight", (h,), "hidden_size"
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        yield p + "input_layernorm.weight", (h,), "hidden_size"
        yield p + "post_attention_layernorm.weight", (h,), "hidden_size"
        heads = "num_attention_heads × head_dim, hidden_size"
        kv_heads = "num_key_value_heads × head_dim, hidden_size"
        yield a + "q_proj.weight", (q, h), heads
        yield a + "k_proj.weight", (kv, h), kv_heads
        yield a + "v_proj.weight", (kv, h), kv_heads
        yield a + "o_proj.weight", (h, q), "hidden_size, num_attention_heads × head_dim"
        if cfg.attention_bias:
            yield a + "q_proj.bias", (q,), "num_attention_heads × head_dim"
            yield a + "k_proj.bias", (kv,), "num_key_value_heads × head_dim"
            yield a + "v_proj.bias", (kv,), "num_key_value_heads × head_dim"
        if cfg.qk_norm:
            yield a + "q_norm.weight", (hd,), "head_dim"
            yield a + "k_norm.weight", (hd,), "head_dim"
        m = p + "mlp."
        if cfg.moe_layers[i]:
            f = cfg.moe_intermediate_size
            yield m + "gate.weight", (cfg.num_experts, h), "num_experts, hidden_size"
            for e in range(cfg.num_experts):
                x = f"{m}experts.{e}."
                yield x + "gate_proj.weight", (f, h), "moe_intermediate_size, hidden_size"
                yield x + "up_proj.weight", (f, h), "moe_intermediate_size, hidden_size"
                yield x + "down_proj.weight", (h, f), "hidden_size, moe_intermediate_size"
        else:
            f = cfg.intermediate_size
            yield m + "gate_proj.weight", (f, h), "intermediate_size, hidden_size"
            yield m + "up_proj.weight", (f, h), "intermediate_size, hidden_size"
            yield m + "down_proj.weight", (h, f), "hidden_size, intermediate_size"


def check_tensors(cfg: ModelConfig, tensors: Mapping[str, HasShape], path: Path, floats_only: bool) -> None:
    """Every tensor the model reads is present, of a weight dtype, and of the shape the config implies."""
    expected = list(expected_shapes(cfg))
    if not cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        expected.append(("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "vocab_size, hidden_size"))
    config = "config.json" if path.is_dir() else "its metadata"
    missing = [name for name, _, _ in expected if name not in tensors]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UserError(f"{path} lacks tensors the {cfg.arch.value} architecture needs: "
                        f"{', '.join(missing[:3])}{more}; is it a complete {cfg.arch.value} checkpoint?")
    for name, shape, fields in expected:
        t = tensors[name]
        if floats_only and t.dtype not in FLOAT_DTYPES:
            raise UserError(f"{path}: tensor {name} is {t.dtype}; weights must be one of "
                            f"{', '.join(FLOAT_DTYPES)} (quantized safetensors are not read: use the original "
                            f"checkpoint or a .gguf)")
        if tuple(t.shape) != shape:
            raise UserError(f"{path}: tensor {name} has shape {list(t.shape)}, but {config} implies "
                            f"{list(shape)} ({fields}): the config and the weights disagree; fix {config} "
                            f"or use the weights it belongs to")


def check_config(cfg: ModelConfig, source: str) -> None:
    """Sizes the math uses: positive, consistent, and of a plausible magnitude (`source`: the file they came from)."""
    sizes = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
             "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
             "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings}
    if cfg.is_moe:
        sizes |= {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                  "moe_intermediate_size": cfg.moe_intermediate_size}
    if not all(cfg.moe_layers):
        sizes["intermediate_size"] = cfg.intermediate_size
    for name, v in sizes.items():
        if v <= 0:
            raise UserError(f"{source}: {name} is {v}; it must be a positive whole number")
    limits = {"hidden_size": 2**17, "intermediate_size": 2**20, "moe_intermediate_size": 2**20, "head_dim": 1024,
              "vocab_size": 2**24, "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_experts": 4096}
    for name, top in limits.items():
        if sizes.get(name, 0) > top:
            raise UserError(f"{source}: {name} {sizes[name]} is implausibly large (the largest known "
                            f"models stay under {top}); fix the config")
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(f"{source}: num_attention_heads {cfg.num_heads} is not a multiple of "
                        f"num_key_value_heads {cfg.num_kv_heads}")
    if cfg.is_moe and cfg.num_experts_per_tok > cfg.num_experts:
        raise UserError(f"{source}: num_experts_per_tok {cfg.num_experts_per_tok} exceeds the "
                        f"{cfg.num_experts} experts")
    if cfg.head_dim % 2:
        raise UserError(f"{source}: head_dim {cfg.head_dim} is odd; rotary embeddings need an even one")
    for name, tok in (("bos_token_id", cfg.bos_token_id), *(("eos_token_id", e) for e in cfg.eos_token_ids)):
        if tok is not None and not 0 <= tok < cfg.vocab_size:
            raise UserError(f"{source}: {name} {tok} is outside the vocabulary (vocab_size {cfg.vocab_size})")


def check_vocab(cfg: ModelConfig, tokenizer_size: int, path: Path) -> None:
    """The tokenizer must not produce ids the embedding table lacks."""
    if tokenizer_size > cfg.vocab_size:
        raise UserError(f"{path}: the tokenizer has {tokenizer_size} tokens but vocab_size is {cfg.vocab_size}: "
                        f"ids past {cfg.vocab_size - 1} have no embedding; use the tokenizer files that "
                        f"belong to these weights")


def check_bytes(path: Path, name: str, shape: tuple[int, ...], itemsize: int, nbytes: int) -> None:
    """A safetensors header entry whose shape and byte range disagree is corrupt."""
    need = math.prod(shape) * itemsize
    if need != nbytes:
        raise UserError(f"{path} is corrupt: tensor {name} has shape {list(shape)}, which needs {need} bytes, "
                        f"but the header gives it {nbytes}; download or copy the file again")
