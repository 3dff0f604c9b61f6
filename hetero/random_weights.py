"""Random-weight models of named real shapes, built in memory: `hetero bench --random llama3-8b`.

`RandomCheckpoint` reads like a checkpoint (config, tensor names and shapes, `get(name)`), so
`hetero.load` builds it through the same loader, planner and runtime as a real file: the plan
places it, 4-bit weights are quantized on the GPU as they are made, streamed groups stream.
Each tensor is drawn when the loader asks for it, on the device it will be converted on, from a
generator seeded by its name (the same model every time). Speeds do not depend on the values.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import torch

from hetero.checkpoint import TensorInfo, iter_layer_names
from hetero.config import LLAMA3_8B, Arch, ModelConfig
from hetero.errors import UserError

SHAPES: dict[str, ModelConfig] = {
    "llama3-8b": LLAMA3_8B,
    "llama3-70b": ModelConfig(
        arch=Arch.LLAMA, vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        name="llama-3-70b-shape"),
    "qwen3-8b": ModelConfig(
        arch=Arch.QWEN3, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True,
        name="qwen3-8b-shape"),
    "qwen3-30b-a3b": ModelConfig(
        arch=Arch.QWEN3_MOE, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
        qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        name="qwen3-30b-a3b-shape"),
    "mixtral-8x7b": ModelConfig(
        arch=Arch.MIXTRAL, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
        name="mixtral-8x7b-shape"),
    "smollm2-135m": ModelConfig(
        arch=Arch.LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, name="smollm2-135m-shape"),
}


def random_shape(name: str) -> ModelConfig:
    try:
        return SHAPES[name]
    except KeyError:
        raise UserError(f"--random {name!r} is not a known shape; known: {', '.join(SHAPES)}") from None


HOST_DRAWN_BYTES = 256 * 2**20  # larger tensors are drawn in host memory


class RandomCheckpoint:
    """The tensors of `cfg`'s model as random bf16 numbers (norm weights 1), drawn on `device`."""

    format = "random"

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0):
        self.config, self.device, self.seed = cfg, torch.device(device), seed
        self.path = Path(f"random:{cfg.name}")  # a label: nothing is read from or cached at it
        self.tensors: dict[str, TensorInfo] = {n: TensorInfo(s, "BF16", 2 * _numel(s)) for n, s in _shapes(cfg)}

    def get(self, name: str) -> torch.Tensor:
        shape = self.tensors[name].shape
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16, device=self.device)
        # the embedding and lm_head (1 GB each at Llama-3's vocabulary) are drawn on the host, as a
        # file's tensors are read there: the loader moves them in pieces, within a --gpu-mem budget
        dev = self.device if _numel(shape) * 2 <= HOST_DRAWN_BYTES else torch.device("cpu")
        gen = torch.Generator(dev).manual_seed(self.seed + zlib.crc32(name.encode()))
        w = torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=dev)
        return w.mul_(0.02)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shapes(cfg: ModelConfig):
    H, D = cfg.hidden_size, cfg.head_dim
    yield "model.embed_tokens.weight", (cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        for name in iter_layer_names(cfg, i):
            yield name, _layer_shape(cfg, name.split(".", 3)[3], H, D)
    yield "model.norm.weight", (H,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, H)


def _layer_shape(cfg: ModelConfig, name: str, H: int, D: int) -> tuple[int, ...]:
    """The shape of a layer's tensor by its name within the layer ("self_attn.q_proj.weight")."""
    inter = cfg.moe_intermediate_size if ".experts." in name else cfg.intermediate_size
    rows = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size}
    if name.endswith("layernorm.weight"):
        return (H,)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (D,)
    proj = name.split(".")[-2]
    if name.endswith(".bias"):
        return (rows[proj],)
    if proj in rows:
        return (rows[proj], H)
    if proj == "o_proj":
        return (H, cfg.q_size)
    if proj == "gate":  # the router
        return (cfg.num_experts, H)
    if proj in ("gate_proj", "up_proj"):
        return (inter, H)
    if proj == "down_proj":
        return (H, inter)
    raise KeyError(name)
