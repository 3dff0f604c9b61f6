"""One frozen ModelConfig, built once from a HF `config.json` or GGUF metadata.

Everything downstream (model math, KV pools, the planner) takes this object; nothing reads
the raw config dicts again.
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hetero.errors import UserError


DEFAULT_CTX = 4096  # `-c 0`: the model's context, capped (a 128k default would size a needlessly large KV cache)


class Arch(str, enum.Enum):
    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    MIXTRAL = "mixtral"
    QWEN3_MOE = "qwen3_moe"


# HF `architectures[0]` / `model_type` → Arch
_HF_ARCHES = {
    "LlamaForCausalLM": Arch.LLAMA,
    "MistralForCausalLM": Arch.MISTRAL,
    "Qwen2ForCausalLM": Arch.QWEN2,
    "Qwen3ForCausalLM": Arch.QWEN3,
    "MixtralForCausalLM": Arch.MIXTRAL,
    "Qwen3MoeForCausalLM": Arch.QWEN3_MOE,
}
SUPPORTED = ", ".join(sorted(_HF_ARCHES))


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3`); `linear` divides positions."""

    kind: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: Arch
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3)
    num_experts: int = 0  # 0: dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: experts (True) or dense MLP
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            raise UserError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.num_experts and not self.moe_layers:
            object.__setattr__(self, "moe_layers", (True,) * self.num_layers)
        if not self.num_experts:
            object.__setattr__(self, "moe_layers", (False,) * self.num_layers)

    # derived sizes --------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def context_limit(self) -> int:
        """The longest context the model supports (its sliding window, where it has one)."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    def context(self, asked: int = 0) -> int:
        """The context to run: `asked`, or for 0 the model's capped at DEFAULT_CTX (every command alike)."""
        return min(self.context_limit, DEFAULT_CTX) if asked == 0 else asked

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> float:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.kv_size * bytes_per_value

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["arch"] = self.arch.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["arch"] = Arch(d["arch"])
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["moe_layers"] = tuple(d.get("moe_layers", ()))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers ≥5 writes `rope_parameters`; older files `rope_theta` + `rope_scaling`.
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return theta, None
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(scaling["factor"]))
    raise UserError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def config_from_hf(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """Build the config from a parsed HF `config.json`."""
    archs = hf.get("architectures") or []
    arch = next((_HF_ARCHES[a] for a in archs if a in _HF_ARCHES), None)
    if arch is None:
        found = archs[0] if archs else hf.get("model_type", "<none>")
        raise UserError(f"architecture {found!r} is not supported; supported: {SUPPORTED}")
    theta, scaling = _rope(hf)
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    layers = int(hf["num_hidden_layers"])
    num_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if arch not in (Arch.MIXTRAL, Arch.QWEN3_MOE):
        num_experts = 0
    moe_layers: tuple[bool, ...] = ()
    if arch == Arch.QWEN3_MOE:
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        dense = set(hf.get("mlp_only_layers") or [])
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return ModelConfig(
        arch=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or (hidden // heads if heads > 0 else 0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=arch == Arch.QWEN2 or bool(hf.get("attention_bias", False)),
        qk_norm=arch in (Arch.QWEN3, Arch.QWEN3_MOE),
        num_experts=num_experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)) if num_experts else 0,
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]) if num_experts else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", arch == Arch.MIXTRAL)) if num_experts else True,
        moe_layers=moe_layers,
        sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos(hf.get("eos_token_id")),
        name=name,
    )


def load_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"{folder} has no config.json: pass a Hugging Face model folder or a .gguf file")
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from e
    try:
        return config_from_hf(hf, name=folder.name)
    except KeyError as e:
        raise UserError(f"{path} lacks the field {e}, which the model math needs") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise UserError(f"{path} has a field of the wrong type ({e}): sizes must be whole numbers") from None


# Llama-3-8B, for benchmarks and planner tests (random weights of real shapes).
LLAMA3_8B = ModelConfig(
    arch=Arch.LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope_theta=500000.0, max_position_embeddings=131072, name="llama-3-8b-shape",
)
