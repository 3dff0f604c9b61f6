"""Per-request counters the CLI prints after each answer (and the monitor will read)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    gen_tokens: int = 0
    gen_seconds: float = 0.0
    kv_gpu_tokens: int = 0
    kv_host_tokens: int = 0
    decode_tokens: int = 0
    drafted: int = 0  # speculative decoding: tokens drafted, and of them kept
    accepted: int = 0
    notes: list[str] = field(default_factory=list)  # what the context overflow dropped or cut

    def add_prefill(self, tokens: int, seconds: float) -> None:
        self.prompt_tokens += tokens
        self.prompt_seconds += seconds
        self.gen_tokens += 1  # a prefill's last logits give the first generated token

    def add_decode(self, tokens: int, seconds: float) -> None:
        self.gen_tokens += tokens
        self.decode_tokens += tokens
        self.gen_seconds += seconds

    def add_drafts(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def gen_tps(self) -> float:
        # The first token of each sequence comes from its prefill; the rate is over decode steps alone.
        return self.decode_tokens / self.gen_seconds if self.gen_seconds else 0.0

    def line(self) -> str:
        return (f"[ prompt {self.prompt_tokens} tok, {self.prompt_tps:.0f} t/s | generation {self.gen_tokens} tok, "
                f"{self.gen_tps:.1f} t/s{self._drafts()} | KV {_k(self.kv_gpu_tokens + self.kv_host_tokens)} tok: "
                f"{_k(self.kv_gpu_tokens)} GPU / {_k(self.kv_host_tokens)} CPU ]")

    def _drafts(self) -> str:
        return f", drafts {self.accepted}/{self.drafted} kept" if self.drafted else ""


def _k(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)
