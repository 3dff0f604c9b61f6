"""Checkpoint readers: HF folders (safetensors, single or sharded) and GGUF files.

Every reader names tensors the HF Llama way (`model.layers.3.self_attn.q_proj.weight`), with
MoE experts as `model.layers.3.mlp.experts.5.{gate,up,down}_proj.weight` and the router as
`model.layers.3.mlp.gate.weight`, whatever the source calls them, so the model code knows
one naming. `inspect` reads headers only; `Checkpoint.get` reads one tensor on demand.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from hetero.config import Arch, ModelConfig, RopeScaling, SUPPORTED, load_hf_config
from hetero.errors import UserError
from hetero.gguf_file import GGUFFile, dequantize
from hetero.validate import check_bytes, check_config, check_tensors

_ST_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
}
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # the file's own type name: "BF16", "Q4_K", ...
    nbytes: int


@dataclass
class CheckpointInfo:
    path: Path
    config: ModelConfig
    tensors: dict[str, TensorInfo]
    format: str  # "safetensors" | "gguf"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


# -------------------------------------------------------------------------------- safetensors
def _st_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header without touching tensor data → (header, data_start)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"{path} is truncated or not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if n > size - 8 or n > 100 * 2**20:
                raise UserError(f"{path} is corrupt: header length {n} exceeds the file ({size} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e}") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is corrupt: its safetensors header is not valid JSON ({e})") from e
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise UserError(
            f"{path} is truncated: its header promises {8 + n + end} bytes, the file has {size}; "
            "download or copy it again"
        )
    return header, 8 + n


def _st_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"{index} is corrupt: {e}") from e
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{folder} lacks shards named in its index: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has no *.safetensors weights (only safetensors checkpoints are read)")
    return files


def _canonical_hf(name: str) -> str:
    # Mixtral's block_sparse_moe.{gate, experts.e.w1/w3/w2} → mlp.{gate, experts.e.gate/up/down_proj}
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(\.experts\.\d+)\.w([123])\.", lambda m: f"{m[1]}.{ {'1': 'gate', '3': 'up', '2': 'down'}[m[2]] }_proj.", name)


class SafetensorsCheckpoint:
    format = "safetensors"

    def __init__(self, folder: Path):
        self.path = folder
        self.config = load_hf_config(folder)
        self.tensors: dict[str, TensorInfo] = {}
        self._where: dict[str, tuple[Path, str]] = {}
        for f in _st_files(folder):
            header, _ = _st_header(f)
            for raw, meta in header.items():
                name = _canonical_hf(raw)
                a, b = meta["data_offsets"]
                if meta["dtype"] in _ST_BYTES:
                    check_bytes(f, raw, tuple(meta["shape"]), _ST_BYTES[meta["dtype"]], b - a)
                self.tensors[name] = TensorInfo(tuple(meta["shape"]), meta["dtype"], b - a)
                self._where[name] = (f, raw)
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f, raw = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f].get_tensor(raw)


# -------------------------------------------------------------------------------------- GGUF
_GGUF_ARCHES = {"llama": Arch.LLAMA, "mistral": Arch.MISTRAL, "qwen2": Arch.QWEN2, "qwen3": Arch.QWEN3,
                "qwen3moe": Arch.QWEN3_MOE}
_GGUF_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"rope_freqs\.weight", "rope_freqs"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", r"model.layers.\1.mlp.gate.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", r"model.layers.\1.mlp.experts.*.\2_proj.weight"),
]


def _gguf_name(name: str) -> str | None:
    for pat, rep in _GGUF_NAMES:
        if re.fullmatch(pat, name):
            return re.sub(pat, rep, name)
    return None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _open_gguf_reader(path: Path) -> GGUFFile:
    try:
        reader = GGUFFile(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as e:
        raise UserError(f"{path} is not a readable GGUF file (corrupt or truncated: {e})") from e
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise UserError(f"{path} is truncated: its tensors need {end} bytes, the file has {size}")
    return reader


def gguf_config(reader, name: str = "") -> ModelConfig:
    arch_name = _field(reader, "general.architecture", "<none>")
    a = arch_name
    n_experts = int(_field(reader, f"{a}.expert_count", 0) or 0)
    arch = _GGUF_ARCHES.get(arch_name)
    if arch is Arch.LLAMA and n_experts:
        arch = Arch.MIXTRAL
    if arch is None:
        raise UserError(f"GGUF architecture {arch_name!r} is not supported; supported: llama, mistral, "
                        f"qwen2, qwen3, qwen3moe (HF: {SUPPORTED})")
    heads = int(_field(reader, f"{a}.attention.head_count"))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{a}.vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        vocab = next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight")
    scaling = None
    if _field(reader, f"{a}.rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(_field(reader, f"{a}.rope.scaling.factor")))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    ff = int(_field(reader, f"{a}.feed_forward_length", 0) or 0)
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=ff or int(_field(reader, f"{a}.expert_feed_forward_length", 0)),
        num_layers=int(_field(reader, f"{a}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{a}.attention.key_length", hidden // heads if heads > 0 else 0)),
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 4096)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        qk_norm=arch in (Arch.QWEN3, Arch.QWEN3_MOE),
        num_experts=n_experts,
        num_experts_per_tok=int(_field(reader, f"{a}.expert_used_count", 0) or 0),
        moe_intermediate_size=int(_field(reader, f"{a}.expert_feed_forward_length", 0) or ff) if n_experts else 0,
        norm_topk_prob=bool(_field(reader, f"{a}.expert_weights_norm", True)),  # llama.cpp normalises unless told
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=name,
    )


class GGUFCheckpoint:
    format = "gguf"

    def __init__(self, path: Path):
        self.path = path
        self.reader = _open_gguf_reader(path)
        try:
            self.config = gguf_config(self.reader, name=path.stem)
        except (TypeError, ValueError) as e:
            raise UserError(f"{path}: its metadata lacks or garbles a field the model math needs ({e})") from None
        self.tensors: dict[str, TensorInfo] = {}
        self._where: dict[str, tuple[object, int | None]] = {}
        for t in self.reader.tensors:
            name = _gguf_name(t.name)
            if name is None:
                continue
            shape = tuple(int(d) for d in reversed(t.shape))
            if "*" in name:  # stacked experts [E, out, in] → one tensor per expert
                per = int(t.n_bytes) // shape[0]
                for e in range(shape[0]):
                    self.tensors[name.replace("*", str(e))] = TensorInfo(shape[1:], t.tensor_type.name, per)
                    self._where[name.replace("*", str(e))] = (t, e)
            else:
                self.tensors[name] = TensorInfo(shape, t.tensor_type.name, int(t.n_bytes))
                self._where[name] = (t, None)

    def get(self, name: str) -> torch.Tensor:
        t, expert = self._where[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        x = dequantize(t).reshape(shape)
        if expert is not None:
            x = x[expert]
        x = np.ascontiguousarray(x)
        w = torch.from_numpy(x if x.flags.writeable else x.copy())  # F32 tensors come back as read-only maps
        # llama.cpp stores llama-family q/k rows permuted for its rotary layout; undo it.
        cfg = self.config
        if cfg.arch in (Arch.LLAMA, Arch.MISTRAL, Arch.MIXTRAL) and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            w = _unpermute(w, heads)
        return w


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, out // heads // 2, 2, *rest).transpose(1, 2).reshape(out, *rest)


def permute_for_gguf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_unpermute`: how llama.cpp's converter lays out q/k rows."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, out // heads // 2, *rest).transpose(1, 2).reshape(out, *rest)


# ------------------------------------------------------------------------------------- entry
Checkpoint = SafetensorsCheckpoint | GGUFCheckpoint


def open_checkpoint(path: str | Path) -> Checkpoint:
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"model path {p} does not exist: pass a Hugging Face model folder or a .gguf file")
    if p.is_dir():
        ck = SafetensorsCheckpoint(p)
        check_config(ck.config, str(p / "config.json"))
        check_tensors(ck.config, ck.tensors, p, floats_only=True)
        return ck
    if _is_gguf(p):
        ck = GGUFCheckpoint(p)
        check_config(ck.config, str(p))
        check_tensors(ck.config, ck.tensors, p, floats_only=False)
        return ck
    raise UserError(f"{p} is neither a model folder nor a GGUF file (it does not start with the GGUF magic)")


def _is_gguf(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise UserError(f"cannot read {p}: {e}") from e


def inspect(path: str | Path) -> CheckpointInfo:
    """Config and tensor sizes from headers alone; no tensor data is read."""
    ck = open_checkpoint(path)
    return CheckpointInfo(ck.path, ck.config, dict(ck.tensors), ck.format)


def iter_layer_names(cfg: ModelConfig, layer: int) -> Iterator[str]:
    """Canonical tensor names of one decoder layer, in the order the model uses them."""
    p = f"model.layers.{layer}."
    yield p + "input_layernorm.weight"
    for proj in ("q_proj", "k_proj", "v_proj"):
        yield p + f"self_attn.{proj}.weight"
        if cfg.attention_bias:
            yield p + f"self_attn.{proj}.bias"
    if cfg.qk_norm:
        yield p + "self_attn.q_norm.weight"
        yield p + "self_attn.k_norm.weight"
    yield p + "self_attn.o_proj.weight"
    yield p + "post_attention_layernorm.weight"
    if cfg.moe_layers[layer]:
        yield p + "mlp.gate.weight"
        for e in range(cfg.num_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield p + f"mlp.experts.{e}.{proj}.weight"
    else:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield p + f"mlp.{proj}.weight"

