"""The `Plan`: where every weight group and every KV token lives, and what that predicts.

It is plain data (frozen dataclasses, a JSON round trip); the planner produces it and the
runtime follows it as-is. A user may save one (`hetero plan --json > plan.json`), edit it,
and run it (`--plan plan.json`).
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from cpu_attention.layout import KVDtype
from planner.tensors import Kind, WDtype

PLAN_FORMAT = 1


class Device(str, enum.Enum):
    CUDA = "cuda"
    CPU = "cpu"


class Mode(str, enum.Enum):
    RESIDENT = "resident"  # stored on the device that computes it
    STREAM = "stream"  # stored on the host, copied to the GPU over PCIe each step
    CPU = "cpu"  # stored on the host and computed by the CPU


@dataclass(frozen=True)
class Placement:
    layer: int  # -1 for embed, final_norm, lm_head
    kind: Kind
    device: Device  # where it is stored
    dtype: WDtype
    mode: Mode
    nbytes: int
    # experts groups split between the devices: the experts (indices in the layer) this placement
    # holds; the device's also holds the router. None: the whole group.
    experts: tuple[int, ...] | None = None
    # of a split layer's routed slots, the share its experts took in the routing statistics
    # (`planner.experts`); None: as many as its experts are of the layer's (uniform routing)
    share: float | None = None

    @property
    def name(self) -> str:
        return self.kind.value if self.layer < 0 else f"layers.{self.layer}.{self.kind.value}"

    @property
    def on_gpu(self) -> bool:
        return self.device is Device.CUDA


@dataclass(frozen=True)
class Workload:
    ctx_size: int  # KV capacity per sequence, tokens
    batch: int = 1  # sequences decoded together
    prompt_tokens: int = 0  # 0: ctx_size − gen_tokens
    gen_tokens: int = 256
    ubatch: int = 2048  # prefill chunk, tokens

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            object.__setattr__(self, "prompt_tokens", max(1, self.ctx_size - self.gen_tokens))

    @property
    def decode_context(self) -> int:
        """Tokens a decode step attends to on average over the answer."""
        return min(self.ctx_size, self.prompt_tokens + self.gen_tokens // 2)

    @classmethod
    def conversation(cls, ctx: int, batch: int = 1, ubatch: int = 2048) -> Workload:
        """A conversation that may fill the context, its decode compared over the second half: what
        `hetero.load`, `hetero chat` and `hetero serve` plan for."""
        return cls(ctx, batch, max(1, ctx // 2), max(1, ctx - ctx // 2), ubatch)

    def decode_contexts(self, n: int = 4) -> list[int]:
        """n contexts spread over the answer, at the middles of its n parts: a step's time is linear
        in the context within a KV tier but not across tiers, so its mean over the answer is the
        mean over these, not the time at `decode_context`."""
        return [min(self.ctx_size, self.prompt_tokens + (2 * i + 1) * self.gen_tokens // (2 * n)) for i in range(n)]


@dataclass(frozen=True)
class Budget:
    gpu_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class Overrides:
    """Values the user set; None means the planner chooses (and says why)."""

    device: Device | None = None
    weights: WDtype | None = None
    kv_dtype: KVDtype | None = None  # host tier
    gpu_kv_dtype: KVDtype | None = None
    threads: int | None = None
    sub_batches: int | None = None
    weight_mode: Mode | None = None  # STREAM or CPU for weights that do not fit on the GPU
    gpu_kv_tokens: int | None = None  # per sequence
    stream_tokens: int | None = None  # a sequence's host-tier tokens the GPU attends over after streaming them
    block_size: int | None = None
    n_cpu_moe: int = 0  # the experts of the first n MoE layers computed by the CPU (llama.cpp's --n-cpu-moe)


@dataclass(frozen=True)
class KVPlan:
    block_size: int
    gpu_tokens: int  # per sequence; a sequence's first tokens fill this tier first
    host_tokens: int  # per sequence
    gpu_dtype: KVDtype
    host_dtype: KVDtype
    gpu_bytes: int  # whole batch
    host_bytes: int  # whole batch
    # per sequence at batch 1: of the host tier's first tokens, how many the GPU attends over after
    # copying them up over PCIe each step (they stay stored on the host; offload/stream.py)
    stream_tokens: int = 0


@dataclass(frozen=True)
class Memory:
    gpu_budget: int
    gpu_free: int
    gpu_weights: int
    gpu_kv: int
    gpu_workspace: int  # activations, logits, staging buffers for streamed weights
    host_budget: int
    host_available: int
    host_weights: int
    host_kv: int

    @property
    def gpu_used(self) -> int:
        return self.gpu_weights + self.gpu_kv + self.gpu_workspace

    @property
    def host_used(self) -> int:
        return self.host_weights + self.host_kv


@dataclass(frozen=True)
class Prediction:
    prefill_tok_s: float
    decode_tok_s: float  # whole batch, at workload.decode_context
    decode_step_ms: float
    bottleneck: str  # e.g. "CPU attention: 2.1 GB of int8 KV at 61 GB/s"
    step_terms_ms: dict[str, float]  # per resource, summed over layers
    cpu_share: float  # of the bytes a decode step reads
    gpu_share: float


@dataclass(frozen=True)
class Choice:
    setting: str
    value: str
    reason: str


@dataclass(frozen=True)
class Plan:
    model: str
    num_layers: int
    device: Device
    weights: WDtype
    threads: int
    sub_batches: int
    placements: tuple[Placement, ...]
    kv: KVPlan
    workload: Workload
    budget: Budget
    memory: Memory
    prediction: Prediction
    choices: tuple[Choice, ...] = ()
    format: int = PLAN_FORMAT
    # a split MoE model's steps of at least this many rows copy their host experts up to the GPU
    # instead of the CPU computing them (planner.cost.host_experts_upload_rows); 0: none split
    moe_upload_rows: int = 0

    def placement(self, layer: int, kind: Kind) -> Placement:
        """The group's placement (a split experts group: its device part, which holds the router)."""
        for p in self.placements:
            if p.layer == layer and p.kind is kind:
                return p
        raise KeyError(f"no placement for layer {layer} {kind.value}")

    def expert_placements(self, layer: int) -> list[Placement]:
        """A layer's experts placements: one for the whole group, or its device and host parts."""
        return [p for p in self.placements if p.layer == layer and p.kind is Kind.EXPERTS]

    @property
    def gpu_layers(self) -> int:
        """Layers whose every weight group is resident on the GPU."""
        off = {p.layer for p in self.placements if p.layer >= 0 and not p.on_gpu}
        return self.num_layers - len(off)

    # JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _plain(asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if d.get("format") != PLAN_FORMAT:
            from hetero.errors import UserError

            raise UserError(f"plan format {d.get('format')} is not {PLAN_FORMAT}: make the plan again with `hetero plan`")
        return cls(
            model=d["model"], num_layers=d["num_layers"], device=Device(d["device"]),
            weights=WDtype(d["weights"]), threads=d["threads"], sub_batches=d["sub_batches"],
            placements=tuple(
                Placement(p["layer"], Kind(p["kind"]), Device(p["device"]), WDtype(p["dtype"]),
                          Mode(p["mode"]), p["nbytes"],
                          None if p.get("experts") is None else tuple(p["experts"]), p.get("share"))
                for p in d["placements"]
            ),
            kv=_load(KVPlan, d["kv"], gpu_dtype=KVDtype, host_dtype=KVDtype),
            workload=_load(Workload, d["workload"]), budget=_load(Budget, d["budget"]),
            memory=_load(Memory, d["memory"]), prediction=_load(Prediction, d["prediction"]),
            choices=tuple(_load(Choice, c) for c in d.get("choices", ())), format=d["format"],
            moe_upload_rows=d.get("moe_upload_rows", 0),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def _plain(x: Any) -> Any:
    """asdict output → JSON-ready (enums by value, tuples as lists)."""
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _load(cls: type, d: dict[str, Any], **enums: type) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: (enums[k](v) if k in enums else v) for k, v in d.items() if k in names})
