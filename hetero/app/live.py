"""The server's live numbers: counters, the last minute per second, latency samples, and a snapshot.

The engine thread writes (`step`, `first_token`, `token`, `finished`); HTTP handlers read
`snapshot()`, which is what `/stats` returns and what `/metrics` is made from. Everything the
engine owns (the KV cache, the runner's timers) is read by the engine thread only and copied
here, so a reader never walks a structure the engine is changing.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

WINDOW_S = 60  # the monitor's sparklines and percentiles cover the last minute
RATE_S = 10  # "now" rates and busy fractions: the last ten seconds


@dataclass
class Second:
    """What happened in one wall-clock second."""

    t: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    step_s: float = 0.0  # the engine was inside a step
    decode_s: float = 0.0  # of which decode steps
    cpu_attention_s: float = 0.0
    cpu_experts_s: float = 0.0
    gpu_s: float = 0.0
    h2d_bytes: int = 0
    d2h_bytes: int = 0


@dataclass
class Totals:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # finish reason → count
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    cpu_attention_s: float = 0.0
    cpu_experts_s: float = 0.0
    gpu_s: float = 0.0
    step_s: float = 0.0
    draft_tokens: int = 0  # speculative decoding: tokens drafted, and of them kept
    accepted_tokens: int = 0


class LiveStats:
    def __init__(self, info: dict | None = None):
        self._lock = threading.Lock()
        self.started = time.time()
        self.totals = Totals()
        self.seconds: deque[Second] = deque(maxlen=WINDOW_S + 1)
        self.ttft: deque[tuple[float, float]] = deque(maxlen=4096)  # (when, seconds)
        self.itl: deque[tuple[float, float]] = deque(maxlen=16384)
        self.running = self.waiting = 0
        self.kv = {"gpu": 0, "cpu": 0}
        self.kv_capacity = {"gpu": 0, "cpu": 0}
        self.memory: dict[str, dict[str, int | None]] = {}
        self.info: dict = dict(info or {})
        self.loaded = False
        self.observers: list = []  # callables (kind, seconds) for histograms (the Prometheus view)

    # ------------------------------------------------------------------ written by the engine thread
    def _second(self, now: float) -> Second:
        t = int(now)
        if not self.seconds or self.seconds[-1].t != t:
            self.seconds.append(Second(t))
        return self.seconds[-1]

    def step(self, *, prompt_tokens: int, generation_tokens: int, wall: float, decode: bool, cpu_attention: float,
             gpu: float, h2d: int, d2h: int, drafted: int = 0, accepted: int = 0, cpu_experts: float = 0.0) -> None:
        with self._lock:
            s, tot = self._second(time.time()), self.totals
            s.prompt_tokens += prompt_tokens
            s.generation_tokens += generation_tokens
            s.step_s += wall
            s.decode_s += wall if decode else 0.0
            s.cpu_attention_s += cpu_attention
            s.cpu_experts_s += cpu_experts
            s.gpu_s += gpu
            s.h2d_bytes += h2d
            s.d2h_bytes += d2h
            tot.prompt_tokens += prompt_tokens
            tot.generation_tokens += generation_tokens
            tot.step_s += wall
            tot.cpu_attention_s += cpu_attention
            tot.cpu_experts_s += cpu_experts
            tot.gpu_s += gpu
            tot.h2d_bytes += h2d
            tot.d2h_bytes += d2h
            tot.draft_tokens += drafted
            tot.accepted_tokens += accepted

    def latency(self, kind: str, seconds: float) -> None:
        """kind: "ttft" (request arrival to its first token) or "itl" (between tokens of a request)."""
        with self._lock:
            (self.ttft if kind == "ttft" else self.itl).append((time.time(), seconds))
        for observe in self.observers:
            observe(kind, seconds)

    def finished(self, reason: str) -> None:
        with self._lock:
            self.totals.requests[reason] = self.totals.requests.get(reason, 0) + 1

    def set_waiting(self, waiting: int) -> None:
        with self._lock:
            self.waiting = waiting

    def state(self, *, running: int, kv: dict[str, int], kv_capacity: dict[str, int],
              memory: dict[str, dict[str, int | None]] | None) -> None:
        with self._lock:
            self.running = running
            self.kv, self.kv_capacity = dict(kv), dict(kv_capacity)
            if memory is not None:
                self.memory = memory

    # ------------------------------------------------------------------ read by the HTTP handlers
    def snapshot(self) -> dict:
        """Everything the monitor draws, as plain JSON-able data."""
        now = time.time()
        with self._lock:
            per_s = [asdict(s) for s in self.seconds if s.t > now - WINDOW_S - 1]
            ttft = [v for t, v in self.ttft if t > now - WINDOW_S]
            itl = [v for t, v in self.itl if t > now - WINDOW_S]
            totals = asdict(self.totals)
            running, waiting, kv, cap, mem = self.running, self.waiting, dict(self.kv), dict(self.kv_capacity), self.memory
        recent = [s for s in per_s if s["t"] >= int(now) - RATE_S]
        span = float(RATE_S)

        def rate(key: str, rows: list[dict], over: float) -> float:
            return sum(r[key] for r in rows) / over if over else 0.0

        busy_decode = sum(r["decode_s"] for r in per_s)
        return {
            "time": now,
            "uptime_s": now - self.started,
            "loaded": self.loaded,
            "info": self.info,
            "running": running,
            "waiting": waiting,
            "totals": totals,
            "rates": {
                "generation_tok_s": rate("generation_tokens", recent, span),
                "prompt_tok_s": rate("prompt_tokens", recent, span),
                # generation tokens over the time the engine spent decoding, last minute: the speed
                # a user sees while answers stream, not diluted by idle seconds
                "generation_tok_s_busy": sum(r["generation_tokens"] for r in per_s) / busy_decode if busy_decode else 0.0,
                "h2d_bytes_s": rate("h2d_bytes", recent, span),
                "d2h_bytes_s": rate("d2h_bytes", recent, span),
                "cpu_attention_busy": min(1.0, rate("cpu_attention_s", recent, span)),
                "cpu_experts_busy": min(1.0, rate("cpu_experts_s", recent, span)),
                "gpu_busy": min(1.0, rate("gpu_s", recent, span)),
                "engine_busy": min(1.0, rate("step_s", recent, span)),
                "draft_acceptance": totals["accepted_tokens"] / totals["draft_tokens"] if totals["draft_tokens"] else 0.0,
            },
            "per_second": _fill_seconds(per_s, int(now)),
            "latency": {"ttft": _percentiles(ttft), "itl": _percentiles(itl)},
            "kv": {tier: {"tokens": kv.get(tier, 0), "capacity": cap.get(tier, 0),
                          "usage": kv.get(tier, 0) / cap[tier] if cap.get(tier) else 0.0} for tier in ("gpu", "cpu")},
            "memory": mem,
        }


def _fill_seconds(rows: list[dict], now: int) -> dict[str, list[float]]:
    """The last minute as one value per second (0 where nothing ran), oldest first."""
    by_t = {r["t"]: r for r in rows}
    ts = range(now - WINDOW_S + 1, now + 1)
    return {key: [by_t[t][key] if t in by_t else 0 for t in ts] for key in ("generation_tokens", "prompt_tokens")}


def _percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"p50": None, "p95": None, "count": 0}
    v = sorted(values)

    def q(p: float) -> float:
        return v[min(len(v) - 1, int(round(p * (len(v) - 1))))]

    return {"p50": q(0.50), "p95": q(0.95), "count": len(v)}
